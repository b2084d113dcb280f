"""Perplexity against transformers' own loss on the same tiny model, ids and windows (the sliding
window of transformers' "Perplexity of fixed-length models" guide), and `moerun perplexity`."""

import json
import math

import pytest
import torch
from hf_models import make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

import moerun
from moerun.cli.main import main
from moerun.perplexity import perplexity, windows

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
