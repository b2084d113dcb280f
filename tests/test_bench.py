"""`moerun bench` on a tiny shape: it runs end to end, its figures are self-consistent, and its
peer computes the same function as the layer."""

import json
import re
from pathlib import Path

import pytest
import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks import layer as bench
from moerun.benchmarks.layer import BenchShape, run_bench
from moerun.cli import main

TINY = BenchShape(
    "qwen3_moe",
    dict(
        hidden_size=64, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True
    ),
)
TINY_GPT_OSS = BenchShape(
    "gpt_oss",
    dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, swiglu_limit=7.0),
)


def _bench_json(monkeypatch, capsys, shape: BenchShape, *args: str) -> dict:
    """Register `shape` as "tiny", run `moerun bench --shape tiny ARGS --json`, return its record."""
    monkeypatch.setitem(bench.SHAPES, "tiny", shape)
    assert main(["bench", "--shape", "tiny", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("shape", [TINY, TINY_GPT_OSS], ids=["qwen3_moe", "gpt_oss"])
def test_bench_figures_and_peer_agreement(shape):
    settings = BenchSettings(dtype="fp32", device="cpu", decode_steps=4, repeats=2)
    r = run_bench(settings, "tiny", prefill_tokens=40, shape=shape)
    for key in (
        "prefill_tok_s",
        "decode_tok_s",
        "decode_weight_bytes_per_s",
        "copy_bytes_per_s",
        "peer_prefill_tok_s",
        "peer_decode_tok_s",
    ):
        assert r[key] > 0, key
    # one expert's bytes, counted from the transformers config independently of MoESpec
    c = shape.config
    inter = c.get("moe_intermediate_size", c.get("intermediate_size"))
    bias = 2 * inter + c["hidden_size"] if shape.model_type == "gpt_oss" else 0  # gate_up and down biases
    assert r["expert_bytes"] == 4 * (3 * c["hidden_size"] * inter + bias)
    assert r["decode_weight_bytes_per_s"] == pytest.approx(
        c["num_experts_per_tok"] * r["expert_bytes"] * r["decode_tok_s"]
    )
    assert r["peer_max_rel_diff"] <= 1e-5


def test_cli_json_has_the_documented_keys(monkeypatch, capsys):
    record = _bench_json(
        monkeypatch, capsys, TINY, "--dtype", "bf16", "--prefill-tokens", "16", "--decode-steps", "3"
    )
    for key in (
        "prefill_tok_s",
        "decode_tok_s",
        "decode_weight_bytes_per_s",
        "copy_bytes_per_s",
        "peer_prefill_tok_s",
        "peer_decode_tok_s",
    ):
        assert record[key] > 0
    assert (record["shape"], record["dtype"], record["device"]) == ("tiny", "bf16", "cpu")
    # a peer ran, so no note explains its absence
    assert record["peer"].startswith("transformers") and record["peer_note"] is None


def test_json_without_peer_says_why(monkeypatch, capsys):
    record = _bench_json(
        monkeypatch, capsys, TINY, "--prefill-tokens", "8", "--decode-steps", "2", "--no-peer"
    )
    assert record["peer"] is None and record["peer_note"] == "--no-peer"
    monkeypatch.setattr(bench, "transformers_available", lambda: False)
    record = _bench_json(monkeypatch, capsys, TINY, "--prefill-tokens", "8", "--decode-steps", "2")
    assert record["peer"] is None and "transformers not installed" in record["peer_note"]


def test_cli_table_without_peer(monkeypatch, capsys):
    monkeypatch.setitem(bench.SHAPES, "tiny", TINY)
    assert (
        main(["bench", "--shape", "tiny", "--prefill-tokens", "8", "--decode-steps", "2", "--no-peer"]) == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"decode\s+[\d.]+ tok/s", out) and "no ratios" in out


def test_bench_shapes_build_valid_specs():
    from moerun.families import family

    expected = {
        "olmoe": (2048, 1024, 64, 8),
        "qwen3-30b-a3b": (2048, 768, 128, 8),
        "mixtral-8x7b": (4096, 14336, 8, 2),
        "gpt-oss-20b": (2880, 2880, 32, 4),
    }
    for name, shape in bench.SHAPES.items():
        spec = family(shape.model_type).moe_spec(shape.config)
        assert (spec.hidden, spec.intermediate, spec.num_experts, spec.top_k) == expected[name]


def test_readme_commands_are_what_ci_runs():
    root = Path(__file__).parent.parent
    first_lines = (root / "README.md").read_text().splitlines()[:12]
    commands = [line.strip() for line in first_lines if line.strip().startswith("bash scripts/")]
    assert commands[:2] == ["bash scripts/bench.sh", "bash scripts/test.sh"]
    assert "exec bash scripts/test.sh" in (root / ".ci" / "run").read_text()


def test_random_layer_is_reproducible():
    a = bench.random_layer(TINY, torch.float32, "cpu", seed=3)
    b = bench.random_layer(TINY, torch.float32, "cpu", seed=3)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_cli_quantised_bench_compares_with_the_dense_layer(monkeypatch, capsys):
    shape = BenchShape(
        "qwen3_moe",
        dict(
            hidden_size=256,
            moe_intermediate_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    )
    record = _bench_json(
        monkeypatch,
        capsys,
        shape,
        "--formats",
        "gate_up=q2_k,down=q3_k",
        "--prefill-tokens",
        "8",
        "--decode-steps",
        "2",
    )
    assert record["formats"] == {"gate_up": "q2_k", "down": "q3_k"}
    # one expert: gate_up [512, 256] in q2_k (84 bytes per 256) and down [256, 256] in q3_k (110 per 256)
    assert record["expert_bytes"] == 512 * 84 + 256 * 110
    assert record["peer"].startswith("moerun dense") and record["peer_decode_tok_s"] > 0
    assert "dequant_cache" not in record


def test_cli_quantised_bench_reports_the_dequant_cache(monkeypatch, capsys):
    # the torch backend's prefill dequantises experts (the cpu backend reads their bytes directly)
    args = ("--format", "q8_0", "--prefill-tokens", "8", "--decode-steps", "2", "--dequant-cache-gb", "1")
    cache = _bench_json(monkeypatch, capsys, TINY, *args, "--backend", "torch")["dequant_cache"]
    # every prefill call after the first finds its experts dequantised already
    assert cache["misses"] > 0 and cache["hits"] > cache["misses"]
    # each miss keeps one expert's three [64, 32] projections dequantised to bf16 (2 bytes each)
    assert cache["bytes"] == cache["misses"] * 2 * 3 * 64 * 32


def test_cli_refuses_a_malformed_formats_flag(monkeypatch):
    with pytest.raises(SystemExit, match="gate_up=FMT,down=FMT, not 'up=q4_k'"):
        main(["bench", "--formats", "up=q4_k"])
