"""RoPE "longrope" (Phi-3, Phi-3.5-MoE) against transformers 5.

A pass whose sequence reaches past original_max_position_embeddings (16 here) uses the long set for
all its positions; cached keys keep the rotation they got. transformers' PhiMoE recomputes its
frequencies from short_factor in every forward and switches only its cos/sin scale (short_mscale /
long_mscale); the generic longrope (transformers' dynamic_rope_update, Phi-3) switches the
frequencies and keeps one scale. A tiny PhiMoE: fp32 logits within 1e-4 below and above the
boundary, decode steps and greedy tokens across it equal, on the native and torch backends."""

import json

import pytest
import torch
import transformers
from conftest import rel_err
from hf_models import COMMON, VOCAB, hf_greedy, hf_logits
from test_phimoe_granite import CASES
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import moerun
from moerun.decoder.config import ConfigError
from moerun.decoder.rope import Rotary, inverse_frequencies
from moerun.families.decoder_config import rope_spec

BOUNDARY = 16
SHORT, LONG = [1.0, 1.7, 3.1, 5.3], [4.0, 9.0, 20.0, 41.0]  # head_dim 8: 4 frequencies
ROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=SHORT,
    long_factor=LONG,
    short_mscale=1.1,
    long_mscale=1.6,
    original_max_position_embeddings=BOUNDARY,
)
IDS = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))


def make_phimoe(rope: dict = ROPE, seed: int = 0):
    """test_phimoe_granite's tiny PhiMoE (same extras, same random draw) with longrope."""
    config = transformers.PhimoeConfig(**{**COMMON, **CASES["phimoe"][1], "rope_parameters": dict(rope)})
    config._attn_implementation = "eager"
    model = transformers.PhimoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=gen))
            elif "router" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = make_phimoe()
    path = tmp_path_factory.mktemp("phimoe-longrope")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=["auto", "torch"], ids=["native", "torch"])
def ours(request, saved):
    return moerun.load(saved[1], dtype=torch.float32, backend=request.param)


# ---- the frequencies and scales themselves ---------------------------------------------------------


GENERIC = {  # longrope configs as transformers reads them (Phi-3's: no mscale keys)
    "factor-given": dict(factor=8.0),
    "factor-from-context": dict(),  # max_position_embeddings / original_max_position_embeddings
    "attention-factor-given": dict(factor=8.0, attention_factor=1.3),
    "no-scaling": dict(factor=1.0),
}


def _generic(extra: dict) -> dict:
    rope = {k: v for k, v in ROPE.items() if "mscale" not in k}
    # Phi-3's config prefers its top-level original_max_position_embeddings (PhiMoE's reads rope's)
    return {**COMMON, "original_max_position_embeddings": BOUNDARY, "rope_parameters": {**rope, **extra}}


@pytest.mark.parametrize("extra", list(GENERIC.values()), ids=list(GENERIC))
def test_inverse_frequencies_match_transformers(extra):
    """Both sets and the scale, against transformers' ROPE_INIT_FUNCTIONS['longrope'] (short: no
    seq_len; long: a seq_len past the boundary), from the same config dict."""
    values = _generic(extra)
    hf_config = transformers.Phi3Config(**values)
    spec = rope_spec(values)
    for long, seq_len in ((False, None), (True, BOUNDARY + 1)):
        expected, expected_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=seq_len)
        inv_freq, scale = inverse_frequencies(spec, 8, long)
        assert torch.equal(inv_freq, expected)
        assert scale == pytest.approx(expected_scale, rel=1e-12)
    # the short set's boundary case: a sequence of exactly original_max positions is short
    at_boundary, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=BOUNDARY)
    assert torch.equal(inverse_frequencies(spec, 8, False)[0], at_boundary)


@pytest.mark.parametrize("extra", list(GENERIC.values()), ids=list(GENERIC))
def test_generic_cos_sin_switch_as_transformers_dynamic_update(extra):
    """Rotary.cos_sin against transformers' Phi-3 rotary (dynamic_rope_update picks the set by
    max(position_ids) + 1 per call): a prompt below the boundary, one past it, then single decode
    positions on both sides."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    values = _generic(extra)
    hf = Phi3RotaryEmbedding(transformers.Phi3Config(**values))
    ours = Rotary(rope_spec(values), 8)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(10), torch.arange(40), torch.tensor([12]), torch.tensor([30])):
        cos, sin = hf(x, positions[None])
        mine = ours.cos_sin(positions, torch.float32)
        assert torch.equal(mine[0], cos[0, :, :4]) and torch.equal(mine[1], sin[0, :, :4])
    # the long set really differs from the short one here
    assert not torch.equal(
        ours.cos_sin(torch.arange(17), torch.float32)[0][:3], ours.cos_sin(torch.arange(3), torch.float32)[0]
    )


def test_phimoe_cos_sin_match_transformers(saved, ours):
    """PhiMoE's own rotary: short_factor always, short_mscale up to the boundary, long_mscale past it."""
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

    hf = PhimoeRotaryEmbedding(saved[0].config)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(10), torch.arange(40), torch.tensor([15]), torch.tensor([16])):
        cos, sin = hf(x, positions[None])
        mine = ours.rotary.cos_sin(positions, torch.float32)
        assert torch.equal(mine[0], cos[0, :, :4]) and torch.equal(mine[1], sin[0, :, :4])


