"""The cpu backend (the native CPU kernels, weights in the file's format) end to end: MoE layers
against transformers and the torch backend in exact mode, int8 activations within a bound derived
from their rounding, whole models with every linear on the native layer and quantised weights kept
as stored, the choice of backend, and the fallback when the native layer cannot run."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import write_gguf
from hf_blocks import H, make_block, run_block
from hf_models import VOCAB, make_model
from test_layer_oracle import CASES, _family

import moerun
from moerun import cpu
from moerun.families.moe_block import layer_from_transformers
from moerun.linear import native_linear
from moerun.moe.backends import ActivationMode, resolve_backend
from moerun.moe.layer import MoELayer, MoESpec, layer_run
from moerun.moe.routing import SoftmaxTopK, route
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor
from moerun.quant.quantize import quantize

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}")
EXACT, INT8 = ActivationMode.EXACT, ActivationMode.INT8


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_layer_matches_transformers(case, tokens):
    block, config = make_block(_family(case), seed=tokens, **CASES[case])
    layer = layer_from_transformers(_family(case), config, block.state_dict(), backend="cpu")
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    assert rel_err(layer(x), run_block(block, x)) <= 1e-5


# --------------------------------------------------------------------------- quantised experts
QH, QI, QE = 256, 256, 6  # k-quant super-blocks hold 256 elements
SPEC = MoESpec(hidden=QH, intermediate=QI, num_experts=QE, routing=SoftmaxTopK(k=3, renormalize=True))
MIXES = [
    ("q4_k", "q6_k"),
    ("q8_0", "q8_0"),
    ("mxfp4", "mxfp4"),
    ("q4_0", "q8_0"),
    ("q2_k", "q3_k"),
    ("q5_k", "q4_k"),
]


def _layer(gate_up: str, down: str, backend: str, activations: ActivationMode = EXACT) -> MoELayer:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=gen) * (1.0 if name.startswith("router") else shape[-1] ** -0.5)
        for name, shape in SPEC.tensor_shapes().items()
    }
    tensors["experts.gate_up"] = quantize(tensors["experts.gate_up"], gate_up)
    tensors["experts.down"] = quantize(tensors["experts.down"], down)
    return MoELayer.from_tensors(
        SPEC, tensors, run=layer_run(tensors, backend=backend, activations=activations)
    )


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize(("gate_up", "down"), MIXES)
def test_quantised_layer_exact_mode_matches_the_torch_backend(gate_up, down, tokens):
    """Exact mode reads the same bytes as the torch backend dequantises (bit-exact with gguf) and
    multiplies fp32 activations: equal to fp32 rounding."""
    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(3))
    reference = _layer(gate_up, down, "torch")(x)
    assert rel_err(_layer(gate_up, down, "cpu")(x), reference) <= 1e-5


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize(("gate_up", "down"), MIXES[:3])
def test_quantised_layer_int8_mode_is_close_and_not_the_exact_one(gate_up, down, tokens):
    """int8 activations round each block of x to 8 bits (|error| <= max|x_block| / 254 per element)
    before gate_up and again before down: a per-mille-level change of the outputs, never exactness."""
    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(3))
    exact, rounded = _layer(gate_up, down, "cpu")(x), _layer(gate_up, down, "cpu", INT8)(x)
    assert not torch.equal(exact, rounded)
    assert rel_err(rounded, exact) <= 3e-2


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "mxfp4"])
def test_int8_linear_stays_within_the_bound_of_its_activation_rounding(fmt):
    """One projection, bounded term by term: rounding x to int8 per block of B elements moves
    element i by at most max|x_block| / 254 (round to nearest of 127 steps), so the output moves by at
    most sum_i |w_i| * max|x_block(i)| / 254, plus fp32 rounding of the sums."""
    gen = torch.Generator().manual_seed(5)
    weight = quantize(torch.randn(64, 512, generator=gen) * 0.05, fmt)
    x = torch.randn(3, 512, generator=gen)
    block = 256 if fmt.endswith("_k") else 32
    step = x.view(3, -1, block).abs().amax(-1, keepdim=True).expand(-1, -1, block).reshape(3, 512) / 254
    bound = step @ dequantize(weight).abs().T  # [3, 64]
    exact = native_linear(x, weight, integer=False)
    rounded = native_linear(x, weight, integer=True)
    assert ((rounded - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert rel_err(exact, x @ dequantize(weight).T) <= 1e-5


# ------------------------------------------------------------------------------- whole models
@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory):
    """An OLMoE-shaped model in a GGUF file with every 2-D weight in q4_k (k-quant rows of 256)."""
    hf_model = make_model("olmoe", hidden_size=256, intermediate_size=256, num_experts=4, num_hidden_layers=2)
    path = tmp_path_factory.mktemp("cpu") / "olmoe.gguf"
    stored = write_gguf(hf_model, path, "q4_k", attention="q4_k")
    return path, stored


def test_quantised_linears_stay_in_the_files_format(q4_k_gguf):
    path, _ = q4_k_gguf
    model = moerun.load(path, dtype=torch.float32)
    assert model.mlps[0].backend.name == "cpu"
    projections = [a.t[f"{p}.weight"] for a in model.attentions for p in "qkvo"]
    assert projections and all(isinstance(w, QTensor) and w.format.name == "q4_k" for w in projections)
    torch_model = moerun.load(path, dtype=torch.float32, backend="torch")
    assert not any(isinstance(a.t["q.weight"], QTensor) for a in torch_model.attentions)  # dequantised
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    assert rel_err(model.logits(ids), torch_model.logits(ids)) <= 1e-4


def test_a_bf16_model_decodes_with_int8_activations_by_default_and_fp32_exactly(q4_k_gguf):
    path, _ = q4_k_gguf
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    exact = moerun.load(path, dtype=torch.float32)
    assert exact.run.backend.native_linears and not exact.run.backend.int8_activations
    default = moerun.load(path, dtype=torch.bfloat16)
    assert default.run.backend.int8_activations
    assert all(moe.backend is default.run.backend for moe in default._moes)  # decided once, for all
    asked = moerun.load(path, dtype=torch.bfloat16, int8_activations=False)
    assert not asked.run.backend.int8_activations
    # each int8 projection is within its derived bound (test above); through a random model's
    # attention and routing the logits move further, so here only: they move, and stay finite
    rounded, fp32 = default.logits(ids), exact.logits(ids)
    assert torch.isfinite(rounded).all() and not torch.equal(rounded, fp32)


def test_auto_picks_the_cpu_backend_where_the_native_kernels_run():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend("cpu", torch.device("meta"))


def test_without_the_native_kernels_auto_runs_the_torch_backend(q4_k_gguf):
    """MOERUN_CPU_ISA=off (as where the kernels cannot be built): the model loads on the torch
    backend, weights dequantised, and computes the same logits."""
    path, _ = q4_k_gguf
    code = (
        "import sys, torch, moerun; m = moerun.load(sys.argv[1], dtype=torch.float32);"
        "print(m.mlps[0].backend.name);"
        "ids = torch.arange(9)[None] % 90; sys.stdout.write(m.logits(ids).numpy().tobytes().hex())"
    )
    env = {**os.environ, "MOERUN_CPU_ISA": "off"}
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    backend, logits = run.stdout.split("\n", 1)
    assert backend == "torch"
    fallback = torch.frombuffer(bytearray(bytes.fromhex(logits)), dtype=torch.float32)
    native = moerun.load(path, dtype=torch.float32).logits(torch.arange(9)[None] % 90).reshape(-1)
    assert rel_err(native, fallback) <= 1e-4


@pytest.mark.parametrize("tokens", [2, 5, 16, 40])
@pytest.mark.parametrize(("gate_up", "down"), MIXES)
def test_a_batch_gives_each_token_the_bits_it_gets_alone(gate_up, down, tokens):
    """A server's decode step (2-16 tokens) or a prompt in one native call (tokens_forward), each
    expert's rows read once for all its tokens: the torch backend's outputs to fp32 rounding, and
    through the layer (native routing, each token alone) each token's own one-token step bit for bit:
    what a token computes does not depend on its batch."""
    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(7))
    for activations in (EXACT, INT8):
        layer = _layer(gate_up, down, "cpu", activations)
        _, _, ids, weights = layer.backend.route(x, SPEC.routing, layer.tensors, "moe", [])
        want_weights, want_ids = route(
            SPEC.routing, torch.nn.functional.linear(x, layer.tensors["router.weight"])
        )
        assert torch.equal(ids, want_ids) and rel_err(weights, want_weights) <= 1e-5  # torch's routing

        args = (x, ids, weights, layer.experts, SPEC.activation)
        batch = layer.backend.tokens_forward(*args)
        assert torch.equal(batch, layer.backend.tokens_forward(*args))  # run to run
        alone = torch.cat([layer(x[t : t + 1]) for t in range(tokens)])
        assert torch.equal(batch, alone) and torch.equal(layer(x), alone)
        if activations is EXACT:
            assert rel_err(batch, _layer(gate_up, down, "torch")(x)) <= 1e-5


@pytest.mark.parametrize("tokens", [40, 131])
@pytest.mark.parametrize(("gate_up", "down"), MIXES)
def test_a_prompt_runs_each_expert_once_with_the_row_kernels_bits(gate_up, down, tokens):
    """A prompt's MoE step in one native call: experts with enough tokens go through the prefill
    GEMM, which gives the row kernels' bits (gemm=False); the layer matches the torch backend in
    exact mode, and int8 mode stays within its bound of the exact one."""
    from moerun.moe.backends import cpu_backend

    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(8))
    layer = _layer(gate_up, down, "cpu", INT8)
    weights, ids = route(SPEC.routing, torch.nn.functional.linear(x, layer.tensors["router.weight"]))
    table = cpu_backend._table(layer.experts, SPEC.activation)
    distinct = torch.unique(ids)
    assert torch.bincount(ids.reshape(-1)).max() >= 16  # an expert with enough tokens for every GEMM
    pointers, formats = table.rows(distinct)
    slots = torch.searchsorted(distinct, ids).to(torch.int32)
    args = (x, cpu.ExpertTable(pointers, formats, QI), (slots, weights.contiguous()), SPEC.activation, True)
    assert torch.equal(cpu.moe_decode_table(*args), cpu.moe_decode_table(*args, gemm=False))
    exact = _layer(gate_up, down, "cpu", EXACT)(x)
    assert rel_err(exact, _layer(gate_up, down, "torch")(x)) <= 1e-5
    assert 0 < rel_err(layer(x), exact) <= 5e-2


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize(("gate_up", "down"), MIXES)
def test_expert_rows_are_the_terms_of_the_one_call_sum(gate_up, down, tokens):
    """expert_rows on the native kernels (what each rank computes under expert parallelism): summed
    in plan order they are tokens_forward's outputs bit for bit; computed for a span of experts or
    scattered ones, each row is the one computed for all of them."""
    from moerun.moe.backends.workspace import Workspace

    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(9))
    for activations in (EXACT, INT8):
        layer = _layer(gate_up, down, "cpu", activations)
        weights, ids = route(SPEC.routing, torch.nn.functional.linear(x, layer.tensors["router.weight"]))
        backend = layer.backend
        plan = backend.batch_plan(ids, weights, SPEC.num_experts)
        ws = Workspace()
        rows = backend.expert_rows(x, plan, layer.experts, SPEC.activation, ws).clone()
        summed = backend.combine(rows, plan, ws)
        want = backend.tokens_forward(x, ids, weights, layer.experts, SPEC.activation)
        assert torch.equal(summed, want)
        offsets = plan.offsets.tolist()
        for only in ([1, 2], [0, 3]):
            some = backend.expert_rows(x, plan, layer.experts, SPEC.activation, Workspace(), only)
            for e in only:
                assert torch.equal(some[offsets[e] : offsets[e + 1]], rows[offsets[e] : offsets[e + 1]])
