"""Perplexity against transformers on the same tiny model and ids: in sliding windows, against its own
loss over the guide's windows ("Perplexity of fixed-length models"); in llama.cpp's chunks, against
its logits scored by the rule of llama.cpp's tools/perplexity/perplexity.cpp, written out here from
that source; and `moerun perplexity`, which counts as llama.cpp does unless given --stride."""

import json
import math

import pytest
import torch
from hf_models import make_model, save_model
from tiny_tokenizers import VARIANTS, byte_level_tokenizer, save_hf_dir

import moerun
from moerun.cli.main import main
from moerun.perplexity import chunks, perplexity, windows

TEXT = "The quick brown fox jumps over the lazy dog. Le café coûte 3 €, 日本語 ok. " * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl")
    tok = byte_level_tokenizer("gpt2")
    save_hf_dir(tok, path, tokenizer_class="PreTrainedTokenizerFast")
    hf_model = make_model("mixtral", vocab_size=tok.get_vocab_size())
    save_model(hf_model, path)
    return path, hf_model


def _transformers_perplexity(hf_model, ids: list[int], ctx_size: int, stride: int) -> tuple[float, int]:
    """The guide's loop, each window's mean loss times the number of labels it scored ->
    (perplexity, tokens scored)."""
    ids_t, nll_sum, n_tokens, prev_end = torch.tensor([ids]), 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx_size, len(ids))
        trg_len = end - prev_end
        input_ids = ids_t[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())  # the labels shift by one inside the model
        nll_sum += float(loss) * scored
        n_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize("ctx_size, stride", [(64, 32), (64, 64), (48, 17), (256, 128)])
def test_perplexity_equals_transformers(checkpoint, ctx_size, stride):
    path, hf_model = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) > 150
    result = perplexity(model, ids, ctx_size, stride)
    expected, scored = _transformers_perplexity(hf_model, ids, ctx_size, stride)
    assert result["tokens"] == scored and scored >= len(ids) - len(ids) // ctx_size - 1
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)


def test_each_token_is_scored_once_with_context_in_its_window():
    for length, ctx, stride in [(100, 30, 10), (31, 30, 7), (5, 30, 15), (100, 30, 30)]:
        spans = windows(length, ctx, stride)
        scored = [p for _, first, end in spans for p in range(first, end)]
        # overlapping windows score every token but the first; windows side by side cannot score
        # their first token (nothing before it in the window)
        starts = {begin for begin, _, _ in spans} if stride == ctx else {0}
        assert scored == [p for p in range(length) if p not in starts]
        assert all(begin < first and end - begin <= ctx for begin, first, end in spans)


def test_perplexity_command(checkpoint, capsys, tmp_path):
    path, hf_model = checkpoint
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["perplexity", "-m", str(path), "--dtype", "fp32", "-f", str(text), "-c", "64", "--stride", "32"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = moerun.load(path, dtype=torch.float32).tokenizer.encode(TEXT)
    assert result["perplexity"] == pytest.approx(_transformers_perplexity(hf_model, ids, 64, 32)[0], rel=1e-4)
    assert main(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"perplexity {result['perplexity']:.4f} over {len(ids) - 1} tokens")
    assert "tok/s" in out.out and f"[{result['windows']}/{result['windows']}]" in out.err


def test_a_context_longer_than_the_models_is_refused(checkpoint, capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["perplexity", "-m", str(checkpoint[0]), "-f", str(text), "-c", "4096"]) == 2
    assert "context" in capsys.readouterr().err.splitlines()[-1]


def _llama_cpp_perplexity(hf_model, tokens: list[int], n_ctx: int, bos: int | None, n_chunks: int = -1):
    """`perplexity()` of llama.cpp's tools/perplexity/perplexity.cpp, on transformers' logits: chunks
    of n_ctx side by side (tokens.size() / n_ctx of them, or --chunks), each one's first token made BOS
    when the vocabulary adds BOS, the logits at j = n_ctx/2 ... n_ctx - 2 scoring token j + 1 ->
    (perplexity, count)."""
    n_chunk_max = len(tokens) // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    first = n_ctx // 2
    nll, count = 0.0, 0
    for i in range(n_chunk):
        start = i * n_ctx
        batch = list(tokens[start : start + n_ctx])
        if bos is not None:
            batch[0] = bos
        with torch.no_grad():
            logits = hf_model(torch.tensor([batch])).logits[0].double()
        for j in range(first, n_ctx - 1):
            nll -= float(logits[j].log_softmax(-1)[tokens[start + j + 1]])
            count += 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("ctx_size, bos, max_chunks", [(64, None, None), (63, 7, None), (40, 7, 2)])
def test_chunks_are_llama_cpps_on_transformers_logits(checkpoint, ctx_size, bos, max_chunks):
    path, hf_model = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) % ctx_size  # a rest past the last chunk, which is not scored
    result = perplexity(model, ids, ctx_size, bos=bos, max_chunks=max_chunks)
    expected, count = _llama_cpp_perplexity(hf_model, ids, ctx_size, bos, max_chunks or -1)
    assert result["method"] == "chunks" and result["tokens"] == count
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)


