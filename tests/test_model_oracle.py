"""Whole models loaded from saved Hugging Face checkpoints against transformers on the same weights."""

import pytest
import torch
from conftest import rel_err
from hf_models import (
    FAMILIES,
    VOCAB,
    hf_greedy,
    hf_logits,
    load_gpt_oss_mxfp4_with_transformers,
    make_model,
    save_gpt_oss_mxfp4,
    save_model,
)

import moerun


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    model = make_model(request.param)
    return request.param, model, tmp_path_factory.mktemp(request.param)


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert-names", "fused-names"])
def test_fp32_logits_match_transformers(family_model, original_format):
    model_type, hf_model, tmp = family_model
    path = save_model(hf_model, tmp / f"ckpt-{original_format}", original_format)
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
    ours = moerun.load(path, dtype=torch.float32).logits(ids)
    assert ours.shape == (2, 23, VOCAB) and ours.dtype == torch.float32
    assert rel_err(ours, hf_logits(hf_model, ids)) <= 1e-4


def test_chunked_prefill_matches_one_chunk(family_model):
    model_type, hf_model, tmp = family_model
    path = save_model(hf_model, tmp / "chunked")
    model = moerun.load(path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    whole = model.logits(ids)
    model.prefill_chunk = 7
    assert rel_err(model.logits(ids), whole) <= 1e-5
    assert rel_err(whole, hf_logits(hf_model, ids)) <= 1e-4


def test_greedy_generation_matches_transformers(family_model):
    model_type, hf_model, tmp = family_model
    path = save_model(hf_model, tmp / "generate")
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = [t.id for t in moerun.load(path, dtype=torch.float32).generate(prompt, max_new_tokens=32)]
    assert ours == hf_greedy(hf_model, prompt, 32)


def test_bf16_load_stays_within_bf16_error(family_model):
    """bf16 against fp32 transformers: the median per-token error (near-tie routing flips make a
    few tokens far off in any bf16 run) no larger than transformers' own bf16 run on the same weights."""
    model_type, hf_model, tmp = family_model
    path = save_model(hf_model, tmp / "bf16")
    ids = torch.randint(0, VOCAB, (6, 23), generator=torch.Generator().manual_seed(6))
    reference = hf_logits(hf_model, ids)
    ours = moerun.load(path, dtype=torch.bfloat16).logits(ids)
    hf_bf16 = hf_logits(make_model(model_type).to(torch.bfloat16), ids)
    assert ours.dtype == torch.float32

    def median_token_error(logits):
        return ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).median().item()

    assert median_token_error(ours) <= min(1.25 * median_token_error(hf_bf16), 5e-2)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    hf_model = make_model("qwen2_moe")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    assert rel_err(moerun.load(tmp_path, dtype=torch.float32).logits(ids), hf_logits(hf_model, ids)) <= 1e-4


def test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantised(tmp_path):
    hf_model = make_model("gpt_oss", hidden_size=64, intermediate_size=32)
    path = save_gpt_oss_mxfp4(hf_model, tmp_path / "mxfp4")
    model = moerun.load(path, dtype=torch.float32)
    assert model.mlps[0].experts.gate_up.format.name == "mxfp4_gpt_oss"  # kept quantised
    ids = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(8))
    reference = hf_logits(load_gpt_oss_mxfp4_with_transformers(path), ids)
    assert rel_err(model.logits(ids), reference) <= 1e-4
    assert rel_err(hf_logits(hf_model, ids), reference) > 1e-2  # the quantisation is real


def test_tied_embeddings(tmp_path):
    hf_model = make_model("qwen3_moe", tie_word_embeddings=True)
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    save_model(hf_model, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(9))
    assert rel_err(moerun.load(tmp_path, dtype=torch.float32).logits(ids), hf_logits(hf_model, ids)) <= 1e-4


def test_seeded_sampling_is_reproducible(tmp_path):
    """Sampling: the same seed gives the same tokens; a different seed, different ones."""
    hf_model = make_model("olmoe")
    model = moerun.load(save_model(hf_model, tmp_path), dtype=torch.float32)
    prompt = [5, 9, 2]

    def sample(seed):
        return [t.id for t in model.generate(prompt, 24, temperature=1.5, top_k=40, seed=seed)]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_bad_router_logits_name_the_first_bad_layer_after_one_read_back(tmp_path):
    """The model reads every layer's router check back once per pass (no host sync per layer); a
    non-finite logit still gets check_logits' message, for the first layer that had one."""
    from moerun.moe.routing import RouterError

    model = moerun.load(save_model(make_model("olmoe"), tmp_path / "olmoe"), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    model.mlps[2].tensors["router.weight"][1, 0] = float("inf")
    with pytest.raises(RouterError, match=r"layer 'layers\.2\.moe'.* 0 NaN and 6 inf"):
        model.logits(ids)
    model.mlps[1].tensors["router.weight"][0, 0] = float("nan")
    with pytest.raises(RouterError, match=r"layer 'layers\.1\.moe'.*6 NaN"):
        model.logits(ids)
    # a layer called alone (no pass collecting checks) still refuses the bad logits itself
    with pytest.raises(RouterError, match=r"layer 'layers\.1\.moe'"):
        model.mlps[1](torch.randn(2, model.config.moe.hidden))
