"""`moerun bench --model FILE --peer llama.cpp`: the refusals (one sentence each, before any model
loads), the peer-model script's GGUF writer (before llama.cpp quantises: a file moerun loads with the
shapes asked for), and, when llama-cpp-python is installed, the whole comparison on a tiny file."""

import dataclasses
import json
import sys
from pathlib import Path

import gguf
import pytest
import torch

from moerun.benchmarks import checkpoint as bench_checkpoint
from moerun.checkpoint.load import load
from moerun.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_peer_gguf import GPT_OSS_20B, PeerShape, quantize, vocabulary, write_f16_gguf  # noqa: E402

TINY = PeerShape(
    hidden=64,
    expert_intermediate=32,
    heads=4,
    kv_heads=2,
    head_dim=16,
    experts=8,
    top_k=2,
    layers=2,
    vocab=300,
)


def _refusal(capsys, monkeypatch, *argv: str) -> str:
    """Run `moerun bench ARGV`; it must refuse, without loading a model, in one sentence."""

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(bench_checkpoint, "load", no_load)
    assert main(["bench", *argv]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("moerun bench: --peer llama.cpp ") and message.endswith(".")
    assert "\n" not in message and ". " not in message  # one sentence
    return message


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    return write_f16_gguf(tmp_path_factory.mktemp("peer") / "tiny.f16.gguf", TINY)


def test_peer_refuses_a_hf_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    assert "is not one" in _refusal(capsys, monkeypatch, "--model", str(tmp_path), "--peer", "llama.cpp")


def test_peer_refuses_without_a_checkpoint(capsys, monkeypatch):
    assert "give --model FILE.gguf" in _refusal(capsys, monkeypatch, "--peer", "llama.cpp")
    assert "give --model FILE.gguf" in _refusal(capsys, monkeypatch, "--model", "--peer", "llama.cpp")


def test_peer_refuses_when_llama_cpp_python_is_absent(capsys, monkeypatch, tiny_f16):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    message = _refusal(capsys, monkeypatch, "--model", str(tiny_f16), "--peer", "llama.cpp")
    assert "not installed" in message and "pip install llama-cpp-python" in message


def test_the_script_writes_a_file_moerun_loads_with_the_shapes_asked_for(tiny_f16):
    model = load(tiny_f16, dtype=torch.float32)
    c = model.config
    assert (c.model_type, c.num_layers, c.hidden, c.vocab_size) == ("qwen3_moe", 2, 64, 300)
    assert (c.attention.heads, c.attention.kv_heads, c.attention.head_dim) == (4, 2, 16)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate) == (8, 2, 32)
    assert c.attention.qk_norm == "head" and not c.tie_embeddings
    moe = model.mlps[0]
    assert tuple(moe.tensors["experts.gate_up"].shape) == (8, 64, 64)  # gate and up of 32 rows each
    assert tuple(moe.tensors["experts.down"].shape) == (8, 64, 32)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tiny_f16).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.1.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    weights = model.attentions[1].t["q.weight"].float()
    assert 0.018 < weights.std().item() < 0.022 and model.attn_norms[0].eq(1).all()
    # the vocabulary: specials, then the 256 byte tokens, the tokenizer rebuilt from it round-trips
    tokens, scores, types = vocabulary(300)
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and len(set(tokens)) == 300
    text = "ab ba"
    assert model.tokenizer.decode(model.tokenizer.encode(text, add_special_tokens=False)) == text


def test_the_script_writes_gpt_oss_with_the_metadata_its_converted_files_carry(tmp_path):
    small = dict(hidden=64, expert_intermediate=32, heads=4, kv_heads=2, head_dim=16, experts=8, layers=3)
    shape = dataclasses.replace(GPT_OSS_20B, vocab=300, **small)
    model = load(write_f16_gguf(tmp_path / "gpt-oss.f16.gguf", shape), dtype=torch.float32)
    c, a = model.config, model.config.attention
    assert (c.model_type, c.num_layers, c.moe.num_experts, c.moe.top_k) == ("gpt_oss", 3, 8, 4)
    assert c.sliding_windows == (128, None, 128) and a.sinks and a.qkv_bias and a.o_bias
    rope = a.rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_positions) == ("yarn", 150000.0, 32.0, 4096)
    assert not rope.truncate  # as gpt-oss was trained (moerun.checkpoint.gguf's docstring)
    moe = model.mlps[0].tensors
    assert {"router.bias", "experts.gate_up_bias", "experts.down_bias"} <= set(moe)
    assert model.attentions[0].t["sinks"].abs().max() > 0.1  # N(0, 1), not the N(0, 0.02) of weights


@pytest.mark.slow
def test_llama_cpp_peer_end_to_end(tmp_path, capsys, tiny_f16):
    pytest.importorskip("llama_cpp")
    path = tmp_path / "tiny.q8_0.gguf"
    quantize(tiny_f16, path, "q8_0")
    argv = ["bench", "--model", str(path), "--peer", "llama.cpp", "--dtype", "fp32", "--prefill-tokens", "40"]
    assert main([*argv, "--decode-steps", "6", "--repeats", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["peer"].startswith("llama.cpp")
    assert r["peer_bytes_per_token"] == r["file_bytes_per_token"] > 0
    assert r["peer_decode_bytes_per_s"] == pytest.approx(r["peer_bytes_per_token"] * r["peer_decode_tok_s"])
    assert r["decode_vs_peer"] == pytest.approx(r["decode_tok_s"] / r["peer_decode_tok_s"])
    assert r["prefill_vs_peer"] == pytest.approx(r["prefill_tok_s"] / r["peer_prefill_tok_s"])
    # the same weights on the same positions: the two agree up to llama.cpp's q8_0 activations
    assert r["compared_positions"] == 7
    assert r["logits_max_rel_diff"] < 0.05 and r["top1_agreement"] >= 6 / 7