def test_chunks_score_the_second_half_of_each():
    assert chunks(10, 4) == [(0, 3, 4), (4, 7, 8)]  # positions 3 and 7: after n_ctx/2 = 2
    assert chunks(9, 5) == [(0, 3, 5)]  # n_ctx/2 = 2: positions 3, 4 of [0, 5)
    assert chunks(4, 5) == []
    for length, ctx in [(100, 30), (60, 30), (7, 3)]:
        spans = chunks(length, ctx)
        assert len(spans) == length // ctx
        assert [s for s, _, _ in spans] == list(range(0, length // ctx * ctx, ctx))
        assert all(end - first == ctx - ctx // 2 - 1 and end - begin == ctx for begin, first, end in spans)


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory):
    """A tokenizer that puts BOS first (Llama 3's), so each chunk's first token becomes BOS."""
    path = tmp_path_factory.mktemp("ppl-bos")
    backend, config = VARIANTS["llama3"]
    tok = backend()
    save_hf_dir(tok, path, **config)
    # no sliding window: the scored second half sees each chunk's first token
    hf_model = make_model("mixtral", vocab_size=tok.get_vocab_size(), sliding_window=None)
    save_model(hf_model, path)
    return path, hf_model


def test_the_command_counts_as_llama_cpp_by_default(bos_checkpoint, capsys, tmp_path):
    path, hf_model = bos_checkpoint
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    tokenizer = moerun.load(path, dtype=torch.float32).tokenizer
    ids = tokenizer.encode(TEXT)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    assert ids[0] == bos and bos not in ids[1:]
    args = ["perplexity", "-m", str(path), "--dtype", "fp32", "-f", str(text), "-c", "64"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected, count = _llama_cpp_perplexity(hf_model, ids, 64, bos)
    assert result["method"] == "chunks" and result["tokens"] == count
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    # without the BOS in each chunk the number differs: the replacement is what makes it llama.cpp's
    assert _llama_cpp_perplexity(hf_model, ids, 64, None)[0] != pytest.approx(expected, rel=1e-4)
    assert main([*args, "--chunks", "1"]) == 0
    one = _llama_cpp_perplexity(hf_model, ids, 64, bos, 1)[0]
    words = capsys.readouterr().out.split()
    assert float(words[1]) == pytest.approx(one, rel=1e-4)
    assert words[2:9] == ["over", "31", "tokens", "(1", "chunk", "of", "64,"]


def test_a_text_shorter_than_one_chunk_is_refused(checkpoint):
    model = moerun.load(checkpoint[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="at least 64 tokens, got 10"):
        perplexity(model, list(range(10)), 64)
