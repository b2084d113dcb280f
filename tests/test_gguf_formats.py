"""GGUF files in each weight format moerun reads, against transformers on the values the file holds
(decoded by the gguf package's numpy dequantisers, put back into the transformers model): experts
in one format per file; five families; one file mixing formats tensor by tensor, resident, with its
experts streamed through the expert cache, and under expert parallelism. Formats moerun does not
write (the i-quants made with an importance matrix) are stored as random valid blocks
(`gguf_from_hf.random_blocks`). Each case runs on the torch backend and on the native CPU kernels."""

import copy
import functools

import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf
from hf_models import VOCAB, hf_logits, make_model

import moerun
from moerun.quant.quantize import WRITABLE

# the formats added with the i-quants (older ones: test_gguf_model, test_quantize_cli)
NEW_FORMATS = [
    *("q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"),  # moerun writes these
    *("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"),  # random blocks
]
BACKENDS = ["torch", "cpu"]
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))


@functools.cache
def _hf_model(model_type: str):
    if model_type == "deepseek_v2":  # MLA, a dense first layer, shared experts
        from test_deepseek_gguf import deepseek

        return deepseek(
            "v2-lite-greedy",
            hidden_size=256,
            moe_intermediate_size=256,
            n_routed_experts=4,
            num_hidden_layers=2,
        )
    sizes = {**GGUF_OVERRIDES[model_type], **QUANT_SIZES[model_type]}
    return make_model(model_type, hidden_size=256, num_hidden_layers=2, **sizes)


def hf_model(model_type: str):
    """A hidden-256 model (rows of whole 256-element blocks), 2 layers, 4 experts: a fresh copy."""
    return copy.deepcopy(_hf_model(model_type))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(model_type, formats...) -> (GGUF path, transformers' logits on the stored values), made once."""
    made = {}

    def get(model_type: str, experts: str, down: str | None = None, per_tensor: dict | None = None):
        key = (model_type, experts, down, tuple(sorted((per_tensor or {}).items())))
        if key not in made:
            model = hf_model(model_type)
            path = tmp_path_factory.mktemp("formats") / f"{model_type}-{experts}-{down}.gguf"
            stored = write_gguf(model, path, experts, down=down, per_tensor=per_tensor)
            model.load_state_dict(stored, strict=False)
            made[key] = path, hf_logits(model, IDS), len(stored)
        return made[key]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    # the formats moerun writes are also run from `moerun quantize`'s files (test_quantize_cli)
    "fmt",
    [pytest.param(f, marks=pytest.mark.slow) if f in WRITABLE else f for f in NEW_FORMATS],
)
def test_experts_in_each_format_match_transformers(fmt, backend, written):
    path, expected, updated = written("qwen3_moe", fmt)
    assert updated == 2 * 2  # each layer's gate_up and down went back into the transformers model
    model = moerun.load(path, dtype=torch.float32, backend=backend)
    assert model.mlps[1].experts.gate_up.format.name == fmt  # kept in its format, not dequantised
    assert rel_err(model.logits(IDS), expected) <= 1e-4


# family: (gate/up, down)
FAMILY_CASES = {
    "mixtral": ("iq3_s", "q5_1"),
    "olmoe": ("iq2_s", "iq4_nl"),
    "qwen2_moe": ("iq2_xs", "q4_1"),
    "gpt_oss": ("iq1_s", "tq1_0"),
    "deepseek_v2": ("iq3_xxs", "iq4_xs"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_other_families_with_new_formats_match_transformers(model_type, backend, written):
    gate_up, down = FAMILY_CASES[model_type]
    path, expected, _ = written(model_type, gate_up, down)
    model = moerun.load(path, dtype=torch.float32, backend=backend)
    experts = next(m for m in model.mlps if hasattr(m, "experts")).experts
    assert (experts.gate_up.format.name, experts.down.format.name) == (gate_up, down)
    assert rel_err(model.logits(IDS), expected) <= 1e-4


# One file, formats chosen tensor by tensor as llama.cpp's mixes choose them: i-quant experts, k-quant
# attention, q6_k output, q5_0 where rows of 64 (attn_output) are not whole 256-element blocks.
MIXED = {
    "blk.0.ffn_gate_exps.weight": "iq2_xxs",
    "blk.0.ffn_up_exps.weight": "iq2_xxs",
    "blk.0.ffn_down_exps.weight": "iq3_xxs",
    "blk.1.ffn_gate_exps.weight": "tq2_0",
    "blk.1.ffn_up_exps.weight": "tq2_0",
    "blk.1.ffn_down_exps.weight": "iq1_m",
    "blk.0.attn_q.weight": "q4_k",
    "blk.0.attn_k.weight": "iq4_xs",
    "blk.0.attn_v.weight": "q6_k",
    "blk.0.attn_output.weight": "q5_0",
    "blk.1.attn_q.weight": "iq3_s",
    "blk.1.attn_k.weight": "q5_1",
    "blk.1.attn_v.weight": "iq4_nl",
    "blk.1.attn_output.weight": "q4_1",
    "token_embd.weight": "q5_k",
    "output.weight": "q6_k",
}


@pytest.fixture(scope="module")
def mixed(written):
    # experts default to q4_k, every one of them overridden by MIXED
    return written("qwen3_moe", "q4_k", per_tensor=MIXED)


def test_the_mixed_file_holds_each_tensor_in_its_own_format(mixed):
    import gguf

    path, _, updated = mixed
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}
    assert {name: types[name] for name in MIXED} == MIXED
    assert updated == 2 * 2 + 2 * 4 + 2  # experts, attention, embedding and output


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_mixing_formats_matches_transformers_resident_and_streamed(mixed, backend):
    from test_offload_model import _minimum_gb

    path, expected, _ = mixed
    resident = moerun.load(path, dtype=torch.float32, backend=backend)
    logits = resident.logits(IDS)
    assert rel_err(logits, expected) <= 1e-4
    floor_gb, _ = _minimum_gb(path, torch.float32)
    streamed = moerun.load(path, dtype=torch.float32, backend=backend, expert_cache_gb=floor_gb)
    store = streamed.expert_cache.store
    assert streamed.expert_cache.num_slots < sum(store.num_experts(layer) for layer in store.sources)
    assert torch.equal(streamed.logits(IDS), logits)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_file_mixing_formats_runs_expert_parallel(mixed, backend, tmp_path):
    """2 ranks on the mixed file: rank 0's logits and greedy tokens are one process's, bit for bit."""
    from test_expert_parallel import _check_rank, _one_process, _run

    path, _, _ = mixed
    _, logits, tokens = _one_process(path, backend)
    for rank, r in enumerate(_run(path, 2, tmp_path, backend=backend)):
        _check_rank(rank, r, logits, tokens, backend)


def test_random_blocks_decode_to_about_the_spread_asked_for():
    """The stand-in blocks of a format moerun does not write: valid (finite when decoded by the gguf
    package) and of the RMS asked for, within the spread of random blocks."""
    import gguf
    import numpy as np
    from gguf_from_hf import random_blocks

    from moerun.quant.formats import FORMATS

    for fmt in NEW_FORMATS[7:]:
        q = random_blocks(fmt, (8, 512), std=0.05, seed=1)
        values = gguf.quants.dequantize(q.data.numpy(), gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))
        assert np.isfinite(values).all() and values.shape == (8, 512), fmt
        assert 0.04 < np.sqrt(np.mean(values**2)) < 0.06, fmt
