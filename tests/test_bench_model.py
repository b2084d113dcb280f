"""`moerun bench --model` on a tiny model: it runs, and its two contenders agree (they share weights).
`moerun bench --model PATH` on a tiny GGUF file and HF directory: its figures are self-consistent and
its bytes per token match a count made here from the file's tensors, and what it times computes the
model's logits."""

import json

import numpy as np
import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf
from hf_models import TINY_OLMOE, make_model, save_model

from moerun.benchmarks import BenchSettings
from moerun.benchmarks import model as bench_model
from moerun.benchmarks.checkpoint import (
    MoerunContender,
    compare_logits,
    format_checkpoint_table,
    greedy_tokens,
)
from moerun.benchmarks.model import build_pair, format_model_table, run_model_bench
from moerun.cli import main


def test_the_pair_shares_weights_and_agrees_in_fp32():
    peer, ours = build_pair(2, torch.float32, TINY_OLMOE)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        theirs = peer(ids).logits.float()
        mine = ours.logits(ids)
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4
    assert ours.embed.data_ptr() == peer.model.embed_tokens.weight.data_ptr()  # shared, not copied


def test_model_bench_reports_both_contenders():
    settings = BenchSettings(dtype="fp32", decode_steps=2, repeats=1)
    r = run_model_bench(settings, layers=1, prompt_tokens=16, shape=TINY_OLMOE)
    assert r["peer_max_rel_diff"] <= 1e-4 and r["same_greedy_last_token"]
    assert r["prefill_tok_s"] > 0 and r["decode_vs_peer"] > 0
    assert "decode" in format_model_table(r)


# --- `moerun bench --model PATH`: a checkpoint moerun loads ---


def _reference_bytes_per_token(named_bytes: dict[str, int], vocab: int, top_k: int, experts: int) -> int:
    """Bytes one decode token reads, from {tensor name: bytes}: one embedding row, k of E experts,
    everything else whole (the lm_head included)."""
    total = 0
    for name, nbytes in named_bytes.items():
        if "embed" in name or name == "token_embd.weight":
            total += nbytes // vocab
        elif "experts" in name or "_exps." in name:
            total += nbytes * top_k // experts
        else:
            total += nbytes
    return total


