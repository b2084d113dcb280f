"""Routing specs: closed-form cases, transformers' routers, and bad logits."""

import math

import pytest
import torch

from moerun.moe.routing import (
    DeepSeekV2Softmax,
    DeepSeekV3Sigmoid,
    RouterError,
    SoftmaxTopK,
    SparseMixer,
    TopKSoftmax,
    check_logits,
)


def test_softmax_topk_closed_form():
    logits = torch.tensor([[0.0, math.log(3.0), math.log(2.0), -50.0]])
    total = 1 + 3 + 2 + math.exp(-50)
    weights, ids = SoftmaxTopK(k=2, renormalize=False).select(logits)
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(weights, torch.tensor([[3 / total, 2 / total]]), rtol=1e-6)
    weights, _ = SoftmaxTopK(k=2, renormalize=True).select(logits)
    assert torch.allclose(weights, torch.tensor([[0.6, 0.4]]), rtol=1e-6)


def test_topk_softmax_closed_form():
    logits = torch.tensor([[5.0, 1.0, 5.0 + math.log(3.0), -2.0]])
    weights, ids = TopKSoftmax(k=2).select(logits)
    assert ids.tolist() == [[2, 0]]
    assert torch.allclose(weights, torch.tensor([[0.75, 0.25]]), rtol=1e-6)


def test_deepseek_v2_group_limited_skips_the_weak_group():
    # groups {0,1} and {2,3}: the best single score lies in group 1, so group 0's experts are excluded
    logits = torch.tensor([[2.0, 1.9, 3.0, -5.0]])
    weights, ids = DeepSeekV2Softmax(
        k=2, routed_scaling=2.0, n_group=2, topk_group=1, group_limited=True
    ).select(logits)
    probs = torch.softmax(logits, dim=-1)[0]
    assert ids.tolist() == [[2, 3]]
    assert torch.allclose(weights, 2.0 * probs[[2, 3]][None], rtol=1e-6)
    _, greedy_ids = DeepSeekV2Softmax(k=2).select(logits)
    assert greedy_ids.tolist() == [[2, 0]]


def test_deepseek_v3_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[1.0, 0.0, -1.0, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    spec = DeepSeekV3Sigmoid(k=2, n_group=1, topk_group=1, renormalize=False, routed_scaling=1.5)
    weights, ids = spec.select(logits, bias)
    assert sorted(ids[0].tolist()) == [0, 3]
    chosen = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert chosen[3] == pytest.approx(1.5 * torch.sigmoid(torch.tensor(-2.0)).item(), rel=1e-6)
    assert chosen[0] == pytest.approx(1.5 * torch.sigmoid(torch.tensor(1.0)).item(), rel=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_matches_transformers_router(norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=32,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=3,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=gen) * 0.3)
    x = torch.randn(50, 16, generator=gen)
    _, ref_w, ref_ids = router(x)
    spec = DeepSeekV3Sigmoid(k=6, n_group=8, topk_group=3, renormalize=norm, routed_scaling=2.5)
    weights, ids = spec.select(x @ router.weight.T, router.e_score_correction_bias)
    # transformers returns its k ids unsorted: compare as sorted (id, weight) pairs
    ours = torch.sort(ids, dim=1)
    theirs = torch.sort(ref_ids, dim=1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.allclose(weights.gather(1, ours.indices), ref_w.gather(1, theirs.indices), rtol=1e-6)


def test_sparsemixer_matches_transformers():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
    logits[:20, 3] = logits[:20, 5]  # near-ties exercise the jitter mask
    ref_w, ref_ids = sparsemixer(logits, jitter_eps=0.01, training=False)
    weights, ids = SparseMixer(jitter_eps=0.01).select(logits)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights, ref_w, rtol=1e-6)


def test_sparsemixer_is_top2_only():
    with pytest.raises(ValueError, match="exactly 2"):
        SparseMixer(jitter_eps=0.01, k=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_name_the_layer(bad):
    logits = torch.zeros(4, 8)
    logits[2, 5] = bad
    with pytest.raises(RouterError, match=r"layers\.7\.mlp.*tokens \[2\]"):
        check_logits(logits, "layers.7.mlp")


def test_layer_raises_on_nan_input():
    from hf_blocks import H, make_block

    from moerun.families.moe_block import layer_from_transformers

    block, config = make_block("mixtral")
    layer = layer_from_transformers("mixtral", config, block.state_dict(), name="layers.3.block_sparse_moe")
    x = torch.randn(4, H)
    x[1, 0] = float("nan")
    with pytest.raises(RouterError, match="layers.3.block_sparse_moe"):
        layer(x)
