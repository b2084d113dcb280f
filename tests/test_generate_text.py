"""Text generation end to end: a tiny model saved with a real tokenizer file, against transformers'
tokenizer and generate on the same files."""

import pytest
import torch
from hf_models import make_model, save_model
from tiny_tokenizers import SPM_CONFIG, byte_level_tokenizer, save_hf_dir, sentencepiece_tokenizer
from transformers import AutoTokenizer

import moerun


@pytest.fixture(scope="module", params=["spm", "byte-level"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "spm":
        tok = sentencepiece_tokenizer()
        save_hf_dir(tok, path, tokenizer_class="LlamaTokenizer", **SPM_CONFIG)
    else:
        tok = byte_level_tokenizer("gpt2")
        # the class named, so that transformers uses tokenizer.json as written rather than a Qwen2
        # tokenizer rebuilt from the model's config.json
        save_hf_dir(
            tok,
            path,
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
        )
    hf_model = make_model("qwen3_moe", vocab_size=tok.get_vocab_size())
    save_model(hf_model, path)
    return path, hf_model


def test_text_prompt_gives_transformers_tokens_and_text(checkpoint):
    path, hf_model = checkpoint
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    model = moerun.load(path, dtype=torch.float32)
    prompt = "Le café coûte 3 €, 日本語 ok"
    tokens = list(model.generate(prompt, max_new_tokens=24))
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[
            0, ids.shape[1] :
        ]
    assert [t.id for t in tokens] == expected.tolist()
    assert "".join(t.text for t in tokens) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_stop_string_ends_generation_before_it(checkpoint):
    path, _ = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    full = "".join(t.text for t in model.generate("hello world", max_new_tokens=24))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2
    cut = "".join(t.text for t in model.generate("hello world", max_new_tokens=24, stop=[stop]))
    assert cut == full[: full.index(stop)]


def test_stats_after_generation(checkpoint):
    path, _ = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    n = len(list(model.generate([1, 2, 3, 4], max_new_tokens=5)))
    stats = model.stats()
    assert (stats["prompt_tokens"], stats["new_tokens"]) == (4, n)
    assert stats["prefill_tok_s"] > 0 and stats["decode_tok_s"] > 0


def test_text_prompt_without_a_tokenizer_is_refused(tmp_path):
    save_model(make_model("olmoe"), tmp_path)
    model = moerun.load(tmp_path, dtype=torch.float32)
    assert model.tokenizer is None
    assert all(t.text == "" for t in model.generate([1, 2], max_new_tokens=3))
    with pytest.raises(ValueError, match="no tokenizer"):
        next(model.generate("hello"))


def test_reuse_prefix_computes_only_the_new_tokens_and_changes_no_greedy_token(checkpoint):
    """A chat's next turn repeats the conversation: with reuse_prefix the positions the last turn
    computed (its prompt and every reply token but the last) are copied, not recomputed, and the
    greedy reply equals a fresh model's."""
    path, _ = checkpoint
    model, fresh = moerun.load(path, dtype=torch.float32), moerun.load(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    first = torch.randint(3, 90, (9,), generator=gen).tolist()
    reply = [t.id for t in model.generate(first, max_new_tokens=6, reuse_prefix=True)]
    assert model.stats()["reused_tokens"] == 0
    second = first + reply + torch.randint(3, 90, (4,), generator=gen).tolist()
    again = [t.id for t in model.generate(second, max_new_tokens=6, reuse_prefix=True)]
    assert model.stats()["reused_tokens"] == len(first) + len(reply) - 1
    assert again == [t.id for t in fresh.generate(second, max_new_tokens=6)]
    # a reply stopped early (Ctrl-C in chat) leaves a shorter valid prefix, and the next turn is right
    tokens = model.generate(second + again, max_new_tokens=6, reuse_prefix=True)
    partial = [next(tokens).id, next(tokens).id]
    tokens.close()
    third = second + again + partial + [5, 6]
    out = [t.id for t in model.generate(third, max_new_tokens=4, reuse_prefix=True)]
    assert model.stats()["reused_tokens"] == len(second + again) + 1
    assert out == [t.id for t in fresh.generate(third, max_new_tokens=4)]
    # without reuse_prefix nothing is kept or reused
    list(model.generate(third, max_new_tokens=2))
    assert model.stats()["reused_tokens"] == 0 and model.generator.prefix is None


def test_logprobs_are_transformers_log_softmax(checkpoint):
    path, hf_model = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    prompt = [5, 9, 17, 3, 40]
    tokens = list(model.generate(prompt, max_new_tokens=6, logprobs=4))
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + [t.id for t in tokens]])).logits[0].float()
    expected = logits[len(prompt) - 1 : -1].log_softmax(-1)  # [6, V]: position i predicts token i + 1
    for i, token in enumerate(tokens):
        assert token.logprob == pytest.approx(float(expected[i, token.id]), abs=1e-4)
        top = expected[i].topk(4)
        assert [id_ for id_, _ in token.top_logprobs] == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in token.top_logprobs]), top.values, atol=1e-4, rtol=0
        )
    assert all(t.logprob is None and t.top_logprobs == () for t in model.generate(prompt, 2))


