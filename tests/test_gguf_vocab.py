"""Tokenizers rebuilt from GGUF metadata against the tokenizer.json they were written from and against
transformers' own GGUF tokenizer loading. The GGUF files are written here with gguf-py's writer from
the tiny tokenizers of test_tokenizer, as llama.cpp's converter writes a vocabulary: tokens, types
(control for special added tokens, user-defined for the other added ones, byte for `<0xNN>`), scores
for SentencePiece, merges for byte-level BPE."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_tokenizers import (
    STRINGS,
    add_gguf_vocab,
    byte_level_tokenizer,
    random_ids,
    random_text,
    sentencepiece_tokenizer,
    vocab_tokens,
)
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, pre_tokenizers
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import generate_merges

from moerun.loader import GGUFFile
from moerun.text import ChatTemplateError, Tokenizer
from moerun.text.gguf_vocab import byte_level_pre_tokenizer, bytes_to_unicode, merges_from_scores


def write_gguf_vocab(
    tok: Backend,
    path: Path,
    kind: str,
    arch: str,
    pre: str | None = None,
    merges: bool = True,
    scores: bool = True,
    chat_template: str | None = None,
    **keys,
) -> Path:
    """A GGUF file holding `tok`'s vocabulary (no tensors); `keys` are GGUFWriter.add_<key> calls,
    e.g. bos_token_id=1, add_bos_token=True."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_vocab(writer, tok, kind, pre, merges, scores, chat_template, **keys)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_IDS = dict(bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=True)
CASES = {
    # name: (tokenizer, GGUF kind, general.architecture, tokenizer.ggml.pre, write merges, keys)
    "spm-merges": (sentencepiece_tokenizer, "llama", "llama", None, True, SPM_IDS),
    "spm-scores": (sentencepiece_tokenizer, "llama", "llama", None, False, SPM_IDS),
    "spm-phi3": (lambda: sentencepiece_tokenizer(legacy=True), "llama", "phi3", None, False, SPM_IDS),
    "gpt2": (lambda: byte_level_tokenizer("gpt2"), "gpt2", "qwen2", "gpt2", True, dict(eos_token_id=0)),
    "olmo": (lambda: byte_level_tokenizer("gpt2"), "gpt2", "olmoe", "olmo", True, dict(eos_token_id=0)),
    "qwen2": (
        lambda: byte_level_tokenizer("qwen2"),
        "gpt2",
        "qwen2",
        "qwen2",
        True,
        dict(eos_token_id=2, pad_token_id=0, add_bos_token=False),
    ),
    "llama-bpe": (
        lambda: byte_level_tokenizer("llama3"),
        "gpt2",
        "llama",
        "llama-bpe",
        True,
        dict(bos_token_id=0, eos_token_id=3, add_bos_token=True),
    ),
}
# transformers has no GGUF support for these architectures; the tokenizer.json is the oracle.
NO_TRANSFORMERS = {"olmo"}


@pytest.fixture(scope="module")
def gguf_cases(tmp_path_factory) -> dict[str, tuple[Backend, Path]]:
    root = tmp_path_factory.mktemp("gguf_vocab")
    out = {}
    for name, (make, kind, arch, pre, merges, keys) in CASES.items():
        (root / name).mkdir()
        tok = make()
        out[name] = tok, write_gguf_vocab(tok, root / name / "vocab.gguf", kind, arch, pre, merges, **keys)
    return out


def load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata, source=str(path))


@pytest.mark.parametrize("case", CASES)
def test_like_the_tokenizer_it_was_written_from(gguf_cases, case):
    original, path = gguf_cases[case]
    ours = load(path)
    rng = random.Random(case)
    for text in STRINGS + [random_text(rng, 30) for _ in range(100)]:
        assert ours.encode(text) == original.encode(text).ids, text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
    for _ in range(100):
        ids = random_ids(rng, ours, 16)
        for skip in (True, False):
            assert ours.decode(ids, skip) == original.decode(ids, skip_special_tokens=skip), ids
    assert ours.vocab_size == original.get_vocab_size()


@pytest.mark.parametrize("case", [c for c in CASES if c not in NO_TRANSFORMERS])
def test_like_transformers_gguf_loading(gguf_cases, case):
    _, path = gguf_cases[case]
    ours, ref = load(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rng = random.Random(case)
    for text in STRINGS + [random_text(rng, 30) for _ in range(100)]:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, add_special_tokens=special), text
    for _ in range(100):
        ids = random_ids(rng, ours, 16)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids
    assert ours.bos_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_ids
    assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == {
        i for i, token in ref.added_tokens_decoder.items() if token.special
    }


def test_merges_from_scores_like_transformers():
    tok = sentencepiece_tokenizer()
    tokens = vocab_tokens(tok)
    rng = random.Random(0)
    scores = [float(rng.choice([0.0, -1.0, -2.5, rng.uniform(-10, 0)])) for _ in tokens]  # with ties
    vocab = {t: i for i, t in enumerate(tokens)}
    assert merges_from_scores(tokens, scores) == generate_merges(
        vocab, dict(zip(tokens, scores, strict=True))
    )


