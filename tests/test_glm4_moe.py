"""GLM-4 MoE (glm4_moe; llama.cpp's glm4moe) as whole models against transformers on the same weights:
partial rotary with q/k norm and q/k/v biases, a leading dense layer, sigmoid routing with the
score-correction bias, expert groups, routed scaling and shared experts; from HF checkpoints (both
expert layouts), from GGUF files as llama.cpp's converter writes them (next-token-prediction blocks
included, quantised experts), written by `moerun quantize`, read by `moerun inspect`; with experts
streamed, on the native CPU kernels and in a batch."""

import copy
import json

import gguf
import numpy as np
import pytest
import torch
from conftest import rel_err
from gguf_from_hf import write_gguf
from hf_models import hf_greedy, hf_logits, save_model

import moerun
from moerun.checkpoint.describe import describe
from moerun.cli.main import main
from moerun.errors import ConfigError

VOCAB = 96
IDS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,  # the dense layer's MLP
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    use_qk_norm=True,
    attention_bias=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    tie_word_embeddings=False,
    pad_token_id=None,
)
GGUF_CONFIG = dict(n_group=1, topk_group=1)  # llama.cpp's glm4moe routes without expert groups
# k-quants want rows of 256
QUANT_CONFIG = dict(
    GGUF_CONFIG, hidden_size=256, moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2
)


def make_glm(seed: int = 0, **overrides):
    """A tiny transformers Glm4MoeForCausalLM in fp32, every tensor random (the score-correction
    bias, a buffer, too)."""
    import transformers

    config = transformers.Glm4MoeConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = transformers.Glm4MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def hf_glm():
    return make_glm()


@pytest.fixture(scope="module")
def checkpoint(hf_glm, tmp_path_factory):
    return save_model(hf_glm, tmp_path_factory.mktemp("glm") / "fused", original_format=False)


@pytest.fixture(scope="module")
def quant_glm():
    return make_glm(num_hidden_layers=2, **QUANT_CONFIG)


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert-names", "fused-names"])
@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["native", "torch"])
def test_fp32_logits_match_transformers(hf_glm, tmp_path, original_format, backend):
    path = save_model(hf_glm, tmp_path / "ckpt", original_format)
    model = moerun.load(path, dtype=torch.float32, backend=backend)
    assert model.config.attention.rope.rotary_dims == 8  # half of each head of 16
    assert model.config.moe_layers == (False, True, True)
    ours = model.logits(IDS)
    assert ours.shape == (2, 23, VOCAB)
    assert rel_err(ours, hf_logits(hf_glm, IDS)) <= 1e-4


def test_greedy_generation_matches_transformers(hf_glm, checkpoint):
    prompt = IDS[0, :9].tolist()
    ours = [t.id for t in moerun.load(checkpoint, dtype=torch.float32).generate(prompt, max_new_tokens=24)]
    assert ours == hf_greedy(hf_glm, prompt, 24)


