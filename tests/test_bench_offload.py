"""`moerun bench --offload` on a tiny model: the checkpoint it writes is a valid OLMoE safetensors
file, its figures are present and consistent, and every streamed run's logits equal the resident
model's bit for bit."""

import json

import pytest
import torch
from hf_models import TINY_OLMOE
from safetensors.torch import load_file

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.offload import format_offload_table, run_offload_bench, write_checkpoint
from moerun.benchmarks.pagecache import cached_fraction
from moerun.checkpoint.load import load

LAYERS, STEPS = 2, 6


@pytest.fixture(scope="module")
def result():
    settings = BenchSettings(dtype="fp32", decode_steps=STEPS)
    return run_offload_bench(settings, layers=LAYERS, prompt_tokens=16, warmup_steps=2, shape=TINY_OLMOE)


def test_the_checkpoint_is_what_the_safetensors_package_reads(tmp_path):
    write_checkpoint(tmp_path, LAYERS, torch.bfloat16, TINY_OLMOE)
    theirs = load_file(tmp_path / "model.safetensors")
    E, H, I = TINY_OLMOE["num_experts"], TINY_OLMOE["hidden_size"], TINY_OLMOE["intermediate_size"]
    assert theirs["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert theirs["model.layers.1.mlp.experts.down_proj"].shape == (E, H, I)
    assert all(t.dtype == torch.bfloat16 for t in theirs.values())
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == LAYERS
    model = load(tmp_path, dtype=torch.bfloat16)  # moerun's loader reads the same bytes
    assert torch.equal(model.embed, theirs["model.embed_tokens.weight"])
    # the page cache probe: a file just read whole is all cached
    path = tmp_path / "model.safetensors"
    path.read_bytes()
    fraction = cached_fraction(path, [(0, path.stat().st_size)])
    assert fraction is None or fraction == 1.0


def test_streamed_logits_equal_the_resident_model_bitwise(result):
    assert len(result["runs"]) == 8
    assert all(run["same_logits"] for run in result["runs"])
    assert result["same_logits_as_resident"]


def test_hit_rate_grows_with_the_cache_and_is_full_at_100_percent(result):
    off = [run for run in result["runs"] if run["prefetch_k"] == 0]
    rates = [run["hit_rate"] for run in off]
    assert rates == sorted(rates), rates  # LRU on the same token sequence: a bigger cache never hits less
    assert rates[-1] == 1.0  # the prompt touched every expert; a cache that holds them all never misses
    assert [run["slots"] for run in off] == [4, 8, 12, 16]  # 25..100% of 2 layers x 8 experts


def test_every_expert_misses_with_top_k_slots(result):
    k, per_step = TINY_OLMOE["num_experts_per_tok"], LAYERS * TINY_OLMOE["num_experts_per_tok"]
    for run in (result["all_miss_cold"], result["all_miss_warm"]):
        assert run["slots"] == k and run["hit_rate"] == 0.0
        assert run["misses"] == STEPS * per_step
        assert run["bytes_read"] == run["misses"] * result["expert_bytes"]  # fp32 file, fp32 slots
        assert run["miss_fetch_bytes_per_s"] > 0


def test_figures_are_present_and_sane(result):
    for key in ("ram_copy_bytes_per_s", "file_read_cold_bytes_per_s", "file_read_warm_bytes_per_s"):
        assert result[key] > 0
    assert result["resident_tok_s"] > 0
    for run in result["runs"]:
        assert run["tok_s"] > 0 and run["vs_resident"] > 0
        if run["prefetch_k"]:
            assert run["prefetch_issued"] > 0 or run["cache_fraction"] == 1.0
            for key in ("prefetch_recall", "prefetch_waste"):
                assert run[key] is None or 0.0 <= run[key] <= 1.0
        else:
            assert run["prefetch_issued"] == 0 and run["prefetch_recall"] is None
    targets = result["targets"]
    assert targets["prefetch_speedup_at_50"] > 0 and targets["full_cache_vs_resident"] > 0
    table = format_offload_table(result)
    assert "resident" in table and "targets" in table
    json.dumps(result)  # --json prints it


def test_cold_runs_at_half_cache_are_reported(result):
    off, on = result["cold_runs"]
    assert (off["prefetch_k"], on["prefetch_k"]) == (0, TINY_OLMOE["num_experts_per_tok"])
    assert off["tok_s"] > 0 and on["tok_s"] > 0 and off["prefetch_issued"] == 0
    assert result["targets"]["prefetch_speedup_at_50_cold"] == on["tok_s"] / off["tok_s"]


def test_predictable_checkpoint_makes_every_prefetch_count(tmp_path):
    """The --predictable checkpoint: the next layer's router sees the hidden state that layer will
    see, so nothing prefetched is wasted, and the later layers' misses become prefetch hits."""
    write_checkpoint(tmp_path, LAYERS, torch.float32, TINY_OLMOE, predictable=True)
    theirs = load_file(tmp_path / "model.safetensors")
    assert torch.equal(theirs["model.layers.0.mlp.gate.weight"], theirs["model.layers.1.mlp.gate.weight"])
    assert not theirs["model.layers.1.mlp.experts.down_proj"].any()
    settings = BenchSettings(dtype="fp32", decode_steps=STEPS)
    r = run_offload_bench(
        settings, layers=LAYERS, prompt_tokens=16, warmup_steps=2, shape=TINY_OLMOE, predictable=True
    )
    on = next(run for run in r["runs"] if run["cache_fraction"] == 0.5 and run["prefetch_k"])
    assert on["prefetch_waste"] == 0.0 and on["prefetch_recall"] > 0.0
    assert r["same_logits_as_resident"]