def test_lengths_pick_the_set_per_position():
    """Several sequences in one pass (forward_sequences): each position by its own sequence's reach."""
    ours = Rotary(rope_spec(_generic({})), 8)
    positions = torch.cat([torch.arange(3, 5), torch.arange(18, 20)])
    lengths = torch.tensor([5, 5, 20, 20])
    cos, sin = ours.cos_sin(positions, torch.float32, lengths)
    short = ours.cos_sin(torch.arange(5), torch.float32)
    long = ours.cos_sin(torch.arange(20), torch.float32)
    assert torch.equal(cos[:2], short[0][3:5]) and torch.equal(cos[2:], long[0][18:20])
    assert torch.equal(sin[:2], short[1][3:5]) and torch.equal(sin[2:], long[1][18:20])


def test_other_kinds_are_unchanged():
    """default / linear / yarn: no second set, and lengths are ignored."""
    for rope in (
        dict(rope_type="default", rope_theta=1e4),
        dict(rope_type="linear", rope_theta=1e4, factor=2.0),
        dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16),
    ):
        rotary = Rotary(rope_spec({**COMMON, "rope_parameters": rope}), 8)
        assert rotary.boundary is None
        positions = torch.arange(40)
        a = rotary.cos_sin(positions, torch.float32)
        b = rotary.cos_sin(positions, torch.float32, torch.full((40,), 3))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- the whole model ---------------------------------------------------------------------------


@pytest.mark.parametrize("length", [10, 40], ids=["below", "above"])
def test_logits_match_transformers(saved, ours, length):
    hf, _ = saved
    ids = IDS[:, :length]
    assert rel_err(ours.logits(ids), hf_logits(hf, ids)) <= 1e-4


def test_the_scale_switches_for_the_whole_pass(saved):
    """Past the boundary even the first positions use long_mscale: their logits differ from a pass
    that stops below it (transformers' too), so the tests above see both sets."""
    hf, _ = saved
    short, long = hf_logits(hf, IDS[:, :10]), hf_logits(hf, IDS)[:, :10]
    assert rel_err(long, short) > 1e-2


def test_decode_steps_across_the_boundary_match_transformers(saved, ours):
    """A prompt of 10, then one token a step to 40 over the cache. transformers' PhiMoE generate drops
    its cache when the sequence first grows past the boundary (prepare_inputs_for_generation) and
    computes it all again with the long set, so each of its steps gives the logits of one pass over
    the sequence so far; moerun computes the cached positions again at the crossing, the same."""
    hf, _ = saved
    ids = IDS[:, :40]
    cache = ours.new_cache(1, 40)
    with torch.inference_mode():  # as generate runs (the shared model's workspaces were made so)
        steps = [ours.hidden_logits(ours.forward(ids[:, :10], cache)[0, -1])]
        steps += [ours.hidden_logits(ours.forward(ids[:, i : i + 1], cache)[0, -1]) for i in range(10, 40)]
    expected = [hf_logits(hf, ids[:, : i + 1])[0, -1] for i in range(9, 40)]
    assert rel_err(torch.stack(steps), torch.stack(expected)) <= 1e-4
    assert cache.rope_long and cache.length == 40
    # a cache that kept the keys rotated with the short set would not give them
    with torch.no_grad():
        out = hf(ids[:, :16], use_cache=True)
        kept = hf(ids[:, 16:20], past_key_values=out.past_key_values, use_cache=True).logits[0]
    assert rel_err(kept, hf_logits(hf, ids[:, :20])[0, 16:]) > 1e-3


def test_greedy_generation_across_the_boundary_matches_transformers(saved, ours):
    hf, _ = saved
    prompt = IDS[0, :10].tolist()
    assert [t.id for t in ours.generate(prompt, 20)] == hf_greedy(hf, prompt, 20)


def test_a_prompt_past_the_boundary_generates_as_transformers(saved, ours):
    hf, _ = saved
    prompt = IDS[0, :20].tolist()
    assert [t.id for t in ours.generate(prompt, 8)] == hf_greedy(hf, prompt, 8)