def test_other_variants_match_transformers(tmp_path):
    """No q/k norm or biases, no renormalisation, a quarter of each head rotated with YaRN, one
    shared expert, two dense layers, all groups kept."""
    hf_model = make_glm(
        seed=1,
        num_hidden_layers=4,
        use_qk_norm=False,
        attention_bias=False,
        norm_topk_prob=False,
        n_shared_experts=1,
        first_k_dense_replace=2,
        n_group=2,
        topk_group=2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.25,
        ),
    )
    model = moerun.load(save_model(hf_model, tmp_path / "variant"), dtype=torch.float32)
    assert model.config.attention.rope.rotary_dims == 4
    assert rel_err(model.logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4


def test_an_odd_number_of_rotary_dims_is_refused(hf_glm, tmp_path):
    path = save_model(hf_glm, tmp_path / "odd")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.3125  # 5 of 16 dims
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json.*partial_rotary_factor=0.3125 .* rotates 5 dims"):
        moerun.load(path, dtype=torch.float32)


def test_experts_streamed_through_a_tiny_cache_equal_resident(checkpoint):
    from test_offload_model import _decode_logits, _minimum_gb

    resident = moerun.load(checkpoint, dtype=torch.float32)
    streamed = moerun.load(
        checkpoint, dtype=torch.float32, expert_cache_gb=_minimum_gb(checkpoint, torch.float32)[0]
    )
    try:
        assert streamed.expert_cache.num_slots < 2 * 8  # fewer slots than experts: evictions happen
        ids = IDS[:1, :12]
        assert torch.equal(streamed.logits(ids), resident.logits(ids))
        assert torch.equal(_decode_logits(streamed, ids), _decode_logits(resident, ids))
        assert streamed.stats()["offload"]["total"]["misses"] > 0
    finally:
        streamed.close()


def test_a_batch_gives_each_prompt_its_tokens_alone(checkpoint):
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompts = [IDS[0, :3].tolist(), IDS[1, :11].tolist()]
    batched = model.generate(prompts, [10, 6])
    assert [[t.id for t in out] for out in batched] == [
        [t.id for t in model.generate(p, n)] for p, n in zip(prompts, [10, 6], strict=True)
    ]


def test_gguf_with_next_token_prediction_blocks_matches_transformers(hf_glm, tmp_path):
    """As llama.cpp's converter writes a GLM-4.5 checkpoint: its multi-token-prediction layer as
    the last block, counted in block_count and skipped by nextn_predict_layers."""
    hf_model = make_glm(**GGUF_CONFIG)
    path = tmp_path / "glm.gguf"
    assert write_gguf(hf_model, path, nextn_blocks=1) == {}
    assert "blk.3.nextn.eh_proj.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    model = moerun.load(path, dtype=torch.float32)
    assert model.config.num_layers == 3 and model.config.moe_layers == (False, True, True)
    assert rel_err(model.logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4
    prompt = IDS[1, :7].tolist()
    assert [t.id for t in model.generate(prompt, max_new_tokens=16)] == hf_greedy(hf_model, prompt, 16)


@pytest.mark.parametrize("experts", ["q4_k", "q8_0"])
def test_gguf_quantised_experts_match_transformers_on_the_dequantised_weights(quant_glm, experts, tmp_path):
    hf_model = copy.deepcopy(quant_glm)
    stored = write_gguf(hf_model, tmp_path / "q.gguf", experts)
    assert len(stored) == 2  # the one MoE layer's gate_up and down, dequantised
    hf_model.load_state_dict(stored, strict=False)
    model = moerun.load(tmp_path / "q.gguf", dtype=torch.float32)
    assert model.mlps[1].experts.gate_up.format.name == experts  # kept quantised
    assert rel_err(model.logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4


def test_quantize_writes_what_llama_cpp_s_converter_writes(tmp_path):
    """`moerun quantize` in f32: the keys, values and types, tensor names, shapes and bytes the
    converter (tests/gguf_from_hf.py) writes; `moerun inspect` reads the file."""
    hf_model = make_glm(**GGUF_CONFIG)
    src = save_model(hf_model, tmp_path / "src")
    out = tmp_path / "ours.gguf"
    assert main(["quantize", str(src), str(out), "--experts", "f32", "--rest", "f32"]) == 0
    write_gguf(hf_model, tmp_path / "reference.gguf")
    ours, reference = gguf.GGUFReader(out), gguf.GGUFReader(tmp_path / "reference.gguf")
    fields = {k: (f.types, f.contents()) for k, f in ours.fields.items() if not k.startswith("GGUF.")}
    expected = {k: (f.types, f.contents()) for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in fields.items() if k in expected} == expected
    assert fields["glm4moe.rope.dimension_count"][1] == 8
    tensors = {t.name: t for t in ours.tensors}
    assert sorted(tensors) == sorted(t.name for t in reference.tensors)
    for t in reference.tensors:
        assert (tensors[t.name].tensor_type, list(tensors[t.name].shape)) == (t.tensor_type, list(t.shape))
        assert np.array_equal(tensors[t.name].data, t.data), t.name
    d = describe(out)
    assert (d["architecture"], d["layers"], d["moe_layers"], d["experts_per_layer"], d["top_k"]) == (
        "glm4_moe",
        3,
        2,
        8,
        3,
    )
    assert rel_err(moerun.load(out, dtype=torch.float32).logits(IDS), hf_logits(hf_model, IDS)) <= 1e-4


def test_quantize_refuses_expert_groups_the_arch_cannot_hold(checkpoint, tmp_path, capsys):
    assert main(["quantize", str(checkpoint), str(tmp_path / "m.gguf"), "--experts", "q8_0"]) == 2
    assert "n_group is 4 here but would be 1" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_a_checkpoint_with_its_next_token_prediction_layer_loads(hf_glm, tmp_path):
    """GLM-4.5's safetensors carry `num_nextn_predict_layers` more layers after the decoder's:
    a decoder layer's tensors plus eh_proj, enorm, hnorm and shared_head.norm."""
    from safetensors.torch import load_file, save_file

    path = save_model(hf_glm, tmp_path / "mtp", original_format=False)
    tensors = load_file(path / "model.safetensors")
    H = TINY["hidden_size"]
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("layers.2.", "layers.3.")] = tensors[name].clone()
    extra = {"eh_proj.weight": (H, 2 * H), "enorm.weight": (H,), "hnorm.weight": (H,)}
    for name, shape in {**extra, "shared_head.norm.weight": (H,)}.items():
        tensors[f"model.layers.3.{name}"] = torch.ones(shape)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = moerun.load(path, dtype=torch.float32)
    assert rel_err(model.logits(IDS), hf_logits(hf_glm, IDS)) <= 1e-4
