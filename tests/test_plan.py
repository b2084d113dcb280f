"""Plan properties (hypothesis), checked against plain-Python restatements of the rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moerun.moe.plan import build_plan, build_token_plan


@st.composite
def routings(draw):
    experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, experts))
    tokens = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids, weights, experts


@settings(max_examples=200, deadline=None)
@given(routings())
def test_batched_plan_properties(routing):
    ids, weights, experts = routing
    tokens, top_k = ids.shape
    plan = build_plan(ids, weights, experts)
    order = plan.order.tolist()
    flat = ids.reshape(-1).tolist()
    # every assignment appears exactly once
    assert sorted(order) == list(range(tokens * top_k))
    # grouped by expert ascending, and offsets bound each group
    row_experts = [flat[a] for a in order]
    assert row_experts == sorted(row_experts)
    offsets = plan.offsets.tolist()
    assert len(offsets) == experts + 1 and offsets[0] == 0 and offsets[-1] == tokens * top_k
    for e in range(experts):
        assert all(x == e for x in row_experts[offsets[e] : offsets[e + 1]])
        assert offsets[e + 1] - offsets[e] == flat.count(e)
    # stable within a group: assignment numbers ascend
    for e in range(experts):
        group = order[offsets[e] : offsets[e + 1]]
        assert group == sorted(group)
    # per-row weights and tokens follow the rows; the inverse restores assignment order
    assert torch.equal(plan.row_weights, weights.reshape(-1)[plan.order])
    assert plan.row_tokens.tolist() == [a // top_k for a in order]
    assert torch.equal(plan.order[plan.inverse], torch.arange(tokens * top_k))
    assert torch.equal(torch.tensor(row_experts)[plan.inverse], ids.reshape(-1))


@settings(max_examples=100, deadline=None)
@given(routings())
def test_token_plan_properties(routing):
    ids, weights, _ = routing
    plan = build_token_plan(ids[0], weights[0])
    assert plan.experts == sorted(ids[0].tolist())
    by_expert = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert plan.weights.tolist() == [by_expert[e] for e in plan.experts]


def test_token_plan_rejects_repeated_experts():
    with pytest.raises(ValueError, match=r"layers\.2\.mlp.*2 distinct, expected k=3"):
        build_token_plan(torch.tensor([4, 1, 4]), torch.ones(3), "layers.2.mlp")
