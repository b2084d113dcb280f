"""The triton backend end to end: MoE layers and whole models against transformers and against the
torch backend, every supported format, the fallback for the others, backend choice, launch configs.

Without CUDA the kernels run in triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports them)."""

import json

import pytest
import torch
from conftest import rel_err
from hf_blocks import H, make_block, run_block
from random_blocks import random_blocks
from test_layer_oracle import CASES, _family

from moerun.families.moe_block import layer_from_transformers
from moerun.moe.backends import ActivationMode, resolve_backend
from moerun.moe.layer import MoELayer, MoESpec, layer_run
from moerun.moe.routing import SoftmaxTopK
from moerun.quant.dequant import dequantize
from moerun.quant.quantize import quantize

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_layer_matches_transformers(case, tokens):
    block, config = make_block(_family(case), seed=tokens, **CASES[case])
    layer = layer_from_transformers(
        _family(case), config, block.state_dict(), backend="triton", device=DEVICE
    )
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    assert rel_err(layer(x.to(DEVICE)).cpu(), run_block(block, x)) <= 1e-5


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe"])
def test_bf16_layer_matches_the_torch_backend(family, tokens):
    """bf16 weights and input: both backends round the same products to bf16 at the same points
    (projection outputs in fp32, activation input rounded to bf16), so they agree to bf16 rounding."""
    block, config = make_block(family, seed=tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    layers = [
        layer_from_transformers(
            family, config, block.state_dict(), dtype=torch.bfloat16, backend=b, device=DEVICE
        )
        for b in ("torch", "triton")
    ]
    reference, out = (layer(x.to(DEVICE)).cpu() for layer in layers)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference) <= 1e-2


# --------------------------------------------------------------------------- quantised experts
QH, QI, QE = 256, 256, 4  # k-quant super-blocks hold 256 elements
SPEC = MoESpec(hidden=QH, intermediate=QI, num_experts=QE, routing=SoftmaxTopK(k=2, renormalize=True))


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen) * (1.0 if name.startswith("router") else shape[-1] ** -0.5)
        for name, shape in SPEC.tensor_shapes().items()
    }


def _quantised_layer(
    gate_up_format: str, down_format: str, backend: str, activations: ActivationMode | None = None
) -> MoELayer:
    tensors = _tensors()
    tensors["experts.gate_up"] = quantize(tensors["experts.gate_up"], gate_up_format)
    tensors["experts.down"] = quantize(tensors["experts.down"], down_format)
    return MoELayer.from_tensors(SPEC, tensors, run=layer_run(tensors, None, DEVICE, backend, activations))


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize(
    ("gate_up", "down"),
    [
        ("q8_0", "q8_0"),
        ("q4_k", "q6_k"),
        ("mxfp4", "mxfp4"),
        ("q4_0", "q8_0"),
        ("q2_k", "q3_k"),
        ("q5_k", "q4_k"),
    ],
)
def test_quantised_layer_matches_dense_on_dequantised_weights(gate_up, down, tokens):
    """The kernels dequantise inside the GEMM/GEMV; the reference is the dense fp32 layer on weights
    dequantised by moerun.quant (bit-exact against the gguf package)."""
    layer = _quantised_layer(gate_up, down, "triton")
    dense_tensors = {k: dequantize(v) if k.startswith("experts.") else v for k, v in layer.tensors.items()}
    dense = MoELayer.from_tensors(SPEC, {k: v.cpu() for k, v in dense_tensors.items()})
    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(tokens))
    assert rel_err(layer(x.to(DEVICE)).cpu(), dense(x)) <= 1e-5


@pytest.mark.parametrize("activations", [ActivationMode.EXACT, ActivationMode.INT8])
@pytest.mark.parametrize(("gate_up", "down", "tokens"), [("iq2_xxs", "tq1_0", 1), ("iq3_s", "iq1_m", 5)])
def test_layer_on_formats_without_a_quantiser_or_an_integer_kernel(gate_up, down, tokens, activations):
    """Random blocks of formats moerun reads but does not write: decode (1 token) and prefill read them
    in the kernels, with int8 activations too (no q8_1 kernel: float activations, the same numbers)."""
    tensors = _tensors()
    gen = torch.Generator().manual_seed(1)
    for name, fmt in (("experts.gate_up", gate_up), ("experts.down", down)):
        tensors[name] = random_blocks(fmt, tuple(tensors[name].shape), gen)
    layer = MoELayer.from_tensors(SPEC, tensors, run=layer_run(tensors, None, DEVICE, "triton", activations))
    dense = MoELayer.from_tensors(
        SPEC, {k: dequantize(v) if k.startswith("experts.") else v for k, v in tensors.items()}
    )
    assert layer.backend.name == "triton"
    assert layer.backend.int8_activations == (activations is ActivationMode.INT8)
    x = torch.randn(tokens, QH, generator=torch.Generator().manual_seed(tokens))
    assert rel_err(layer(x.to(DEVICE)).cpu(), dense(x)) <= 1e-5