def test_special_token_text_outside_the_byte_alphabet(tmp_path):
    # DeepSeek's "<｜end▁of▁sentence｜>" is stored as its text; it must stay one token with its own id.
    # (transformers respells it in the byte alphabet, so its text no longer matches it.)
    eos = "<｜end▁of▁sentence｜>"
    tok = byte_level_tokenizer("gpt2", extra_special=(eos,))
    eos_id = tok.token_to_id(eos)
    path = write_gguf_vocab(tok, tmp_path / "v.gguf", "gpt2", "deepseek2", "gpt2", eos_token_id=eos_id)
    ours = load(path)
    text = f"Hi there{eos}日本"
    assert ours.encode(text) == tok.encode(text).ids
    assert eos_id in ours.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.decode(ours.encode(text)) == "Hi there日本"
    assert ours.eos_ids == {eos_id, tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    assert ours.vocab_size == tok.get_vocab_size()


def test_no_space_prefix(tmp_path):
    # llama.cpp honours add_space_prefix = false (transformers always puts the `▁` in front): the
    # same vocabulary with no `▁` put in front, nor taken off by decode.
    tok = sentencepiece_tokenizer()
    path = write_gguf_vocab(tok, tmp_path / "v.gguf", "llama", "llama", add_space_prefix=False, **SPM_IDS)
    ours = load(path)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    for text in STRINGS:
        assert ours.encode(text) == tok.encode(text).ids
        assert ours.decode(ours.encode(text)) == tok.decode(tok.encode(text).ids)
    assert not ours.id_to_token(ours.encode("Hello")[1]).startswith("▁")
    assert ours.decode(ours.encode(" x y")) == " x y"


def test_special_ids_and_flags(tmp_path):
    tok = byte_level_tokenizer("llama3")
    end_ids = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    path = write_gguf_vocab(
        tok, tmp_path / "v.gguf", "gpt2", "llama", "llama-bpe", bos_token_id=0, eot_token_id=5
    )
    ours = load(path)
    # No add_bos_token key: llama.cpp adds BOS for Llama-3 vocabularies.
    assert ours.encode("hi")[0] == 0 == ours.bos_id
    assert ours.eos_ids == {5} | end_ids
    path = write_gguf_vocab(
        tok, tmp_path / "w.gguf", "gpt2", "qwen2", "qwen2", eos_token_id=3, add_eos_token=True
    )
    ours = load(path)
    assert ours.bos_id is None
    assert ours.encode("hi")[-1] == 3 and ours.encode("hi")[0] != 0
    # Metadata read by gguf-py holds numpy scalars; ids given that way count the same.
    metadata = {**GGUFFile(path).metadata, "tokenizer.ggml.bos_token_id": np.uint32(0)}
    assert Tokenizer.from_gguf_metadata(metadata).bos_id == 0


def test_chat_template_from_metadata(tmp_path):
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    template += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tok = byte_level_tokenizer("qwen2")
    path = write_gguf_vocab(
        tok, tmp_path / "v.gguf", "gpt2", "qwen2", "qwen2", chat_template=template, eos_token_id=2
    )
    ours, ref = load(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file="v.gguf")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 日本"}]
    assert ours.render_chat(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(messages) == ids
    no_template = load(write_gguf_vocab(tok, tmp_path / "w.gguf", "gpt2", "qwen2", "qwen2", eos_token_id=2))
    with pytest.raises(ChatTemplateError, match="w.gguf has no chat template"):
        no_template.render_chat(messages)


def test_pre_tokenizer_splits():
    # Closed-form cuts for the expressions transformers has no GGUF oracle for.
    spelled = {c: b for b, c in bytes_to_unicode().items()}

    def cuts(pre: str, text: str) -> list[str]:
        pieces = byte_level_pre_tokenizer(pre).pre_tokenize_str(text)
        return [bytes(spelled[c] for c in piece).decode() for piece, _ in pieces]

    text = "abc 1234567 日本語x!?Hi"
    assert cuts("deepseek-v3", text) == ["abc", " ", "123", "456", "7", " ", "日本語", "x", "!?", "Hi"]
    assert cuts("refact", "ab 123 cd") == ["ab", " ", "1", "2", "3", " cd"]
    assert cuts("qwen2", "It's 123") == ["It", "'s", " ", "1", "2", "3"]
    assert cuts("llama-bpe", "It's 12345") == ["It", "'s", " ", "123", "45"]
    omega = "\u03a9\u03bc\u03ad\u03b3\u03b1"  # Greek, in DeepSeek-LLM's letter ranges
    assert cuts("deepseek-llm", f"Hello {omega} 世界 123\n") == [
        "Hello",
        f" {omega}",
        " ",
        "世界",
        " ",
        "123",
        "\n",
    ]
    assert cuts("olmo", "It's 12345!") == ["It", "'s", " 12345", "!"]


def test_unsupported(tmp_path):
    tok = byte_level_tokenizer("gpt2")
    path = write_gguf_vocab(tok, tmp_path / "a.gguf", "gpt2", "qwen2", "made-up-pre", eos_token_id=0)
    with pytest.raises(ValueError, match="a.gguf.*pre-tokenizer 'made-up-pre'"):
        load(path)
    path = write_gguf_vocab(tok, tmp_path / "b.gguf", "bert", "bert", merges=False, eos_token_id=0)
    with pytest.raises(ValueError, match="tokenizer kind 'bert'.*'llama'.*'gpt2'"):
        load(path)
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
