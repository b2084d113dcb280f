"""DeepSeek-V2 and V3 (multi-head latent attention) as whole models from HF directories, against
transformers 5's own models on the same tiny random weights: logits in fp32 within 1e-4, greedy
tokens equal; q through q_a/q_b or plain q, YaRN with its mscale, interleaved or half-split RoPE,
leading dense layers, the V3 score-correction bias; the KV cache holds the latent and the rotary
key (its bytes per token counted here from the config); streamed experts, batches and the native
CPU path like the other families."""

import json

import pytest
import torch
import transformers
from conftest import rel_err
from hf_models import COMMON, VOCAB, hf_greedy, hf_logits

import moerun
from moerun.cli.main import main

MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=24,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
CASES = {
    "v3-q-lora-interleaved": (
        "DeepseekV3",
        dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
    ),
    "v3-plain-q-half-split-rope-yarn": (
        "DeepseekV3",
        dict(
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
            norm_topk_prob=False,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
        ),
    ),
    "v2-lite-greedy": (
        "DeepseekV2",
        dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy"),
    ),
    "v2-q-lora-group-limited": (
        "DeepseekV2",
        dict(
            q_lora_rank=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),
}
IDS = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(3))


def make_deepseek(case: str, seed: int = 0):
    prefix, extra = CASES[case]
    config = getattr(transformers, prefix + "Config")(**{**COMMON, **MLA, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=gen))
            elif "e_score_correction_bias" in name or name.endswith(".gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = make_deepseek(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, moerun.load(path, dtype=torch.float32), path


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    assert rel_err(ours.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


def test_greedy_tokens_match_transformers(pair):
    hf, ours, _ = pair
    prompt = IDS[0, :9].tolist()
    assert [t.id for t in ours.generate(prompt, 12)] == hf_greedy(hf, prompt, 12)


def test_the_kv_cache_holds_the_latent_and_the_rotary_key(pair):
    hf, ours, _ = pair
    c = hf.config
    cache = ours.new_cache(1, 10)
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * 4  # fp32
    assert cache.bytes_per_position == per_token
    # per-head keys and values would take heads x (nope + rope + v) per layer instead
    assert (
        per_token < c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 3 * 4
    )


def test_streamed_experts_and_batches_match(pair):
    _, ours, path = pair
    prompts = [IDS[0, :5].tolist(), IDS[1, :11].tolist()]
    alone = [[t.id for t in ours.generate(p, 6)] for p in prompts]
    assert [[t.id for t in out] for out in ours.generate(prompts, 6)] == alone
    streamed = moerun.load(path, dtype=torch.float32, expert_cache_gb=0.0005)
    try:
        assert torch.equal(streamed.logits(IDS), ours.logits(IDS))
    finally:
        streamed.close()


def test_the_torch_backend_agrees(pair):
    hf, _, path = pair
    torch_model = moerun.load(path, dtype=torch.float32, backend="torch")
    assert rel_err(torch_model.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


def test_inspect_describes_mla(pair, capsys):
    hf, _, path = pair
    assert main(["inspect", str(path), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    c = hf.config
    assert described["attention"].startswith("MLA")
    assert (
        described["kv_cache_bytes_per_token_bf16"]
        == (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * 2
    )


@pytest.mark.parametrize("absorb_below", [0, 4])
def test_decode_steps_in_either_form_match_transformers(pair, monkeypatch, absorb_below):
    """One token a step over a growing cache: the absorbed form (kv_b folded into q and the output,
    the default for decode) and the expanded one both give transformers' logits at every position."""
    from moerun.decoder import mla

    hf, ours, _ = pair
    monkeypatch.setattr(mla, "ABSORB_BELOW", absorb_below)
    ids = IDS[:1, :12]
    cache = ours.new_cache(1, 12)
    steps = [ours.hidden_logits(ours.forward(ids[:, i : i + 1], cache)[0, -1]) for i in range(12)]
    assert rel_err(torch.stack(steps), hf_logits(hf, ids)[0]) <= 1e-4


def test_a_v3_checkpoint_with_its_multi_token_prediction_layer_loads(tmp_path):
    """DeepSeek-V3's safetensors carry `num_nextn_predict_layers` more layers after the decoder's
    (a decoder layer plus eh_proj, enorm, hnorm, shared_head), which generation does not run."""
    from safetensors.torch import load_file, save_file

    hf = make_deepseek("v3-q-lora-interleaved")
    hf.save_pretrained(tmp_path)
    n, H = hf.config.num_hidden_layers, hf.config.hidden_size
    assert hf.config.to_dict()["num_nextn_predict_layers"] == 1
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [k for k in tensors if k.startswith(f"model.layers.{n - 1}.")]:
        tensors[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = tensors[name].clone()
    for name, shape in {
        "eh_proj.weight": (H, 2 * H),
        "enorm.weight": (H,),
        "shared_head.norm.weight": (H,),
    }.items():
        tensors[f"model.layers.{n}.{name}"] = torch.ones(shape)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert rel_err(moerun.load(tmp_path, dtype=torch.float32).logits(IDS), hf_logits(hf, IDS)) <= 1e-4
