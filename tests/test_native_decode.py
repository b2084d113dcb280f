"""The native decode step (moerun.decoder.native_step: moerun.cpu.AttentionDecode, and moerun.cpu.moe_route
with the norm fused into the MoE layer's route): one token through a decoder layer in native calls,
against moerun's torch attention and routing (each variant the families use) and, whole models,
against transformers token by token."""

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf
from hf_models import FAMILIES, VOCAB, hf_logits, make_model, save_model
from test_cpu_kernels import random_blocks

import moerun
from moerun import cpu
from moerun.decoder.attention import Attention
from moerun.decoder.config import AttentionSpec, RopeSpec
from moerun.decoder.norm import rms_norm
from moerun.decoder.rope import Rotary
from moerun.moe.routing import RouterError, SoftmaxTopK, TopKSoftmax, route, router_logits
from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import QTensor, get_format

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}")

H = 64
VARIANTS = {
    "plain": dict(),
    "qwen3 head norm": dict(qk_norm="head"),
    "olmoe full norm, clip": dict(qk_norm="full", clip_qkv=0.5),
    "qwen2 biases": dict(bias=True),
    "gpt-oss sinks, window": dict(sinks=True, bias=True, window=3),
    "window of 40": dict(sinks=True, window=40),
    "multi-head": dict(kv_heads=4),
}


