"""Whole models loaded from GGUF files (written as llama.cpp's converter writes them) against
transformers on the same weights: fp32 files, quantised experts, and the errors a bad file gets."""

import copy

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf, write_unknown_arch
from hf_models import FAMILIES, VOCAB, hf_greedy, hf_logits, make_model

import moerun
from moerun.loader import CheckpointError
from moerun.moe.layer import StateDictError

# (family, gate format, up format, down format, attention format)
QUANT_CASES = {
    "mixtral-q4_k": ("mixtral", "q4_k", "q4_k", "q4_k", "f32"),
    "qwen2_moe-q4_k": ("qwen2_moe", "q4_k", "q4_k", "q4_k", "f32"),
    "qwen3_moe-q4_k": ("qwen3_moe", "q4_k", "q4_k", "q4_k", "f32"),
    "olmoe-q4_k": ("olmoe", "q4_k", "q4_k", "q4_k", "f32"),
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", "mxfp4", "mxfp4", "f32"),
    "qwen3_moe-q2_k-gate-up-q3_k-down": ("qwen3_moe", "q2_k", "q2_k", "q3_k", "f32"),
    "mixtral-q8_0-experts-and-attention": ("mixtral", "q8_0", "q8_0", "q8_0", "q8_0"),
}
IDS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=list(FAMILIES))
def f32_gguf(request, tmp_path_factory):
    model = make_model(request.param, **GGUF_OVERRIDES[request.param])
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}-f32.gguf"
    assert write_gguf(model, path) == {}
    return model, moerun.load(path, dtype=torch.float32)


def test_f32_logits_match_transformers(f32_gguf):
    hf_model, model = f32_gguf
    ours = model.logits(IDS)
    assert ours.shape == (2, 23, VOCAB)
    assert rel_err(ours, hf_logits(hf_model, IDS)) <= 1e-4


def test_f32_greedy_generation_matches_transformers(f32_gguf):
    hf_model, model = f32_gguf
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    assert [t.id for t in model.generate(prompt, max_new_tokens=16)] == hf_greedy(hf_model, prompt, 16)


@pytest.fixture(scope="module")
def quant_models():
    """One hidden-256 transformers model per family, built on first use."""
    models = {}

    def get(model_type: str):
        if model_type not in models:
            sizes = {**GGUF_OVERRIDES[model_type], **QUANT_SIZES[model_type]}
            models[model_type] = make_model(model_type, hidden_size=256, num_hidden_layers=2, **sizes)
        return models[model_type]

    return get


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantised_experts_match_transformers_on_the_dequantised_weights(case, quant_models, tmp_path):
    model_type, gate, up, down, attention = QUANT_CASES[case]
    hf_model = copy.deepcopy(quant_models(model_type))
    stored = write_gguf(hf_model, tmp_path / "model.gguf", gate, up=up, down=down, attention=attention)
    expected_updates = hf_model.config.num_hidden_layers * (2 if attention == "f32" else 6)
    assert len(stored) == expected_updates  # every quantised tensor went back into the model
    hf_model.load_state_dict(stored, strict=False)
    model = moerun.load(tmp_path / "model.gguf", dtype=torch.float32)
    assert model.mlps[0].experts.gate_up.format.name == gate  # still quantised
    assert rel_err(model.logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_fused_gate_up_experts_load(model_type, tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps: one ffn_gate_up_exps tensor, gate rows then up rows."""
    hf_model = make_model(model_type, **GGUF_OVERRIDES[model_type])
    write_gguf(hf_model, tmp_path / "fused.gguf", fuse_gate_up=True)
    model = moerun.load(tmp_path / "fused.gguf", dtype=torch.float32)
    assert rel_err(model.logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4


def test_unknown_architecture_is_named(tmp_path):
    path = write_unknown_arch(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(CheckpointError, match=r"mamba\.gguf.*'mamba'.*gpt-oss"):
        moerun.load(path, dtype=torch.float32)


def test_missing_expert_tensor_is_named(tmp_path):
    path = tmp_path / "missing.gguf"
    write_gguf(make_model("olmoe"), path, skip={"blk.1.ffn_down_exps.weight"})
    with pytest.raises(StateDictError, match=r"missing layers\.1\.moe\.experts\.down.*blk\.1\.ffn_down_exps"):
        moerun.load(path, dtype=torch.float32)


@pytest.mark.parametrize("experts", ["f32", "q4_k"])
def test_old_per_expert_layout_loads(experts, quant_models, tmp_path):
    """llama.cpp's layout before merged experts (blk.N.ffn_gate.E.weight ...), as older Mixtral GGUFs
    have it: stacked at load, or read expert by expert from the file when streaming."""
    hf_model = copy.deepcopy(quant_models("mixtral"))
    path = tmp_path / "old.gguf"
    stored = write_gguf(hf_model, path, experts, per_expert=True)
    hf_model.load_state_dict(stored, strict=False)
    expected = hf_logits(hf_model, IDS)
    model = moerun.load(path, dtype=torch.float32)
    assert rel_err(model.logits(IDS), expected) <= 1e-4
    from test_offload_model import _minimum_gb

    streamed = moerun.load(path, dtype=torch.float32, expert_cache_gb=_minimum_gb(path, torch.float32)[0])
    store = streamed.expert_cache.store
    assert all(all(store.file_backed(layer).values()) for layer in store.sources)
    assert streamed.expert_cache.num_slots < sum(store.num_experts(layer) for layer in store.sources)
    assert torch.equal(streamed.logits(IDS), model.logits(IDS))


def test_old_per_expert_layout_with_an_expert_missing_is_named(tmp_path):
    path = tmp_path / "old.gguf"
    write_gguf(
        make_model("mixtral", **GGUF_OVERRIDES["mixtral"]),
        path,
        per_expert=True,
        skip={"blk.1.ffn_up.2.weight"},
    )
    with pytest.raises(
        CheckpointError, match=r"blk\.1\.ffn_up\.E\.weight are incomplete: experts \[2\] are missing"
    ):
        moerun.load(path, dtype=torch.float32)


def test_gate_and_up_experts_of_different_formats_are_refused(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_gguf(make_model("olmoe"), path, "q8_0", up="q4_0", down="f32")
    with pytest.raises(
        CheckpointError, match=r"ffn_gate_exps\.weight is Q8_0 but blk\.0\.ffn_up_exps\.weight is Q4_0"
    ):
        moerun.load(path, dtype=torch.float32)
