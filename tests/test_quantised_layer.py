"""Quantised experts in the layer: the output equals the dense layer run on the dequantised
weights, for prefill and decode, for every format, mixed per projection."""

import dataclasses
import functools

import pytest
import torch
from conftest import rel_err

from moerun.moe.layer import MoELayer, MoESpec, layer_run
from moerun.moe.routing import SoftmaxTopK
from moerun.quant.cache import DequantCache
from moerun.quant.dequant import dequantize
from moerun.quant.quantize import quantize

QUANTISED = ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "mxfp4"]
H, I, E, K = 256, 256, 4, 2  # k-quant blocks hold 256 elements: H and I are whole blocks


def _dense_tensors(spec: MoESpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen) * (1.0 if name.startswith("router") else shape[-1] ** -0.5)
        for name, shape in spec.tensor_shapes().items()
    }


SPEC = MoESpec(hidden=H, intermediate=I, num_experts=E, routing=SoftmaxTopK(k=K, renormalize=True))


@functools.cache
def _quantised(projection: str, fmt: str):
    return quantize(_dense_tensors(SPEC)[projection], fmt)


def _layers(gate_up_format: str, down_format: str, cache: DequantCache | None = None):
    """(quantised layer, dense fp32 layer on the dequantised weights)."""
    spec = SPEC
    tensors = _dense_tensors(spec)
    tensors["experts.gate_up"] = _quantised("experts.gate_up", gate_up_format)
    tensors["experts.down"] = _quantised("experts.down", down_format)
    run = dataclasses.replace(layer_run(tensors), dequant_cache=cache)
    quantised = MoELayer.from_tensors(spec, tensors, run=run)
    dense = {k: dequantize(v) if k.startswith("experts.") else v for k, v in tensors.items()}
    return quantised, MoELayer.from_tensors(spec, dense)


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("fmt", QUANTISED)
def test_quantised_layer_equals_dense_on_dequantised(fmt, tokens):
    quantised, dense = _layers(fmt, fmt)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    assert rel_err(quantised(x), dense(x)) <= 1e-5


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize(("gate_up", "down"), [("q2_k", "q3_k"), ("q4_k", "q6_k"), ("mxfp4", "q8_0")])
def test_mixed_formats_per_projection(gate_up, down, tokens):
    quantised, dense = _layers(gate_up, down)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7))
    assert rel_err(quantised(x), dense(x)) <= 1e-5


def test_prefill_through_the_dequant_cache():
    cache = DequantCache(budget_bytes=2**30)
    quantised, dense = _layers("q4_k", "q6_k", cache)
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(3))
    first = quantised(x)
    assert cache.stats.misses > 0 and cache.stats.hits == 0
    again = quantised(x)
    assert cache.stats.hits == cache.stats.misses  # the same experts, now all hits
    assert torch.equal(first, again)
    assert rel_err(first, dense(x)) <= 1e-5


def test_bf16_compute_on_quantised_experts():
    spec = SPEC
    tensors = _dense_tensors(spec)
    tensors["experts.gate_up"] = _quantised("experts.gate_up", "q4_k")
    tensors["experts.down"] = _quantised("experts.down", "q4_k")
    layer = MoELayer.from_tensors(spec, tensors, run=layer_run(tensors, torch.bfloat16))
    reference = MoELayer.from_tensors(
        spec, {k: dequantize(v) if k.startswith("experts.") else v for k, v in tensors.items()}
    )
    for tokens in (1, 19):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        out = layer(x.bfloat16())
        assert out.dtype == torch.bfloat16
        assert rel_err(out, reference(x.bfloat16().float())) <= 2e-2