def _attention(variant: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    heads, kv, D = 4, variant.get("kv_heads", 2), 16
    spec = AttentionSpec(
        hidden=H,
        heads=heads,
        kv_heads=kv,
        head_dim=D,
        qk_norm=variant.get("qk_norm"),
        clip_qkv=variant.get("clip_qkv"),
        qkv_bias=variant.get("bias", False),
        o_bias=variant.get("bias", False),
        sinks=variant.get("sinks", False),
        rope=RopeSpec(theta=10000.0),
        norm_eps=1e-5,
    )
    t = {k: torch.randn(shape, generator=g) * 0.3 for k, shape in spec.tensor_shapes().items()}
    for k in ("q_norm.weight", "k_norm.weight"):
        if k in t:
            t[k] = 1 + t[k]
    rotary = Rotary(spec.rope, D)
    return spec, t, Attention(spec, t, rotary, variant.get("window")), rotary


def _reference_step(attn, norm, eps, x, cache_k, cache_v, pos, rotary):
    """moerun's torch attention on rms_norm(x): x + out, in fp32."""
    cos_sin = rotary.cos_sin(torch.tensor([pos]), torch.float32)
    return x + attn(rms_norm(x.view(1, 1, -1), norm, eps), cos_sin, cache_k, cache_v, pos).view(-1)


@pytest.mark.parametrize("cap", [9, 75])  # 75: the cache read in tiles of 32 positions, and a part
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_step_matches_the_torch_attention(variant, cap):
    spec, t, attn, rotary = _attention(VARIANTS[variant])
    norm = 1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(9))
    eps = 1e-6
    shape = (1, spec.kv_heads, cap, spec.head_dim)
    ref_k, ref_v = torch.zeros(shape), torch.zeros(shape)
    ours_k, ours_v = torch.zeros(shape), torch.zeros(shape)
    step = attn.native_decode(norm, eps, torch.float32)
    for pos in range(cap):  # a cache filling up, past the sliding window
        x = torch.randn(H, generator=torch.Generator().manual_seed(pos))
        want = _reference_step(attn, norm, eps, x, ref_k, ref_v, pos, rotary)
        cos, sin = (c[0].contiguous() for c in rotary.cos_sin(torch.tensor([pos]), torch.float32))
        ours = x.clone()
        step(ours, ours_k, ours_v, pos, cos, sin)
        assert rel_err(ours, want) <= 1e-5, pos
        assert rel_err(ours_k[:, :, : pos + 1], ref_k[:, :, : pos + 1]) <= 1e-5
        assert rel_err(ours_v[:, :, : pos + 1], ref_v[:, :, : pos + 1]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cache_holds_the_rounded_keys_and_values(dtype):
    spec, t, attn, rotary = _attention(VARIANTS["qwen3 head norm"])
    norm = torch.ones(H)
    cap = 5
    shape = (1, spec.kv_heads, cap, spec.head_dim)
    k16, v16 = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k32, v32 = torch.zeros(shape), torch.zeros(shape)
    step16 = attn.native_decode(norm, 1e-6, dtype)
    step32 = attn.native_decode(norm, 1e-6, torch.float32)
    for pos in range(cap):
        x = torch.randn(H, generator=torch.Generator().manual_seed(pos))
        cos, sin = (c[0].contiguous() for c in rotary.cos_sin(torch.tensor([pos]), torch.float32))
        a, b = x.clone(), x.clone()
        # the fp32 run on a cache holding what the half cache holds: the same keys, rounded
        k32[:, :, :pos], v32[:, :, :pos] = k16[:, :, :pos].float(), v16[:, :, :pos].float()
        step16(a, k16, v16, pos, cos, sin)
        step32(b, k32, v32, pos, cos, sin)
        assert torch.equal(k16[:, :, pos], k32[:, :, pos].to(dtype))  # torch's rounding, to nearest even
        assert torch.equal(v16[:, :, pos], v32[:, :, pos].to(dtype))
        # the one difference left: the new key and value read back rounded (relative 2^-8 or 2^-11)
        assert rel_err(a, b) <= 2e-2


NEWER_FORMATS = ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s"]
NEWER_FORMATS += ["iq1_s", "iq1_m", "tq1_0", "tq2_0"]


@pytest.mark.parametrize("fmt_name", NEWER_FORMATS)
def test_attention_step_reads_the_newer_block_formats(fmt_name):
    """q, k, v, o in a block format against the same weights dequantised to f32: exact mode takes the
    same values times the same activations, so the blocks change only the order of fp32 sums."""
    hidden, heads, kv, D = 256, 4, 2, 64
    shape = cpu.AttentionShape(hidden, heads, kv, D, eps=1e-6)
    sizes = {"q": (heads * D, hidden), "k": (kv * D, hidden), "v": (kv * D, hidden), "o": (hidden, heads * D)}
    blocks = {name: random_blocks(fmt_name, *size, seed) for seed, (name, size) in enumerate(sizes.items())}
    quantised = {name: (fmt_name, data, None) for name, data in blocks.items()}
    fmt = get_format(fmt_name)
    dense = {name: ("f32", dequantize_bytes(fmt, data), None) for name, data in blocks.items()}
    norm = {"norm": torch.ones(hidden)}
    steps = [cpu.AttentionDecode(shape, lin, norm, torch.float32) for lin in (quantised, dense)]
    caches = [(torch.zeros(1, kv, 4, D), torch.zeros(1, kv, 4, D)) for _ in steps]
    cos, sin = torch.ones(D // 2), torch.zeros(D // 2)  # position 0's rotation, at every position
    for pos in range(4):
        # a small x (the norm scales it up): x + out rounds off little of the small out
        x = torch.randn(hidden, generator=torch.Generator().manual_seed(pos)) * 1e-3
        added = []
        for step, (cache_k, cache_v) in zip(steps, caches, strict=True):
            y = x.clone()
            step(y, cache_k, cache_v, pos, cos, sin)
            added.append(y - x)
        assert added[1].abs().max() > 0 and rel_err(added[0], added[1]) <= 1e-5, pos


def test_attention_step_refuses_a_cache_of_the_wrong_shape():
    spec, t, attn, rotary = _attention(VARIANTS["plain"])
    step = attn.native_decode(torch.ones(H), 1e-6, torch.float32)
    cos, sin = torch.ones(spec.head_dim // 2), torch.zeros(spec.head_dim // 2)
    bad = torch.zeros(1, spec.kv_heads + 1, 4, spec.head_dim)
    with pytest.raises(ValueError, match="cache"):
        step(torch.zeros(H), bad, bad, 0, cos, sin)


@pytest.mark.parametrize(
    "rule",
    [SoftmaxTopK(3, True), SoftmaxTopK(3, False), TopKSoftmax(2)],
    ids=["renorm", "softmax", "topk-first"],
)
def test_route_matches_the_torch_routing(rule):
    g = torch.Generator().manual_seed(2)
    E = 16
    w, b, norm = torch.randn(E, H, generator=g), torch.randn(E, generator=g), 1 + torch.randn(H, generator=g)
    kind = "softmax_topk" if isinstance(rule, SoftmaxTopK) else "topk_softmax"
    renorm = getattr(rule, "renormalize", False)
    for seed in range(20):
        x = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 3
        h, logits, ids, weights = cpu.moe_route(x, norm, 1e-6, w, b, kind, rule.k, renorm)
        want_h = rms_norm(x, norm, 1e-6)
        want_logits = router_logits(want_h[None], w, b)[0]
        want_w, want_ids = route(rule, want_logits[None])
        assert rel_err(h, want_h) <= 1e-6 and rel_err(logits, want_logits) <= 1e-5
        assert ids.tolist() == want_ids[0].tolist()
        assert rel_err(weights, want_w[0]) <= 1e-5


def test_a_non_finite_router_logit_names_the_layer(tmp_path):
    hf = make_model("qwen3_moe")
    model = moerun.load(save_model(hf, tmp_path / "m"), dtype=torch.float32)
    layer = model.mlps[1]
    layer.tensors["router.weight"][3, 0] = float("nan")
    cache = model.new_cache(1, 4)
    with pytest.raises(RouterError, match="layers.1.moe"):
        model.forward(torch.tensor([[5]]), cache)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    hf = make_model(request.param)
    return hf, save_model(hf, tmp_path_factory.mktemp(request.param) / "m")


def _decoded(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [T, V]: the first `prompt` positions prefilled at once, then one token per step."""
    cache = model.new_cache(1, ids.shape[1])
    with torch.inference_mode():
        out = [model.hidden_logits(model.forward(ids[:, :prompt], cache))[0]]
        out += [
            model.hidden_logits(model.forward(ids[:, t : t + 1], cache))[0]
            for t in range(prompt, ids.shape[1])
        ]
    return torch.cat(out)


def test_fp32_decode_matches_transformers_token_by_token(family_checkpoint):
    hf, path = family_checkpoint
    model = moerun.load(path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
    ours = _decoded(model, ids, prompt=3)
    assert model._decode_step.attention_steps is not None  # the decode steps ran natively
    assert rel_err(ours, hf_logits(hf, ids)[0]) <= 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def quantised_checkpoint(request, tmp_path_factory):
    """A hidden-256 model of each family written as GGUF (q4_k experts, mxfp4 for gpt-oss; q8_0
    attention), and transformers' model holding the weights the file holds (dequantised)."""
    family = request.param
    hf = make_model(
        family, hidden_size=256, num_hidden_layers=2, **GGUF_OVERRIDES[family], **QUANT_SIZES[family]
    )
    path = tmp_path_factory.mktemp(family) / "m.gguf"
    experts = "mxfp4" if family == "gpt_oss" else "q4_k"
    hf.load_state_dict(write_gguf(hf, path, experts, attention="q8_0"), strict=False)
    return hf, path


def test_quantised_exact_decode_matches_transformers_on_the_dequantised_weights(quantised_checkpoint):
    hf, path = quantised_checkpoint
    model = moerun.load(path, dtype=torch.float32)  # fp32: exact activations
    assert isinstance(model.attentions[0].t["q.weight"], QTensor)  # kept as stored
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    assert rel_err(_decoded(model, ids, 2), hf_logits(hf, ids)[0]) <= 1e-4


def test_int8_decode_stays_as_close_to_the_reference_as_int8_prefill(quantised_checkpoint):
    """int8 activations (the bf16 default) in the decode step: no further from the reference than
    the same model's prefill, which runs the same int8 dot products through other code."""
    hf, path = quantised_checkpoint
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    model = moerun.load(path, dtype=torch.float32, int8_activations=True)
    ref = hf_logits(hf, ids)[0]
    decoded, prefilled = _decoded(model, ids, prompt=1), model.logits(ids)[0]
    assert rel_err(decoded, ref) <= 2 * rel_err(prefilled, ref) + 1e-3
    assert rel_err(decoded, ref) > 1e-5  # int8 rounding is there: not the exact path


def test_route_of_a_batch_is_each_tokens_route_alone():
    g = torch.Generator().manual_seed(3)
    E, T = 16, 9
    w, b = torch.randn(E, H, generator=g), torch.randn(E, generator=g)
    x = torch.randn(T, H, generator=g)
    _, logits, ids, weights = cpu.moe_route(x, None, 0.0, w, b, "softmax_topk", 4, True)
    for t in range(T):
        _, lt, it, wt = cpu.moe_route(x[t].contiguous(), None, 0.0, w, b, "softmax_topk", 4, True)
        assert torch.equal(logits[t], lt) and torch.equal(ids[t], it) and torch.equal(weights[t], wt)
    assert rel_err(logits, torch.nn.functional.linear(x, w, b)) <= 1e-5
