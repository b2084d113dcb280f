"""scripts/compare_llama_cpp.py: the YaRN rounding switch it compares with (against transformers, which
has both roundings), and, when llama-cpp-python is installed, its views on a small gpt-oss file that
llama.cpp quantised: with llama.cpp's rounding moerun's RoPE is llama.cpp's, and each block fed
llama.cpp's input gives llama.cpp's output."""

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, write_gguf
from hf_models import VOCAB, hf_logits, make_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import compare_llama_cpp as compare  # noqa: E402
from make_peer_gguf import GPT_OSS_20B, quantize, write_f16_gguf  # noqa: E402

# past where the two roundings' rotations part by more than fp32 noise (head_dim 8: the correction
# range is [1.01, 2.18] unrounded and [1, 3] rounded, so frequency 2 of 4 differs)
IDS = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))


def _with_truncate(hf_model, truncate: bool):
    """transformers' model with its YaRN range rounded (`truncate`) or not, its rotary recomputed."""
    model = copy.deepcopy(hf_model)
    model.config.rope_parameters = {**model.config.rope_parameters, "truncate": truncate}
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model


def test_llama_cpp_rounding_is_transformers_truncate(tmp_path):
    hf_model = make_model("gpt_oss", **GGUF_OVERRIDES["gpt_oss"])
    assert hf_model.config.rope_parameters["truncate"] is False  # gpt-oss's own
    path = tmp_path / "gpt-oss.gguf"
    write_gguf(hf_model, path)
    unrounded = hf_logits(_with_truncate(hf_model, False), IDS)
    rounded = hf_logits(_with_truncate(hf_model, True), IDS)
    assert rel_err(rounded, unrounded) > 1e-3  # the switch matters at these positions
    own = compare.moerun_fp32(path, int8=False, rounded=False)
    assert not own.config.attention.rope.truncate
    assert rel_err(own.logits(IDS), unrounded) <= 1e-4
    llama_like = compare.moerun_fp32(path, int8=False, rounded=True)
    assert rel_err(llama_like.logits(IDS), rounded) <= 1e-4


SMALL_GPT_OSS = dataclasses.replace(
    GPT_OSS_20B,
    hidden=128,
    expert_intermediate=64,
    heads=4,
    kv_heads=2,
    head_dim=64,
    experts=8,
    layers=2,
    vocab=300,
)


@pytest.mark.slow
def test_against_llama_cpp_on_a_small_gpt_oss_file(tmp_path):
    """Positions past the sliding window (128); MXFP4 experts, q8_0 elsewhere, as llama.cpp quantises."""
    pytest.importorskip("llama_cpp")
    path = tmp_path / "gpt-oss.mxfp4.gguf"
    quantize(write_f16_gguf(tmp_path / "gpt-oss.f16.gguf", SMALL_GPT_OSS), path, "mxfp4", threads=1)
    T = 200
    ids = torch.randint(0, SMALL_GPT_OSS.vocab, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    reference, tensors = compare.llama_cpp_run(path, ids, threads=1)
    assert reference.shape == (T, SMALL_GPT_OSS.vocab)
    like = compare.moerun_fp32(path, int8=True, rounded=True)
    own = compare.moerun_fp32(path, int8=True, rounded=False)
    cos_sin = {m: m.rotary.cos_sin(torch.arange(T), torch.float32) for m in (like, own)}
    with torch.inference_mode():
        for i, (attn, moe) in enumerate(zip(like.attentions, like.mlps, strict=True)):
            x = compare._positions_first(tensors[f"attn_norm-{i}"])[None]
            Q = compare._positions_first(tensors[f"Qcur-{i}"])  # [T, heads, D]
            q = attn._qkv(x, cos_sin[like])[0][0].transpose(0, 1)
            q_own = own.attentions[i]._qkv(x, cos_sin[own])[0][0].transpose(0, 1)
            assert rel_err(q, Q) <= 1e-4
            assert rel_err(q_own[0], Q[0]) <= 1e-4 and rel_err(q_own[-8:], Q[-8:]) > 1e-2  # not rotated at 0
            # attention itself (sinks, the window) on llama.cpp's q, k, v: up to its F16 KV cache
            K, V = (
                compare._positions_first(tensors[f"{n}-{i}"]).transpose(0, 1)[None] for n in ("Kcur", "Vcur")
            )
            cache = like.new_cache(1, T)
            out = attn._cached(Q.transpose(0, 1)[None], K, V, cache.keys[i], cache.values[i], 0)
            assert (
                rel_err(
                    out[0].transpose(0, 1).reshape(T, -1), compare._positions_first(tensors[f"kqv_out-{i}"])
                )
                < 5e-3
            )
            # the MoE block (router, softmax over the top-k, clamped SwiGLU, MXFP4, biases), int8 as llama.cpp
            h = compare._positions_first(tensors[f"attn_post_norm-{i}"])
            same, _ = compare._same_experts(moe, h, compare._positions_first(tensors[f"ffn_moe_topk-{i}"]))
            assert same.float().mean() >= 0.95
            rel = compare._rel_by_position(
                moe(h[None])[0], compare._positions_first(tensors[f"ffn_moe_out-{i}"])
            )
            assert rel[same].median() <= 1e-5 and rel[same].max() <= 1e-2
