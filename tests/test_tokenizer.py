"""Tokenizer against transformers' own tokenizer for the same files, and StreamDecoder against a whole
decode. The tokenizers are trained here on a few lines (no download): byte-level BPE with GPT-2's,
Qwen2's and Llama-3's word splitting, and SentencePiece-style BPE (`▁` for spaces, `<0xNN>` byte
fallback) in the current and the legacy (Mixtral's) spelling. test_gguf_vocab and test_chat_template
build on the same tokenizers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_tokenizers import (
    SPM_CONFIG,
    STRINGS,
    VARIANTS,
    byte_level_tokenizer,
    random_ids,
    random_text,
    save_hf_dir,
    sentencepiece_tokenizer,
)
from transformers import AutoTokenizer

from moerun.text import StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: save_hf_dir(make(), root / name, **config) for name, (make, config) in VARIANTS.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_decode_like_transformers(hf_dirs, variant):
    ours, ref = Tokenizer.from_hf_dir(hf_dirs[variant]), AutoTokenizer.from_pretrained(hf_dirs[variant])
    rng = random.Random(variant)
    texts = STRINGS + [random_text(rng, 30) for _ in range(150)]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    for _ in range(200):
        ids = random_ids(rng, ours, 16)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids
    assert ours.vocab_size == len(ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_special_tokens_like_transformers(hf_dirs, variant):
    ours, ref = Tokenizer.from_hf_dir(hf_dirs[variant]), AutoTokenizer.from_pretrained(hf_dirs[variant])
    assert ours.bos_id == ref.bos_token_id
    assert ours.eos_ids == {ref.eos_token_id}
    # Special: what decode(skip_special_tokens=True) leaves out.
    assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == {
        i for i, token in ref.added_tokens_decoder.items() if token.special
    }
    # BOS goes in front exactly when transformers puts it there.
    assert (ours.encode("x")[0] == ours.bos_id) == (ref.encode("x")[0] == ref.bos_token_id)


def test_bos_follows_tokenizer_json_not_config(tmp_path):
    # transformers 5 reads add_bos_token from tokenizer.json's post-processor, not from the config.
    tok = sentencepiece_tokenizer()
    tok.post_processor = None
    directory = save_hf_dir(tok, tmp_path, **SPM_CONFIG)
    ours, ref = Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.encode("Hello") == ref.encode("Hello")
    assert ours.encode("Hello")[0] != ours.bos_id == 1


def test_config_files(tmp_path):
    tok = byte_level_tokenizer("qwen2")
    directory = save_hf_dir(
        tok,
        tmp_path,
        generation_config={"bos_token_id": 0, "eos_token_id": [2, 0]},
        eos_token={"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        chat_template=[{"name": "default", "template": "config"}, {"name": "tool_use", "template": "tools"}],
    )
    ours = Tokenizer.from_hf_dir(directory)
    assert ours.eos_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert ours.bos_id is None  # the config names none (generation_config's bos_token_id is not read)
    assert ours.chat_template == "config"
    (directory / "chat_template.jinja").write_text("file")
    assert Tokenizer.from_hf_dir(directory).chat_template == "file"
    (directory / "tokenizer_config.json").unlink()
    assert Tokenizer.from_hf_dir(directory).eos_ids == {2, 0}
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(directory)


def test_config_declares_missing_special_token(tmp_path):
    # A special token the config names but tokenizer.json lacks is added, as transformers adds it.
    directory = save_hf_dir(
        byte_level_tokenizer("gpt2"), tmp_path, eos_token="<|endoftext|>", extra_special_tokens=["<|tool|>"]
    )
    ours, ref = Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.encode("a<|tool|>b") == ref.encode("a<|tool|>b")
    assert ours.is_special(ours.token_to_id("<|tool|>"))


def stream(tokenizer: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_stream_decoder_equals_decode(hf_dirs, variant):
    tokenizer = Tokenizer.from_hf_dir(hf_dirs[variant])
    rng = random.Random(variant)
    cases = [random_ids(rng, tokenizer, 24) for _ in range(300)]
    cases += [tokenizer.encode(random_text(rng, 30)) for _ in range(100)]
    for ids in cases:
        for skip in (True, False):
            assert "".join(stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip), ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_stream_decoder_emits_whole_characters_as_they_complete(hf_dirs, variant):
    tokenizer = Tokenizer.from_hf_dir(hf_dirs[variant])
    text = "Hello wörld, 日本語 🙂 and 👍🏽 done. The end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Text comes out as it is generated: all but the last few ids' text is out before the flush.
    assert len("".join(pieces[:-1])) >= len(text) - len(" end")
    if tokenizer.byte_fallback_ids:  # the SentencePiece vocabularies spell 🙂 in 4 byte tokens
        assert sum(i in tokenizer.byte_fallback_ids for i in ids) >= 4


def test_stream_decoder_leading_space_after_first_piece(hf_dirs):
    # SentencePiece drops the `▁` of the first piece only; later pieces keep their space.
    tokenizer = Tokenizer.from_hf_dir(hf_dirs["spm"])
    ids = tokenizer.encode("Hello world the end")
    pieces = stream(tokenizer, ids)
    assert pieces[0] == ""  # BOS
    assert "".join(pieces) == "Hello world the end"
    assert any(piece.startswith(" ") for piece in pieces)


def test_stream_decoder_byte_run_ending_in_a_lone_byte(hf_dirs):
    # A byte run is decoded whole: "€" then a lone 0xE2 turn into four U+FFFD, so "€" must wait.
    tokenizer = Tokenizer.from_hf_dir(hf_dirs["spm"])
    euro = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ids = [*euro, euro[0], tokenizer.token_to_id("<s>"), *tokenizer.encode("ok", add_special_tokens=False)]
    assert tokenizer.decode(ids).startswith("\ufffd" * 4)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)
    assert stream(tokenizer, euro)[:3] == ["", "", ""]
