"""PhiMoE and GraniteMoE as whole models from HF directories, against transformers 5's own models on
the same tiny random weights: logits in fp32 within 1e-4, greedy tokens equal, from checkpoints in
either expert layout, on the native CPU kernels and on torch. PhiMoE: LayerNorms with biases,
attention and lm_head biases, a sliding window, sparsemixer routing. GraniteMoE: the embedding,
attention, residual and logits multipliers. Decode steps one token at a time, batches and streamed
experts like the other families; a longrope without its long factors is refused by name
(tests/test_longrope.py: longrope itself)."""

import json

import pytest
import torch
import transformers
from conftest import rel_err
from hf_models import COMMON, VOCAB, hf_greedy, hf_logits
from safetensors import safe_open

import moerun
from moerun.errors import ConfigError

CASES = {
    "phimoe": (
        "Phimoe",
        dict(
            num_local_experts=6, attention_bias=True, lm_head_bias=True, sliding_window=7, rms_norm_eps=1e-5
        ),
    ),
    "granitemoe": (
        "GraniteMoe",
        dict(
            num_local_experts=6,
            num_experts_per_tok=3,
            embedding_multiplier=12.0,
            attention_multiplier=0.05,  # not 1/sqrt(head_dim) = 0.354
            residual_multiplier=0.22,
            logits_scaling=6.0,
        ),
    ),
}
IDS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))


def make_hf(family: str, seed: int = 0):
    """A tiny transformers model in fp32, eval mode, every tensor random: norm weights near 1, their
    biases (PhiMoE's LayerNorms) and the other biases around 0, router weights at full scale."""
    prefix, extra = CASES[family]
    config = getattr(transformers, prefix + "Config")(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
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


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(transformers' model, {original_format: checkpoint directory})."""
    hf = make_hf(request.param)
    paths = {}
    for original in (True, False):
        paths[original] = tmp_path_factory.mktemp(f"{request.param}-{original}")
        hf.save_pretrained(paths[original], save_original_format=original)
    return hf, paths


def test_the_two_layouts_name_the_experts_differently(saved):
    """The checkpoints really differ (per-expert or original fused names against transformers' own),
    so both of moerun's name mappings are exercised."""
    _, paths = saved

    def names(path):
        with safe_open(path / "model.safetensors", "pt") as f:
            return set(f.keys())

    original, fused = names(paths[True]), names(paths[False])
    assert not any("experts.gate_up_proj" in n or "router.weight" in n for n in original)
    assert any("experts.gate_up_proj" in n for n in fused) and any("router.weight" in n for n in fused)


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["native", "torch"])
@pytest.mark.parametrize("original", [True, False], ids=["original-names", "fused-names"])
def test_logits_match_transformers(saved, original, backend):
    hf, paths = saved
    ours = moerun.load(paths[original], dtype=torch.float32, backend=backend)
    assert rel_err(ours.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["native", "torch"])
def test_greedy_tokens_match_transformers(saved, backend):
    hf, paths = saved
    prompt = IDS[0, :9].tolist()
    ours = moerun.load(paths[True], dtype=torch.float32, backend=backend)
    assert [t.id for t in ours.generate(prompt, 16)] == hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["native", "torch"])
def test_decode_steps_match_transformers(saved, backend):
    """One token a step over a growing cache (past PhiMoE's window of 7): the decode path gives
    transformers' logits at every position. The native one-call decode step cannot compute a
    LayerNorm, a softmax scale of its own or a residual multiplier, so these models decode through
    the general path (their MoE layers still on the native kernels)."""
    hf, paths = saved
    ours = moerun.load(paths[False], dtype=torch.float32, backend=backend)
    assert ours._decode_step is None
    ids = IDS[:1, :12]
    cache = ours.new_cache(1, 12)
    steps = [ours.hidden_logits(ours.forward(ids[:, i : i + 1], cache)[0, -1]) for i in range(12)]
    assert rel_err(torch.stack(steps), hf_logits(hf, ids)[0]) <= 1e-4


def test_a_batch_generates_what_each_prompt_does_alone(saved):
    _, paths = saved
    ours = moerun.load(paths[True], dtype=torch.float32)
    prompts = [IDS[0, :5].tolist(), IDS[1, :11].tolist()]
    alone = [[t.id for t in ours.generate(p, 6)] for p in prompts]
    assert [[t.id for t in out] for out in ours.generate(prompts, 6)] == alone


@pytest.mark.parametrize("original", [True, False], ids=["original-names", "fused-names"])
def test_streamed_experts_give_the_resident_logits(saved, original):
    _, paths = saved
    resident = moerun.load(paths[original], dtype=torch.float32)
    streamed = moerun.load(paths[original], dtype=torch.float32, expert_cache_gb=0.0005)
    try:
        assert streamed.expert_cache is not None
        assert torch.equal(streamed.logits(IDS), resident.logits(IDS))
    finally:
        streamed.close()


@pytest.mark.parametrize(
    "rope",
    [
        # Phi-3.5-MoE's config.json as published (transformers 4's rope_scaling); transformers 5's spelling
        {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "short_mscale": 1.0}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4}},
    ],
    ids=["rope_scaling", "rope_parameters"],
)
def test_longrope_without_long_factor_is_refused_by_name(tmp_path, rope):
    hf = make_hf("phimoe")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, **rope}))
    with pytest.raises(ConfigError, match=r"rope_type 'longrope' needs short_factor and long_factor"):
        moerun.load(tmp_path, dtype=torch.float32)