def test_max_new_tokens_none_runs_to_the_context_end(checkpoint):
    path, _ = checkpoint
    model = moerun.load(path, dtype=torch.float32)
    eos = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    prompt = [t for t in range(10, 20) if t not in eos]
    tokens = list(model.generate(prompt, None, ctx_size=30))
    stats = model.stats()
    if stats["finish_reason"] == "context":
        assert len(prompt) + len(tokens) == 30 and not eos & {t.id for t in tokens}
    else:
        assert stats["finish_reason"] == "stop" and tokens[-1].id in eos
    assert [t.id for t in tokens] == [t.id for t in model.generate(prompt, -1, ctx_size=30)]
    tokens = list(model.generate(prompt, 4, ctx_size=30))
    assert model.stats()["finish_reason"] in ("length", "stop") and len(tokens) <= 4


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m: m.generate(["Hi", "Hello"], reuse_prefix=True), ValueError, "one prompt"),
        (lambda m: m.generate(["Hi", "Hello"], max_new_tokens=[2]), ValueError, "1 values for 2 prompts"),
        (lambda m: m.generate(["Hi", [1, 2.5]]), TypeError, "list of int token ids"),
        (lambda m: m.generate(["Hi", "Hello"], stop="x"), TypeError, "list of strings"),
        (lambda m: m.generate(3.5), TypeError, "not float"),
        (lambda m: m.generate(torch.tensor([[1, 2]])), TypeError, "1-D"),
        (lambda m: m.generate([1, 2], repeat_penalty=1.1), TypeError, "repetition_penalty"),
        (lambda m: m.generate([1, 2], temprature=0.5), TypeError, "'temperature'"),
        (lambda m: m.generate([1, 2], max_new_tokens=-3), ValueError, "max_new_tokens"),
        (lambda m: m.generate([1, 2], top_p="high"), ValueError, "top_p"),
        (lambda m: m.generate([1, 2], ctx_size=1), ValueError, "do not fit a context of 1"),
        (lambda m: m.logits("Hello"), TypeError, "tokenizer.encode"),
        (lambda m: m.logits(torch.tensor([[0.5, 1.0]])), TypeError, "integer token ids"),
        (lambda m: m.logits([[1, 2], [3]]), TypeError, "token ids"),
    ],
)
def test_api_misuse_is_one_sentence(checkpoint, call, error, words):
    """Refused when called, before any token is asked for."""
    model = moerun.load(checkpoint[0], dtype=torch.float32)
    with pytest.raises(error, match=words) as raised:
        call(model)
    assert str(raised.value).count(". ") == 0 and str(raised.value).endswith((".", "?"))
