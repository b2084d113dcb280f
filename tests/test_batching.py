"""Batched generation (moerun.batching): several prompts stepped together, one forward pass per step,
against each prompt generated alone. Greedy, every sequence gets the tokens it gets alone, whatever
its neighbours, its own stop strings and length, prompts longer than a step's budget, sequences
joining mid-way and leaving early; per family (sliding windows and sinks included), quantised on the
native kernels, and with experts streamed."""

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import write_gguf
from hf_models import VOCAB, make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

import moerun
from moerun.batching import Batch, Request

FAMILIES = ["olmoe", "qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 11, 1, 7, 5, 9, 2, 13][:n]
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


def _alone(model, prompt, n, **options) -> list[int]:
    return [t.id for t in model.generate(prompt, n, **options)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    path = save_model(make_model(request.param), tmp_path_factory.mktemp(request.param))
    return moerun.load(path, dtype=torch.float32)


def test_a_batch_gives_each_prompt_its_tokens_alone(family_model):
    prompts, budgets = _prompts(5), [12, 4, 9, 1, 7]
    batched = family_model.generate(prompts, budgets)
    stats = family_model.stats()
    assert [[t.id for t in out] for out in batched] == [
        _alone(family_model, p, n) for p, n in zip(prompts, budgets, strict=True)
    ]
    assert [s["new_tokens"] for s in stats["sequences"]] == budgets
    assert [s["finish_reason"] for s in stats["sequences"]] == ["length"] * 5
    assert stats["new_tokens"] == sum(budgets) and stats["steps"] == max(budgets)


def test_greedy_penalised_and_sampled_sequences_share_a_batch(family_model):
    """The batch takes plain greedy sequences' tokens from one argmax over its rows, the others
    from their own samplers: side by side, each gets its tokens alone."""
    options = [{}, dict(repetition_penalty=1.5), dict(temperature=0.8, seed=4), dict(presence_penalty=1.0)]
    prompts = _prompts(len(options), seed=2)
    batch = Batch(family_model)
    runs = [batch.add(Request.make(family_model, p, 6, **o)) for p, o in zip(prompts, options, strict=True)]
    while batch.running:
        batch.step()
    assert [r.seen[len(p) :] for r, p in zip(runs, prompts, strict=True)] == [
        _alone(family_model, p, 6, **o) for p, o in zip(prompts, options, strict=True)
    ]


def test_the_ragged_pass_gives_each_sequence_its_own_hidden_states(family_model):
    """forward_sequences over sequences at different positions (one reading a prompt, others one
    token deep in theirs) against each sequence's own forward, within fp32 rounding."""
    model = family_model
    prompts = _prompts(3, seed=1)
    caches, alone = [], []
    for p in prompts:
        cache = model.new_cache(1, 32)
        model.forward(torch.tensor([p[:-1]]), cache) if len(p) > 1 else None
        caches.append(cache)
        own = model.new_cache(1, 32)
        alone.append(model.forward(torch.tensor([p]), own)[0, -1])
    chunks = [torch.tensor(p[c.length :]) for p, c in zip(prompts, caches, strict=True)]
    hidden = model.forward_sequences(chunks, caches)
    assert hidden.shape == (3, model.config.hidden)
    for row, expected in zip(hidden, alone, strict=True):
        assert rel_err(row, expected) <= 1e-5
    assert [c.length for c in caches] == [len(p) for p in prompts]


def test_prompts_longer_than_a_step_join_over_several_steps(family_model, monkeypatch):
    monkeypatch.setattr(family_model, "prefill_chunk", 4)
    prompts = _prompts(4, seed=2)
    batched = family_model.generate(prompts, 6)
    monkeypatch.undo()
    assert [[t.id for t in out] for out in batched] == [_alone(family_model, p, 6) for p in prompts]


def test_sequences_join_and_leave_between_steps(family_model):
    """The server's use: a request added while others decode, one cancelled, one finished early;
    the rest go on with the tokens they get alone."""
    model = family_model
    prompts = _prompts(4, seed=3)
    batch = Batch(model)
    first = batch.add(Request.make(model, prompts[0], 10))
    short = batch.add(Request.make(model, prompts[1], 2))
    out = {id(first): [], id(short): []}
    for _ in range(3):
        for s, tokens in batch.step():
            out[id(s)] += [t.id for t in tokens]
    late = batch.add(Request.make(model, prompts[2], 5))
    gone = batch.add(Request.make(model, prompts[3], 5))
    out[id(late)] = []
    for s, tokens in batch.step():  # the two join: both read their prompts while the first decodes
        out.setdefault(id(s), []).extend(t.id for t in tokens)
    batch.cancel(gone)
    assert gone not in batch.running and gone.stats["finish_reason"] == "cancelled"
    while batch.running:
        for s, tokens in batch.step():
            assert s is not gone
            out.setdefault(id(s), []).extend(t.id for t in tokens)
    assert short.stats["finish_reason"] == "length" and first.stats["finish_reason"] == "length"
    assert out[id(first)] == _alone(model, prompts[0], 10)
    assert out[id(short)] == _alone(model, prompts[1], 2)
    assert out[id(late)] == _alone(model, prompts[2], 5)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("text")
    tok = byte_level_tokenizer("gpt2")
    save_hf_dir(tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|endoftext|>")
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size()), path)
    return moerun.load(path, dtype=torch.float32)


def test_text_prompts_with_stops_and_lengths_of_their_own(text_model):
    prompts = ["hello world", "a", "The café", "xyz xyz xyz"]
    full = ["".join(t.text for t in text_model.generate(p, 16)) for p in prompts]
    stop = full[0][5:7]
    batched = text_model.generate(prompts, [16, 3, 16, 16], stop=[stop])
    texts = ["".join(t.text for t in out) for out in batched]
    reasons = [s["finish_reason"] for s in text_model.stats()["sequences"]]
    for prompt, text, n in zip(prompts, texts, [16, 3, 16, 16], strict=True):
        assert text == "".join(t.text for t in text_model.generate(prompt, n, stop=[stop]))
    assert texts[0] == full[0][: full[0].index(stop)]
    assert reasons[0] == "stop" and reasons[1] in ("length", "stop")


def test_logprobs_in_a_batch_match_alone(text_model):
    prompts = ["one", "two three"]
    batched = text_model.generate(prompts, 5, logprobs=3)
    for prompt, out in zip(prompts, batched, strict=True):
        alone = list(text_model.generate(prompt, 5, logprobs=3))
        assert [t.id for t in out] == [t.id for t in alone]
        for a, b in zip(out, alone, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-4
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]


def test_a_quantised_gguf_batch_on_the_native_kernels(tmp_path):
    model_hf = make_model("olmoe", hidden_size=256, intermediate_size=256, num_experts=4, num_hidden_layers=2)
    write_gguf(model_hf, tmp_path / "m.gguf", "q4_k")
    model = moerun.load(tmp_path / "m.gguf", dtype=torch.float32)
    prompts = _prompts(4, seed=4)
    batched = model.generate(prompts, 8)
    assert [[t.id for t in out] for out in batched] == [_alone(model, p, 8) for p in prompts]


def test_a_batch_with_experts_streamed(tmp_path):
    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    resident = moerun.load(path, dtype=torch.float32)
    streamed = moerun.load(path, dtype=torch.float32, expert_cache_gb=0.001)
    try:
        prompts = _prompts(3, seed=5)
        out = streamed.generate(prompts, 6)
        assert [[t.id for t in o] for o in out] == [_alone(resident, p, 6) for p in prompts]
        assert streamed.stats()["offload"]["total"]["misses"] > 0
    finally:
        streamed.close()
