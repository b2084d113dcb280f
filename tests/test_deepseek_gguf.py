"""DeepSeek-V2 and V3 from llama.cpp's deepseek2 GGUF files, against transformers on the same tiny
random weights (test_deepseek's models): fp32 logits within 1e-4 and greedy tokens equal, for the
files llama.cpp's converter writes now (kv_b split per head into attn_k_b / attn_v_b, the *_mla keys,
expert groups) and the older ones (one attn_kv_b, the heads' widths as key_length / value_length);
softmax or absent gating is DeepSeek-V2, sigmoid V3; YaRN's mscale from yarn_log_multiplier;
quantised experts; experts streamed; `moerun quantize` writes what the converter writes and
`moerun inspect` reads it; what llama.cpp's deepseek2 cannot hold is refused."""

import json
from unittest.mock import patch

import gguf
import numpy as np
import pytest
import torch
from conftest import rel_err
from gguf_from_hf import write_gguf
from hf_models import hf_greedy, hf_logits, save_model
from test_deepseek import CASES, IDS, make_deepseek

import moerun
from moerun.cli.main import main
from moerun.errors import CheckpointError

# llama.cpp's deepseek2 rotates interleaved pairs: the YaRN case of test_deepseek, interleaved
INTERLEAVED = {"v3-plain-q-half-split-rope-yarn": dict(rope_interleave=True)}


def deepseek(case: str, **overrides):
    """test_deepseek's model for `case`, with `overrides` on its config."""
    prefix, extra = CASES[case]
    with patch.dict(CASES, {case: (prefix, {**extra, **INTERLEAVED.get(case, {}), **overrides})}):
        return make_deepseek(case)


@pytest.mark.parametrize(
    ("case", "legacy"),
    [
        ("v3-q-lora-interleaved", False),
        ("v3-plain-q-half-split-rope-yarn", False),
        ("v3-plain-q-half-split-rope-yarn", True),
        ("v2-lite-greedy", False),
        ("v2-lite-greedy", True),
        ("v2-q-lora-group-limited", False),
    ],
    ids=lambda v: {False: "split-kv-b", True: "legacy-kv-b"}.get(v, v),
)
def test_gguf_logits_and_greedy_tokens_match_transformers(case, legacy, tmp_path):
    hf = deepseek(case)
    path = tmp_path / "model.gguf"
    assert write_gguf(hf, path, legacy_mla=legacy) == {}
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("blk.1.attn_kv_b.weight" in names) == legacy
    assert ("blk.1.attn_k_b.weight" in names) == (not legacy)
    model = moerun.load(path, dtype=torch.float32)
    assert model.config.model_type == hf.config.model_type  # told apart by expert_gating_func
    assert model.config.moe_layers == (False, True, True)
    assert rel_err(model.logits(IDS), hf_logits(hf, IDS)) <= 1e-4
    prompt = IDS[1, :7].tolist()
    assert [t.id for t in model.generate(prompt, max_new_tokens=12)] == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize(
    ("case", "experts", "sizes"),
    [
        ("v3-q-lora-interleaved", "q8_0", dict(moe_intermediate_size=32)),
        (
            "v2-lite-greedy",
            "q4_k",
            dict(hidden_size=256, moe_intermediate_size=256, n_routed_experts=4, num_hidden_layers=2),
        ),
    ],
    ids=["v3-q8_0", "v2-q4_k"],
)
def test_quantised_experts_match_transformers_on_the_dequantised_weights(case, experts, sizes, tmp_path):
    hf = deepseek(case, **sizes)
    stored = write_gguf(hf, tmp_path / "q.gguf", experts)
    assert len(stored) == 2 * (hf.config.num_hidden_layers - 1)  # each MoE layer's gate_up and down
    hf.load_state_dict(stored, strict=False)
    model = moerun.load(tmp_path / "q.gguf", dtype=torch.float32)
    assert model.mlps[1].experts.gate_up.format.name == experts  # kept quantised
    assert rel_err(model.logits(IDS), hf_logits(hf, IDS)) <= 1e-4


def test_experts_streamed_through_a_tiny_cache_equal_resident(tmp_path):
    from test_offload_model import _decode_logits, _minimum_gb

    path = tmp_path / "model.gguf"
    write_gguf(deepseek("v3-q-lora-interleaved"), path)
    resident = moerun.load(path, dtype=torch.float32)
    streamed = moerun.load(path, dtype=torch.float32, expert_cache_gb=_minimum_gb(path, torch.float32)[0])
    try:
        assert streamed.expert_cache.num_slots < 2 * 8  # fewer slots than experts: evictions happen
        ids = IDS[:1, :10]
        assert torch.equal(streamed.logits(ids), resident.logits(ids))
        assert torch.equal(_decode_logits(streamed, ids), _decode_logits(resident, ids))
    finally:
        streamed.close()


@pytest.mark.parametrize(
    "case", ["v3-q-lora-interleaved", "v3-plain-q-half-split-rope-yarn", "v2-q-lora-group-limited"]
)
def test_quantize_writes_what_llama_cpp_s_converter_writes(case, tmp_path, capsys):
    """`moerun quantize` in f32: the keys, values and types, tensor names, shapes and bytes the
    converter (tests/gguf_from_hf.py) writes; `moerun inspect` reads the file."""
    hf = deepseek(case)
    src = save_model(hf, tmp_path / "src")
    out = tmp_path / "ours.gguf"
    assert main(["quantize", str(src), str(out), "--experts", "f32", "--rest", "f32"]) == 0
    write_gguf(hf, tmp_path / "reference.gguf")
    ours, reference = gguf.GGUFReader(out), gguf.GGUFReader(tmp_path / "reference.gguf")
    fields = {k: (f.types, f.contents()) for k, f in ours.fields.items() if not k.startswith("GGUF.")}
    expected = {k: (f.types, f.contents()) for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in fields.items() if k in expected} == expected
    assert fields["deepseek2.attention.head_count_kv"][1] == 1
    tensors = {t.name: t for t in ours.tensors}
    assert sorted(tensors) == sorted(t.name for t in reference.tensors)
    for t in reference.tensors:
        assert (tensors[t.name].tensor_type, list(tensors[t.name].shape)) == (t.tensor_type, list(t.shape))
        assert np.array_equal(tensors[t.name].data, t.data), t.name
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["architecture"], d["layers"], d["moe_layers"], d["experts_per_layer"]) == (
        hf.config.model_type,
        3,
        2,
        8,
    )
    assert d["attention"].startswith("MLA")
    assert rel_err(moerun.load(out, dtype=torch.float32).logits(IDS), hf_logits(hf, IDS)) <= 1e-4


def test_quantize_refuses_half_split_rope(tmp_path, capsys):
    """transformers' rope_interleave=False rotates halves; llama.cpp's deepseek2 rotates pairs."""
    src = save_model(make_deepseek("v3-plain-q-half-split-rope-yarn"), tmp_path / "src")
    assert main(["quantize", str(src), str(tmp_path / "m.gguf"), "--experts", "f32"]) == 2
    assert "interleaved_rope is False here but would be True" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_a_renormalising_softmax_file_is_refused(tmp_path):
    """llama.cpp would renormalise DeepSeek-V2's top-k weights; transformers' DeepSeek-V2 never does."""
    path = tmp_path / "norm.gguf"
    write_gguf(deepseek("v2-lite-greedy"), path, extra=lambda w: w.add_expert_weights_norm(True))
    with pytest.raises(CheckpointError, match=r"deepseek2\.expert_weights_norm is true in a softmax-gated"):
        moerun.load(path, dtype=torch.float32)
