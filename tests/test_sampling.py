"""Sampling against transformers' own logits processors, and reproducibility by seed."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moerun.sampling import Sampler, SamplingParams, check_sampling, filtered_logits, penalise_repeats

SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_k=1),
]


def _transformers(params: dict) -> LogitsProcessorList:
    processors = []
    if params.get("temperature", 1.0) != 1.0:
        processors.append(TemperatureLogitsWarper(params["temperature"]))
    if params.get("top_k"):
        processors.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        processors.append(TopPLogitsWarper(params["top_p"]))
    if params.get("min_p"):
        processors.append(MinPLogitsWarper(params["min_p"]))
    return LogitsProcessorList(processors)


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_filtered_distribution_equals_transformers(params):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(200, generator=gen) * 3
        ours = filtered_logits(logits, SamplingParams(**params)).softmax(-1)
        theirs = _transformers(params)(torch.zeros(1, 0, dtype=torch.long), logits[None].clone())[0].softmax(
            -1
        )
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_repetition_penalty_equals_transformers():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    seen = [3, 7, 7, 11, 49]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits[None].clone())[0]
    torch.testing.assert_close(penalise_repeats(logits, seen, 1.3), theirs)


def test_greedy_is_argmax_and_ignores_the_seed():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(seed=5))(logits) == int(logits.argmax())


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(1000)  # uniform: any difference in the stream shows

    def draw(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(3000)]), minlength=3) / 3000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5), dict(repetition_penalty=0)],
)
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_unknown_option_names_the_closest_and_the_options():
    with pytest.raises(TypeError, match=r"'repeat_penalty' \(did you mean 'repetition_penalty'\?\).*seed"):
        SamplingParams.from_options(repeat_penalty=1.1)
    assert SamplingParams.from_options(top_k=3, temperature=1.0) == SamplingParams(temperature=1.0, top_k=3)


def test_check_sampling_names_options_as_the_caller_calls_them():
    with pytest.raises(ValueError, match=r"^--top-p must be a number in \(0, 1\]"):
        check_sampling({"top_p": 1.5}, {"top_p": "--top-p"})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams(top_k=2.5)


def test_greedy_names_the_options_it_does_not_use():
    assert SamplingParams(top_k=5, seed=2, repetition_penalty=1.2).unused() == ["top_k", "seed"]
    assert SamplingParams(temperature=0.7, top_k=5).unused() == []


def test_presence_and_frequency_penalties_follow_openais_formula():
    """OpenAI's documented rule, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence,
    c[j] the times token j was output; the prompt does not count."""
    from moerun.sampling import penalise_output

    logits = torch.randn(12, generator=torch.Generator().manual_seed(0))
    output = [3, 3, 7, 3, 11]
    got = penalise_output(logits, output, presence=0.5, frequency=0.25)
    for j in range(12):
        c = output.count(j)
        assert abs(float(got[j]) - (float(logits[j]) - c * 0.25 - (0.5 if c else 0.0))) <= 1e-6
    # greedy with a strong frequency penalty moves off a token it keeps repeating
    sampler = Sampler(SamplingParams(frequency_penalty=2.0))
    peaked = torch.zeros(12)
    peaked[3], peaked[5] = 3.0, 2.0
    assert sampler(peaked, seen=[1, 3], output=[]) == 3 and sampler(peaked, seen=[1, 3], output=[3]) == 5


@pytest.mark.parametrize(
    "options, argmax_only",
    [
        ({}, True),
        (dict(seed=3), True),
        (dict(repetition_penalty=1.2), False),
        (dict(presence_penalty=0.5), False),
        (dict(frequency_penalty=-0.5), False),
        (dict(temperature=0.7), False),
    ],
)
def test_argmax_only_means_the_sampler_picks_each_rows_argmax(options, argmax_only):
    """A batch takes `argmax_only` samplers' tokens from one argmax over all its rows: for those,
    each row's argmax must be what the sampler itself picks, ties (the first index) included."""
    sampler = Sampler(SamplingParams(**options))
    assert sampler.argmax_only is argmax_only
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[2, [7, 30]] = logits[2].max() + 1  # a tie: the lower index wins
    if argmax_only:
        seen = logits.argmax(dim=-1).tolist()  # a penalty would move these
        picked = [sampler(row, seen, seen) for row in logits]
        assert picked == logits.argmax(dim=-1).tolist() and picked[2] == 7


def test_a_grammar_mask_sets_exactly_the_forbidden_tokens_to_minus_inf():
    """moerun.text.grammar's masks (a bit per token, llguidance's layout: bit t % 32 of int32 word
    t // 32) against the bits read one by one in Python; the allowed logits are left bit for bit."""
    from moerun.text.grammar import apply_masks

    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    gen = torch.Generator().manual_seed(0)
    masks = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    out = apply_masks(logits.clone(), masks)
    for row in range(3):
        for token in range(vocab):
            word = int(masks[row, token // 32]) & 0xFFFFFFFF
            allowed = (word >> (token % 32)) & 1
            assert out[row, token].item() == (logits[row, token].item() if allowed else float("-inf"))
    # a sampler never picks a forbidden token, and log-probabilities renormalise over the allowed
    from moerun.sampling import token_logprobs

    picks = {Sampler(SamplingParams(temperature=1.0, seed=s))(out[0]) for s in range(20)}
    assert all((int(masks[0, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1 for t in picks)
    _, top = token_logprobs(out[0], next(iter(picks)), vocab)
    assert abs(sum(torch.tensor([lp for _, lp in top]).exp().tolist()) - 1) < 1e-5
