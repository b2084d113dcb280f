"""The Triton prefill path under the interpreter: the device plan against its host-loop reference and
moerun.moe.plan, each grouped-GEMM kernel against its torch reference, and the chained layer against the
torch backend (expert_rows + combine), the real reference."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import rel_err  # noqa: E402
from random_blocks import random_blocks  # noqa: E402

pytest.importorskip("triton")

from moerun.activations import GLU, GptOssSwiGLU  # noqa: E402
from moerun.kernels import grouped_gemm as gg  # noqa: E402
from moerun.kernels.device_plan import build_device_plan, build_device_plan_reference, plan_capacity  # noqa: E402
from moerun.kernels.weights import FORMAT_CODES, kernel_weight  # noqa: E402
from moerun.moe.backends.torch_backend import combine, expert_rows  # noqa: E402
from moerun.moe.backends.workspace import Workspace  # noqa: E402
from moerun.moe.experts import ExpertWeights  # noqa: E402
from moerun.moe.plan import build_plan  # noqa: E402
from moerun.quant.formats import get_format  # noqa: E402
from moerun.quant.quantize import BLOCK_QUANTIZERS, quantize  # noqa: E402

PLAN_FIELDS = ["sorted_rows", "row_weights", "block_experts", "counts", "offsets", "inverse"]
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_T": 4, "BLOCK_H": 32}
ACTS = {"silu": GLU("silu"), "gelu": GLU("gelu"), "gpt_oss": GptOssSwiGLU()}


def _routing(tokens: int, top_k: int, experts: int, seed: int, used: int | None = None):
    """ids [T, k] (distinct per token, ascending, drawn from the first `used` experts) and weights."""
    gen = torch.Generator().manual_seed(seed)
    used = experts if used is None else used
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k].sort().values for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=gen)


# --------------------------------------------------------------------------------------------- plan
PLAN_CASES = [  # tokens, k, experts, block_m, experts used
    (1, 1, 4, 16, None),
    (1, 4, 8, 4, None),
    (7, 2, 5, 16, None),
    (13, 2, 16, 4, 5),  # most experts get no rows
    (40, 4, 6, 8, None),
    (9, 3, 3, 1, None),  # block_m 1: no padding
    (3, 2, 8, 8, None),
]


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "used"), PLAN_CASES)
@pytest.mark.parametrize("seed", range(4))
def test_device_plan_matches_host_loops_and_build_plan(tokens, top_k, experts, block_m, used, seed):
    ids, weights = _routing(tokens, top_k, experts, seed, used)
    plan = build_device_plan(ids, weights, experts, block_m)
    ref = build_device_plan_reference(ids, weights, experts, block_m)
    for field in PLAN_FIELDS:
        assert torch.equal(getattr(plan, field), getattr(ref, field)), field
    assert plan.max_rows == plan_capacity(tokens, top_k, experts, block_m)
    assert plan.max_rows % block_m == 0 and plan.max_blocks == plan.max_rows // block_m

    host = build_plan(ids, weights, experts)
    assignments = tokens * top_k
    real = plan.sorted_rows < assignments
    assert torch.equal(plan.sorted_rows[real].long(), host.order)  # unpadded: build_plan's order
    assert torch.equal(plan.row_weights[real], host.row_weights)
    assert torch.equal(plan.row_weights[~real], torch.zeros(int((~real).sum())))
    assert torch.equal(plan.sorted_rows[plan.inverse.long()], torch.arange(assignments, dtype=torch.int32))
    assert torch.equal(plan.counts.long(), torch.bincount(ids.reshape(-1), minlength=experts))
    padded = (plan.counts + block_m - 1) // block_m * block_m
    assert torch.equal(plan.offsets[1:] - plan.offsets[:-1], padded)
    # every row of a used block belongs to that block's expert; unused blocks hold only padding
    row_expert = torch.repeat_interleave(plan.block_experts.long(), block_m)
    assert torch.equal(row_expert[plan.inverse.long()], ids.reshape(-1))
    assert not real[row_expert < 0].any()


def test_device_plan_capacity_is_reached_by_one_row_per_expert():
    ids = torch.arange(6).view(3, 2)  # six experts with one row each: every block is one row + padding
    plan = build_device_plan(ids, torch.ones(3, 2), num_experts=8, block_m=8)
    assert plan.max_rows == 48 and bool((plan.block_experts >= 0).all())


def test_device_plan_reads_no_values_on_the_host():
    # meta tensors have no values: .item(), .tolist(), nonzero or boolean indexing would raise
    ids = torch.empty(5, 2, dtype=torch.int64, device="meta")
    plan = build_device_plan(ids, torch.empty(5, 2, device="meta"), num_experts=4, block_m=8)
    assert plan.sorted_rows.shape == (plan_capacity(5, 2, 4, 8),) and plan.inverse.shape == (10,)


# ------------------------------------------------------------------------------------------ kernels
KERNEL_CASES = [  # tokens, k, experts, hidden, intermediate, experts used
    (1, 1, 3, 40, 24, None),
    (9, 2, 6, 72, 40, 4),  # two experts with no rows
    (5, 4, 8, 33, 17, None),  # H, I odd
]


def _problem(tokens, top_k, experts, hidden, inter, used, dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    ids, weights = _routing(tokens, top_k, experts, seed, used)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    biases = (torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen))
    biases = tuple(b.to(dtype) for b in biases)  # as a layer holds them: in the compute dtype
    x = torch.randn(tokens, hidden, generator=gen)
    return dict(
        x=x.to(dtype),
        ids=ids,
        weights=weights,
        gate_up=gate_up.to(dtype),
        down=down.to(dtype),
        biases=biases if bias else (None, None),
    )


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu", "gpt_oss"])
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_gate_up_activation_matches_reference(case, act, dtype):
    tokens, top_k, experts, *_ = KERNEL_CASES[case]
    p = _problem(*KERNEL_CASES[case], dtype, seed=case, bias=case != 1)
    plan = build_device_plan(p["ids"], p["weights"], experts, SMALL["BLOCK_M"])
    args = (p["x"], plan, kernel_weight(p["gate_up"]), p["biases"][0], ACTS[act], SMALL)
    a, ref = gg.gate_up_activation(*args), gg.gate_up_activation_reference(*args)
    assert a.dtype == dtype and a.shape == (plan.max_rows, p["gate_up"].shape[1] // 2)
    used = torch.repeat_interleave(plan.block_experts >= 0, plan.block_m)  # rows the kernel writes
    assert rel_err(a[used], ref[used]) <= TOL[dtype]
    padding = used & (plan.sorted_rows == tokens * top_k)
    assert not a[padding].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_down_weighted_matches_reference(case, bias, dtype):
    _, _, experts, hidden, inter, _ = KERNEL_CASES[case]
    p = _problem(*KERNEL_CASES[case], dtype, seed=10 + case, bias=bias)
    plan = build_device_plan(p["ids"], p["weights"], experts, SMALL["BLOCK_M"])
    a = torch.randn(plan.max_rows, inter, generator=torch.Generator().manual_seed(case)).to(dtype)
    a[plan.sorted_rows == plan.num_tokens * plan.top_k] = 0  # padding rows, as gate_up_activation leaves them
    args = (a, plan, kernel_weight(p["down"]), p["biases"][1], SMALL)
    rows, ref = gg.down_weighted(*args), gg.down_weighted_reference(*args)
    assert rows.dtype == torch.float32 and rows.shape == (plan.max_rows, hidden)
    used = torch.repeat_interleave(plan.block_experts >= 0, plan.block_m)
    assert rel_err(rows[used], ref[used]) <= TOL[dtype]
    assert not rows[used & (plan.row_weights == 0)].any()


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "used"), PLAN_CASES[:5])
def test_combine_rows_is_the_ordered_sum_bit_for_bit(tokens, top_k, experts, block_m, used):
    ids, weights = _routing(tokens, top_k, experts, 3, used)
    plan = build_device_plan(ids, weights, experts, block_m)
    rows = torch.randn(plan.max_rows, 37, generator=torch.Generator().manual_seed(tokens))
    config = {**SMALL, "BLOCK_M": block_m}
    out = gg.combine_rows(rows, plan, config)
    assert torch.equal(out, gg.combine_rows_reference(rows, plan, config))
    # and the same sum as the torch backend's combine over build_plan's rows
    host = build_plan(ids, weights, experts)
    real = plan.sorted_rows < tokens * top_k
    assert torch.equal(out, combine(rows[real], host, Workspace()))


# ----------------------------------------------------------------------------- the chained layer
def _torch_backend(p, act, gate_up=None, down=None, dtype=None):
    experts = ExpertWeights(
        p["gate_up"] if gate_up is None else gate_up,
        p["down"] if down is None else down,
        tuple(p["biases"]),
        dtype=dtype or p["x"].dtype,
        layer_name="test",
    )
    plan = build_plan(p["ids"], p["weights"], p["gate_up"].shape[0])
    ws = Workspace()
    return combine(expert_rows(p["x"], plan, experts, act, ws), plan, ws)


@pytest.mark.parametrize(
    ("dtype", "act", "case"),
    [
        (torch.float32, "silu", 0),
        (torch.float32, "gpt_oss", 1),
        (torch.float32, "gelu", 2),
        (torch.bfloat16, "silu", 1),
        (torch.bfloat16, "gpt_oss", 2),
        (torch.float16, "gelu", 0),
    ],
)
def test_moe_prefill_matches_the_torch_backend(dtype, act, case):
    _, _, experts, *_ = KERNEL_CASES[case]
    p = _problem(*KERNEL_CASES[case], dtype, seed=20 + case)
    plan = build_device_plan(p["ids"], p["weights"], experts, SMALL["BLOCK_M"])
    args = (
        p["x"],
        plan,
        kernel_weight(p["gate_up"]),
        kernel_weight(p["down"]),
        p["biases"],
        ACTS[act],
        SMALL,
    )
    out = gg.moe_prefill(*args)
    assert out.dtype == torch.float32 and out.shape == p["x"].shape
    assert rel_err(out, gg.moe_prefill_reference(*args)) <= TOL[dtype]
    # the torch backend rounds the gate/up projection to the compute dtype before the activation
    assert rel_err(out, _torch_backend(p, ACTS[act])) <= TOL[dtype]


def test_default_config_and_block_m_mismatch():
    p = _problem(3, 2, 4, 24, 16, None, torch.float32)
    plan = build_device_plan(p["ids"], p["weights"], 4, gg.DEFAULT_CONFIG["BLOCK_M"])
    args = (p["x"], plan, kernel_weight(p["gate_up"]), kernel_weight(p["down"]), p["biases"], GLU())
    assert rel_err(gg.moe_prefill(*args), _torch_backend(p, GLU())) <= 1e-5
    with pytest.raises(ValueError, match="block_m"):
        gg.moe_prefill(*args, config={"BLOCK_M": 16})


QUANTISED = [name for name in FORMAT_CODES if not get_format(name).is_float]


@pytest.mark.parametrize(
    "fmt", QUANTISED or [pytest.param("none", marks=pytest.mark.skip("no quantised formats"))]
)
def test_moe_prefill_on_quantised_weights(fmt):
    side = max(64, get_format(fmt).block_size)  # H and I whole blocks
    p = _problem(6, 2, 3, side, side, None, torch.float32, seed=30)
    if fmt in BLOCK_QUANTIZERS:
        gate_up, down = quantize(p["gate_up"], fmt), quantize(p["down"], fmt)
    else:  # formats moerun reads but does not write: random blocks
        gen = torch.Generator().manual_seed(31)
        gate_up, down = (random_blocks(fmt, tuple(p[name].shape), gen) for name in ("gate_up", "down"))
    plan = build_device_plan(p["ids"], p["weights"], 3, 16)
    config = {**SMALL, "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_H": 128}
    args = (p["x"], plan, kernel_weight(gate_up), kernel_weight(down), p["biases"], GptOssSwiGLU(), config)
    out = gg.moe_prefill(*args)
    assert rel_err(out, gg.moe_prefill_reference(*args)) <= 1e-5
    assert rel_err(out, _torch_backend(p, GptOssSwiGLU(), gate_up, down, torch.float32)) <= 1e-5