def test_a_batch_picks_the_set_per_sequence(saved):
    """One pass over sequences on both sides of the boundary, one of them crossing it mid-batch:
    each generates what it does alone, and what transformers does."""
    hf, path = saved
    ours = moerun.load(path, dtype=torch.float32)
    prompts = [IDS[0, :5].tolist(), IDS[0, 5:17].tolist(), IDS[0, 10:30].tolist()]
    alone = [[t.id for t in ours.generate(p, 8)] for p in prompts]
    assert [[t.id for t in out] for out in ours.generate(prompts, 8)] == alone
    assert alone == [hf_greedy(hf, p, 8) for p in prompts]


def test_a_prefill_in_chunks_crossing_the_boundary_is_one_pass(saved):
    """Chunks of 7: the chunk that crosses the boundary computes the earlier ones again with the
    long set, so the logits are transformers' single pass."""
    hf, path = saved
    ours = moerun.load(path, dtype=torch.float32)
    ours.prefill_chunk = 7
    assert rel_err(ours.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


def test_a_reused_prefix_from_past_the_boundary_is_computed_again(saved):
    """reuse_prefix after a generation past the boundary, then a prompt below it that shares its
    start: the copied positions were rotated with the long set, so they are computed again."""
    hf, path = saved
    ours = moerun.load(path, dtype=torch.float32)
    first = IDS[0, :20].tolist()
    assert [t.id for t in ours.generate(first, 4, reuse_prefix=True)] == hf_greedy(hf, first, 4)
    second = IDS[0, :8].tolist()
    assert [t.id for t in ours.generate(second, 4, reuse_prefix=True)] == hf_greedy(hf, second, 4)
    assert ours.stats()["reused_tokens"] == 7
    third = second + IDS[0, 30:40].tolist()  # grows past the boundary again from a short prefix
    assert [t.id for t in ours.generate(third, 4, reuse_prefix=True)] == hf_greedy(hf, third, 4)


def test_the_native_one_call_decode_step_across_the_boundary(tmp_path):
    """An RMSNorm family (Mixtral's layout) given a generic longrope decodes through the native
    one-call step: its per-position cos/sin and the recompute at the crossing give transformers'
    one-pass logits at every step."""
    from hf_models import make_model, save_model

    rope = {k: v for k, v in ROPE.items() if "mscale" not in k}
    hf = make_model("mixtral", head_dim=8, rope_parameters={**rope, "factor": 8.0})
    path = save_model(hf, tmp_path)
    ours = moerun.load(path, dtype=torch.float32)
    assert ours._decode_step is not None
    ids = IDS[:, :24]
    cache = ours.new_cache(1, 24)
    with torch.inference_mode():
        steps = [ours.hidden_logits(ours.forward(ids[:, :10], cache)[0, -1])]
        steps += [ours.hidden_logits(ours.forward(ids[:, i : i + 1], cache)[0, -1]) for i in range(10, 24)]
    expected = [hf_logits(hf, ids[:, : i + 1])[0, -1] for i in range(9, 24)]
    assert rel_err(torch.stack(steps), torch.stack(expected)) <= 1e-4


# ---- config.json as Phi-3.5-MoE publishes it -------------------------------------------------------


def test_phi35_moe_rope_scaling_spelling_loads(saved, tmp_path):
    """transformers 4's rope_scaling with `type`, original_max_position_embeddings both inside it and
    at the top level, rope_theta at the top level: loads, and gives transformers' logits."""
    hf, path = saved
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    scaling = {k: rope[k] for k in ("short_factor", "long_factor", "short_mscale", "long_mscale")}
    config.update(
        rope_theta=rope["rope_theta"],
        original_max_position_embeddings=BOUNDARY,
        rope_scaling={"type": "longrope", **scaling, "original_max_position_embeddings": BOUNDARY},
    )
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = moerun.load(tmp_path, dtype=torch.float32)
    assert rel_err(ours.logits(IDS), hf_logits(reloaded, IDS)) <= 1e-4
    assert rel_err(ours.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(short_factor=[1.0] * 3), r"short_factor has 3 entries; a rotary head of 8 dims needs 4"),
        (dict(long_factor=None), r"needs short_factor and long_factor"),
        (dict(short_factor=[1.0, "2", 1.0, 1.0]), r"short_factor is .*; it must be a list"),
    ],
    ids=["wrong-length", "missing", "not-numbers"],
)
def test_bad_factors_are_refused_by_name(saved, tmp_path, change, message):
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    rope = {k: v for k, v in {**config["rope_parameters"], **change}.items() if v is not None}
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(ConfigError, match=message):
        moerun.load(tmp_path, dtype=torch.float32)
