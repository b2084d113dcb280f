"""The layer against transformers' own MoE blocks, family by family (tiny random configs)."""

import pytest
import torch
from conftest import rel_err
from hf_blocks import H, make_block, run_block

from moerun.families.moe_block import layer_from_transformers

CASES = {
    "mixtral": {},
    "mixtral-gelu": dict(hidden_act="gelu"),
    "mixtral-gelu-tanh": dict(hidden_act="gelu_pytorch_tanh"),
    "qwen2_moe": {},
    "qwen3_moe-norm": dict(norm_topk_prob=True),
    "qwen3_moe-no-norm": dict(norm_topk_prob=False),
    "olmoe": {},
    "gpt_oss": {},
    "deepseek_v2-greedy": dict(topk_method="greedy"),
    "deepseek_v2-group-limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    "deepseek_v3": {},
    "deepseek_v3-no-norm": dict(norm_topk_prob=False),
    "phimoe": {},
    "granitemoe": {},
}


def _family(case: str) -> str:
    return case.split("-")[0]


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_transformers(case, tokens):
    block, config = make_block(_family(case), seed=tokens, **CASES[case])
    layer = layer_from_transformers(_family(case), config, block.state_dict(), name="layers.0.mlp")
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    assert rel_err(layer(x), run_block(block, x)) <= 1e-5


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_matches_transformers_on_rounded_weights(case, tokens):
    """moerun in bf16 against transformers in fp32 on the same bf16-rounded weights and input
    (the router runs in fp32 in both, so the expert choices agree)."""
    block, config = make_block(_family(case), seed=tokens, **CASES[case])
    with torch.no_grad():
        for tensor in block.state_dict().values():
            tensor.copy_(tensor.bfloat16().float())
    layer = layer_from_transformers(_family(case), config, block.state_dict(), dtype=torch.bfloat16)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, run_block(block, x.float())) <= 2e-2


def test_gpt_oss_clamp_engages():
    """The oracle above only proves the clamp if the clamp changes the output: lifting the limit must."""
    block, config = make_block("gpt_oss")
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    clamped = layer_from_transformers("gpt_oss", config, block.state_dict())
    unclamped = layer_from_transformers("gpt_oss", {**config, "swiglu_limit": 1e9}, block.state_dict())
    assert rel_err(unclamped(x), clamped(x)) > 1e-2


def test_f16_layer_close_to_fp32():
    block, config = make_block("qwen2_moe")
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    ref = layer_from_transformers("qwen2_moe", config, block.state_dict())(x)
    half = layer_from_transformers("qwen2_moe", config, block.state_dict(), dtype=torch.float16)
    out = half(x.half())
    assert out.dtype == torch.float16
    assert rel_err(out, ref) <= 5e-3


def test_batched_input_shape_is_kept():
    block, config = make_block("olmoe")
    layer = layer_from_transformers("olmoe", config, block.state_dict())
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x)
    assert rel_err(layer(x), ref) <= 1e-5