def test_layers_the_kernels_cannot_run_fall_back_to_torch_with_a_warning():
    tensors = _tensors()
    with pytest.warns(UserWarning, match="compute in fp32, bf16 or f16, not torch.float64"):
        layer = MoELayer.from_tensors(SPEC, tensors, run=layer_run(tensors, torch.float64, DEVICE, "triton"))
    reference = MoELayer.from_tensors(SPEC, tensors, run=layer_run(tensors, torch.float64, DEVICE, "torch"))
    x = torch.randn(5, QH, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    assert torch.equal(layer(x), reference(x))


# ------------------------------------------------------------------------------- whole models
def test_whole_model_logits_and_greedy_tokens_match_transformers(tmp_path):
    from hf_models import make_model, save_model

    import moerun

    model = make_model("olmoe")
    save_model(model, tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits[0]
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    ours = moerun.load(tmp_path, device=DEVICE, dtype=torch.float32, backend="triton")
    assert all(layer.backend.name == "triton" for layer in _moe_layers(ours))
    assert rel_err(ours.logits(ids[0].to(DEVICE)).cpu(), expected) <= 1e-4
    assert [t.id for t in ours.generate(ids[0].tolist(), max_new_tokens=6)] == greedy


def _moe_layers(model):
    return [mlp for mlp in model.mlps if isinstance(mlp, MoELayer)]


# ------------------------------------------------------------------------------ backend choice
def test_auto_never_picks_triton_on_cpu_and_triton_needs_the_interpreter_there(monkeypatch):
    from moerun import cpu
    from moerun.settings import settings

    # on a CPU: the native kernels where they run, else the torch reference; never triton
    assert resolve_backend("auto", torch.device("cpu")) == ("cpu" if cpu.available() else "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    settings.cache_clear()
    try:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_backend("triton", torch.device("cpu"))
    finally:
        monkeypatch.undo()
        settings.cache_clear()
    with pytest.raises(ValueError, match="backend='cuda-graphs'"):
        resolve_backend("cuda-graphs", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


# ---------------------------------------------------------------------------- launch configs
def test_launch_config_takes_the_most_specific_key_gpu_file_first(tmp_path):
    from moerun.kernels.configs import gpu_file_name, launch_config

    (tmp_path / "default.json").write_text(
        json.dumps({"decode_down": {"BLOCK_N": 1}, "decode_down|q4_k": {"BLOCK_N": 2}})
    )
    (tmp_path / gpu_file_name("NVIDIA Test-GPU 80GB")).write_text(
        json.dumps({"decode_down|q4_k|64x32": {"BLOCK_N": 3}})
    )
    gpu = "NVIDIA Test-GPU 80GB"
    assert launch_config("decode_down", "q4_k", 64, 32, gpu, tmp_path) == {"BLOCK_N": 3}
    assert launch_config("decode_down", "q4_k", 64, 64, gpu, tmp_path) == {"BLOCK_N": 2}
    assert launch_config("decode_down", "bf16", 64, 32, gpu, tmp_path) == {"BLOCK_N": 1}
    assert launch_config("decode_down", "q4_k", 64, 32, "another GPU", tmp_path) == {"BLOCK_N": 2}
    with pytest.raises(ValueError, match="no entry for kernel 'prefill_down'"):
        launch_config("prefill_down", "bf16", 1, 1, gpu, tmp_path)


def test_shipped_config_files_cover_every_kernel_with_known_keys():
    from moerun.kernels.configs import CONFIG_DIR, KERNELS, LAUNCHES

    files = sorted(CONFIG_DIR.glob("*.json"))
    assert CONFIG_DIR / "default.json" in files
    known = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_T", "BLOCK_H", "BLOCK_I", "num_warps", "num_stages"}
    for path in files:
        table = json.loads(path.read_text())
        for key, config in table.items():
            launch = key.split("|")[0]
            assert launch in (LAUNCHES if path.name == "default.json" else KERNELS), f"{path.name}: {key}"
            assert set(config) <= known, f"{path.name}: {key}"
    default = json.loads((CONFIG_DIR / "default.json").read_text())
    assert set(LAUNCHES) <= set(default)


# ----------------------------------------------------------------------------------- CUDA graph
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_of_the_decode_kernels_equal_eager_runs():
    """The captured decode step, replayed with refilled buffers, gives bitwise what the same kernels
    give run eagerly, step after step with new routing."""
    from moerun.activations import GLU
    from moerun.kernels import decode
    from moerun.kernels.graph import GraphedStep
    from moerun.kernels.weights import kernel_weight

    gen = torch.Generator().manual_seed(5)
    gate_up = kernel_weight((torch.randn(8, 2 * 96, 64, generator=gen) / 8).cuda())
    down = kernel_weight((torch.randn(8, 64, 96, generator=gen) / 8).cuda())

    def rows(x, slots, experts, weights):
        h = decode.gate_up_experts(x, slots, experts, gate_up, None)
        return decode.down_experts(
            decode.activate_weighted(h, weights, GLU()), slots, experts, down, None, weights
        )

    k = 2
    zeros = {"x": torch.zeros(64), "slots": torch.zeros(k, dtype=torch.int32)}
    buffers = {**zeros, "experts": torch.zeros(k, dtype=torch.int32), "weights": torch.zeros(k)}
    step = GraphedStep(rows, {name: b.cuda() for name, b in buffers.items()})
    for _ in range(5):
        ids = torch.randperm(8, generator=gen)[:k].sort().values.int().cuda()
        inputs = dict(
            x=torch.randn(64, generator=gen).cuda(), slots=ids, experts=ids, weights=torch.rand(k).cuda()
        )
        assert torch.equal(step.run(**inputs).clone(), rows(**inputs))
    assert step.graph is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_graphed_decode_layer_matches_transformers_every_step(family):
    block, config = make_block(family)
    layer = layer_from_transformers(family, config, block.state_dict(), backend="triton", device="cuda")
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        x = torch.randn(1, H, generator=gen)
        assert rel_err(layer(x.cuda()).cpu(), run_block(block, x)) <= 1e-5


def test_graphed_step_runs_eagerly_off_cuda():
    from moerun.kernels.graph import GraphedStep

    step = GraphedStep(lambda x, w: x * w, {"x": torch.zeros(3), "w": torch.zeros(3)})
    for value in (1.0, 2.0):
        out = step.run(x=torch.full((3,), value), w=torch.arange(3.0))
        assert torch.equal(out, torch.arange(3.0) * value)
    assert step.graph is None


def test_integer_decode_path_on_q8_1_activations():
    """With int8 activations the k-quant decode multiplies integer quants with q8_1 activations: close
    to the float path (the activations are rounded to 8 bits per block of 32)."""
    x = torch.randn(1, QH, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    exact = _quantised_layer("q4_k", "q6_k", "triton")(x)
    rounded = _quantised_layer("q4_k", "q6_k", "triton", ActivationMode.INT8)(x)
    assert not torch.equal(exact, rounded)
    assert rel_err(rounded.cpu(), exact.cpu()) <= 2e-2


# ------------------------------------------------------------------------------ expert streaming
def test_streamed_decode_reads_experts_from_cache_slots(tmp_path):
    """Decode on the triton backend through the expert cache's slot table: the logits of every step
    equal the all-resident triton model's (the kernels and their order are the same; only where the
    weights sit differs), with the smallest cache, so slots are reused and differ from expert ids."""
    from hf_models import VOCAB, make_model, save_model
    from test_offload_model import _decode_logits, _minimum_gb

    import moerun

    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    resident = moerun.load(path, dtype=torch.float32, backend="triton", device=DEVICE)
    floor_gb, _ = _minimum_gb(path, torch.float32)
    streamed = moerun.load(
        path, dtype=torch.float32, backend="triton", device=DEVICE, expert_cache_gb=floor_gb
    )
    assert torch.equal(_decode_logits(streamed, ids), _decode_logits(resident, ids))
    # streamed prefill goes expert by expert on the torch backend (one grouped GEMM would need every
    # touched expert in the cache at once): bitwise the resident torch model's
    torch_model = moerun.load(path, dtype=torch.float32, backend="torch", device=DEVICE)
    assert torch.equal(streamed.logits(ids.to(DEVICE)), torch_model.logits(ids.to(DEVICE)))
    offload = streamed.stats()["offload"]["total"]
    assert offload["misses"] > 0 and offload["hits"] + offload["misses"] >= 10 * resident.config.moe.top_k


def test_a_dropped_layer_releases_its_prepared_kernel_state():
    import gc
    import weakref

    from moerun.moe.backends import triton_backend

    layer = _quantised_layer("q8_0", "q8_0", "triton")
    layer(torch.randn(1, QH).to(DEVICE))
    state = weakref.ref(triton_backend._PREPARED[layer.experts])
    gc.collect()  # garbage that earlier tests left is collected before the count is taken
    before = len(triton_backend._PREPARED)
    del layer
    gc.collect()
    assert state() is None  # this layer's state is gone, whatever else the module holds
    assert len(triton_backend._PREPARED) == before - 1
