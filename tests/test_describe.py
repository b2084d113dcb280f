"""`moerun inspect` against the configs and tensors the checkpoints were written from."""

import json
import subprocess
import sys

from hf_models import make_model, save_gpt_oss_mxfp4, save_model

from moerun.checkpoint.describe import describe, format_description
from moerun.cli.main import main


def test_describes_a_hf_checkpoint_from_its_config(tmp_path):
    hf_model = make_model("qwen2_moe")
    save_model(hf_model, tmp_path)
    d = describe(tmp_path)
    c = hf_model.config
    assert (d["architecture"], d["layers"], d["experts_per_layer"], d["top_k"]) == (
        "qwen2_moe",
        c.num_hidden_layers,
        c.num_experts,
        c.num_experts_per_tok,
    )
    assert d["moe_layers"] == c.num_hidden_layers - len(c.mlp_only_layers)
    # one expert of one layer: gate, up [I, H] and down [H, I] in fp32
    assert d["bytes_per_expert"] == 3 * c.moe_intermediate_size * c.hidden_size * 4
    assert d["weights_bytes"] == sum(p.numel() * 4 for p in hf_model.parameters())
    assert d["tensors"]["model.layers.*.mlp.experts.*.gate_proj.weight"] == {
        "f32": d["moe_layers"] * c.num_experts
    }


def test_gpt_oss_mxfp4_experts_show_their_format(tmp_path):
    hf_model = make_model("gpt_oss", hidden_size=64, intermediate_size=32)
    d = describe(save_gpt_oss_mxfp4(hf_model, tmp_path))
    assert d["tensors"]["model.layers.*.mlp.experts.gate_up_proj_blocks"] == {"mxfp4 (gpt-oss)": 3}
    # 4.25 bits per weight (a 17-byte block per 32) plus fp32 biases, per expert and layer
    c = hf_model.config
    weights = (2 * c.intermediate_size * c.hidden_size + c.hidden_size * c.intermediate_size) * 17 // 32
    assert d["bytes_per_expert"] == weights + (2 * c.intermediate_size + c.hidden_size) * 4


def test_cli_prints_text_and_json(tmp_path, capsys):
    save_model(make_model("olmoe"), tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "olmoe" in text and "per expert" in text
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "olmoe"


def test_python_dash_m_moerun_is_the_same_cli(tmp_path, capsys):
    save_model(make_model("olmoe"), tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "moerun", "inspect", str(tmp_path), "--json"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(run.stdout) == json.loads(capsys.readouterr().out)
    missing = subprocess.run(
        [sys.executable, "-m", "moerun", "inspect", str(tmp_path / "nothing-here")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "nothing-here" in missing.stderr


def test_cli_refuses_a_missing_path_in_one_sentence(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing-here")]) == 2
    assert "nothing-here" in capsys.readouterr().err


def test_describes_a_gguf_file_from_its_metadata(tmp_path):
    from gguf_from_hf import write_gguf

    hf_model = make_model("olmoe", hidden_size=256, intermediate_size=256)
    path = tmp_path / "model.gguf"
    write_gguf(hf_model, path, "q4_k", down="q6_k")
    d = describe(path)
    c = hf_model.config
    assert (d["file_format"], d["architecture"], d["layers"], d["experts_per_layer"], d["top_k"]) == (
        "gguf",
        "olmoe",
        c.num_hidden_layers,
        c.num_experts,
        c.num_experts_per_tok,
    )
    assert d["tensors"]["blk.*.ffn_gate_exps.weight"] == {"q4_k": 3}
    assert d["tensors"]["blk.*.ffn_down_exps.weight"] == {"q6_k": 3}
    # q4_k: 144 bytes per 256 weights (gate, up); q6_k: 210 (down)
    per_row = c.hidden_size // 256
    assert d["bytes_per_expert"] == c.intermediate_size * per_row * (2 * 144 + 210)


def test_gguf_with_one_tensor_per_expert_counts_its_experts(tmp_path):
    """The old GGUF layout (blk.N.ffn_gate.E.weight ...) holds the same expert bytes."""
    from gguf_from_hf import GGUF_OVERRIDES, write_gguf

    hf_model = make_model("mixtral", hidden_size=256, intermediate_size=256, **GGUF_OVERRIDES["mixtral"])
    path = tmp_path / "old.gguf"
    write_gguf(hf_model, path, "q8_0", per_expert=True)
    d = describe(path)
    c = hf_model.config
    assert d["tensors"]["blk.*.ffn_gate.*.weight"] == {"q8_0": c.num_hidden_layers * c.num_local_experts}
    # q8_0: 34 bytes per 32 weights, three [256, 256] projections per expert
    assert d["bytes_per_expert"] == 3 * c.intermediate_size * c.hidden_size // 32 * 34


def test_gguf_file_type_and_bits_per_weight(tmp_path):
    """The file type by llama.cpp's name (gguf's LlamaFileType names each one) and the bits per weight
    from the tensors the gguf package's reader lists."""
    import gguf
    from gguf_from_hf import write_gguf

    hf_model = make_model("olmoe", hidden_size=256, intermediate_size=256)
    path = tmp_path / "model.gguf"
    write_gguf(hf_model, path, "q4_k", down="q6_k", extra=lambda w: w.add_file_type(15))
    d = describe(path)
    assert d["file_type"] == gguf.LlamaFileType(15).name.removeprefix("MOSTLY_") == "Q4_K_M"
    tensors = gguf.GGUFReader(path).tensors
    expected = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    assert abs(d["bits_per_weight"] - expected) < 1e-4
    assert f"{expected:.2f} bits per weight" in format_description(d) and "Q4_K_M" in format_description(d)


def test_every_llama_cpp_file_type_name():
    import gguf

    from moerun.checkpoint.describe import GGUF_FILE_TYPES

    theirs = {int(t): t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in gguf.LlamaFileType}
    assert {k: v for k, v in theirs.items() if k in GGUF_FILE_TYPES} == GGUF_FILE_TYPES
    # every type llama.cpp names, but "guessed" (a file type it worked out, never one written)
    assert set(theirs) - set(GGUF_FILE_TYPES) == {1024}