def _gguf_named_bytes(path) -> dict[str, int]:
    """Each tensor's bytes from its shape and ggml type, as the gguf package reads them."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    named = {}
    for t in gguf.GGUFReader(path).tensors:
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        named[t.name] = int(np.prod(t.shape)) // block * size
    return named


def _bench(capsys, path, *extra: str) -> dict:
    argv = ["bench", "--model", str(path), "--dtype", "fp32", "--prefill-tokens", "24"]
    assert main([*argv, "--decode-steps", "4", "--repeats", "2", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _self_consistent(r: dict) -> None:
    assert r["decode_tok_s"] == pytest.approx(1 / r["decode_step_s"])
    assert r["decode_total_s"] >= r["decode_step_s"]  # the total of 4 steps
    assert r["prefill_tok_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"])
    assert r["decode_bytes_per_s"] == pytest.approx(r["bytes_per_token"] * r["decode_tok_s"])
    assert r["decode_copy_fraction"] == pytest.approx(r["decode_bytes_per_s"] / r["copy_bytes_per_s"])
    assert r["peer"] is None and r["peer_note"] == "no --peer"
    assert "no peer (no --peer)" in format_checkpoint_table(r)


@pytest.fixture(scope="module")
def tiny_qwen3():
    """A tiny Qwen3-MoE whose rows are whole q8_0 blocks (hidden 32, expert intermediate 256)."""
    return make_model("qwen3_moe", **GGUF_OVERRIDES["qwen3_moe"], **QUANT_SIZES["qwen3_moe"])


def test_checkpoint_bench_on_a_gguf_file(tmp_path, capsys, tiny_qwen3):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_qwen3, path, experts="q8_0")  # the rest in f32
    r = _bench(capsys, path)
    c = tiny_qwen3.config
    expected = _reference_bytes_per_token(
        _gguf_named_bytes(path), c.vocab_size, c.num_experts_per_tok, c.num_experts
    )
    # loaded in fp32, moerun holds every tensor as the file stores it: the two counts are one
    assert r["file_bytes_per_token"] == expected and r["bytes_per_token"] == expected
    assert (r["checkpoint"], r["model_type"], r["layers"], r["experts"]) == ("gguf", "qwen3_moe", 3, 4)
    _self_consistent(r)


def test_checkpoint_bench_on_a_hf_directory(tmp_path, capsys, tiny_qwen3):
    save_model(tiny_qwen3, tmp_path / "hf")
    r = _bench(capsys, tmp_path / "hf")
    c = tiny_qwen3.config
    named = {name: t.numel() * 4 for name, t in tiny_qwen3.state_dict().items()}  # fp32
    assert r["bytes_per_token"] == _reference_bytes_per_token(
        named, c.vocab_size, c.num_experts_per_tok, c.num_experts
    )
    assert r["file_bytes_per_token"] is None and r["checkpoint"] == "hf"
    _self_consistent(r)


def test_the_contender_computes_what_logits_computes(tmp_path, tiny_qwen3):
    """Its cache, reused run after run, gives the logits of a fresh pass over the same ids."""
    from moerun.checkpoint.load import load

    model = load(save_model(tiny_qwen3, tmp_path / "hf"), dtype=torch.float32)
    contender = MoerunContender(model, capacity=40)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = greedy_tokens(contender, ids[:12], 4)
    for _ in range(2):  # the second run reuses the first's buffers
        prompt_logits = contender.prefill(ids[:12])
        steps = [contender.step(t) for t in tokens]
    full = model.logits(torch.tensor([ids[:12] + tokens]))[0]  # [16, V]
    assert rel_err(prompt_logits, full[11]) <= 1e-5
    for i, step in enumerate(steps):
        assert rel_err(step, full[12 + i]) <= 1e-5
    assert tokens == [int(full[11 + i].argmax()) for i in range(4)]  # greedy
    assert tokens == [t.id for t in model.generate(ids[:12], max_new_tokens=4)]


def test_compare_logits_closed_form():
    ours = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    theirs = torch.tensor([[1.0, 1.5, 0.0], [0.0, 4.0, 2.0]])
    r = compare_logits(ours, theirs)
    assert r == {"compared_positions": 2, "logits_max_rel_diff": 3.0 / 4.0, "top1_agreement": 0.5}


def test_model_without_a_path_is_still_the_generated_model(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench_model, "run_model_bench", lambda **kw: calls.append(kw) or {"ran": True})
    assert main(["bench", "--model", "--layers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ran": True}
    assert calls[0]["layers"] == 1 and calls[0]["prompt_tokens"] == 512


def test_batch_bench_runs_both_sides_on_the_same_tokens(capsys):
    """`moerun bench --model --batch`: in fp32 on a tiny model, moerun's batch and transformers'
    batched generate pick the same greedy tokens at every batch size."""
    from moerun.benchmarks.batch import format_batch_table, run_batch_bench

    settings = BenchSettings(dtype="fp32", decode_steps=4, repeats=1)  # 4 new tokens per prompt
    r = run_batch_bench(settings, layers=2, sizes=(1, 3), shape=TINY_OLMOE)
    assert [row["batch"] for row in r["rows"]] == [1, 3]
    assert all(row["same_greedy_tokens"] for row in r["rows"])
    assert r["rows"][0]["scaling"] == 1.0 and all(row["tok_s"] > 0 for row in r["rows"])
    assert "transformers" in format_batch_table(r)


def test_serve_bench_streams_every_token_asked_for():
    """`moerun bench --serve` on a tiny model: every client's streamed completion has its tokens
    (the generated model's end-of-sequence id lies outside its vocabulary, so none ends early)."""
    from moerun.benchmarks.serve import format_serve_table, run_serve_bench

    settings = BenchSettings(dtype="fp32", decode_steps=3)  # 3 new tokens per request
    r = run_serve_bench(settings, layers=1, clients=(1, 2), requests_per_client=1, shape=TINY_OLMOE)
    assert [(row["clients"], row["requests"], row["tokens"]) for row in r["rows"]] == [(1, 1, 3), (2, 2, 6)]
    assert all(row["ttft_max_s"] > 0 and row["tok_s"] > 0 for row in r["rows"])
    # the scheduler stepped for part of each phase's wall time, never more than all of it
    assert all(row["step_tok_s"] >= row["tok_s"] and 0 < row["busy"] <= 1 for row in r["rows"])
    assert "TTFT" in format_serve_table(r)


def test_serve_bench_under_a_json_schema_gives_the_grammars_share():
    """`moerun bench --serve --json-schema`: each number of clients free, then under the schema; the
    constrained requests end where the schema's JSON is complete, and only those rows give a
    grammar share."""
    pytest.importorskip("llguidance")
    from moerun.benchmarks.serve import format_serve_table, run_serve_bench
    from moerun.benchmarks.vocabulary import SPECIALS

    schema = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}}, "required": ["c"]}
    schema["additionalProperties"] = False
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    settings = BenchSettings(dtype="fp32", decode_steps=40)
    shape = {**TINY_OLMOE, "vocab_size": 512, "eos_token_id": 512 - len(SPECIALS)}  # <|endoftext|>
    r = run_serve_bench(
        settings, layers=1, clients=(1, 2), requests_per_client=1, shape=shape, response_format=fmt
    )
    rows = r["rows"]
    assert [(row["clients"], row["constrained"]) for row in rows] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    assert all(row["requests"] <= row["tokens"] <= 40 * row["requests"] for row in rows)
    # under the schema the ten characters of {"c": "r"} take at most ten tokens, then the end id
    assert all(row["tokens"] <= 11 * row["requests"] for row in rows if row["constrained"])
    assert all(0 < row["grammar_share"] < 1 for row in rows if row["constrained"])
    assert "schema" in format_serve_table(r)


def test_model_bench_on_a_tiny_deepseek_shape():
    """`moerun bench --model --generated deepseek-v2-lite` on tiny shapes: both contenders agree, and
    the KV bytes per token are the latent and rotary key's, counted here from the config."""
    tiny = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
    )
    settings = BenchSettings(dtype="fp32", decode_steps=2, repeats=1)
    r = run_model_bench(settings, layers=2, prompt_tokens=16, shape=tiny, generated="deepseek-v2-lite")
    assert r["peer_max_rel_diff"] <= 1e-4 and r["same_greedy_last_token"]
    assert r["kv_bytes_per_token"] == 2 * (16 + 8) * 4  # 2 layers, fp32
    assert "KV cache per token" in format_model_table(r)
