"""`moerun quantize`: tiny Hugging Face checkpoints of each family (with a tokenizer) -> GGUF files,
checked three ways: by the gguf package's reader (architecture, tensor types); against transformers
on the same weights, each parameter replaced by the values its stored format holds (quantised here
again with moerun's quantisers, following llama.cpp's rules for which tensor gets which format); and
the tokenizer read back from the file against the tokenizer.json it came from. Then the refusals,
and a run interrupted while writing."""

from __future__ import annotations

import contextlib
import copy
import io
import random
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import rel_err
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf
from hf_models import (
    hf_greedy,
    hf_logits,
    load_gpt_oss_mxfp4_with_transformers,
    make_model,
    save_gpt_oss_mxfp4,
    save_model,
)
from tiny_tokenizers import STRINGS, VARIANTS, random_text, save_hf_dir

import moerun
from moerun.cli.main import main
from moerun.export.gguf_writer import GGUFWriter
from moerun.loader import GGUFFile
from moerun.quant.dequant import dequantize
from moerun.quant.quantize import quantize
from moerun.settings import settings
from moerun.text import Tokenizer

VOCAB = 544  # more rows than any tiny tokenizer has ids: the rest are written as [PAD{id}] tokens
SIZES = QUANT_SIZES  # k-quant-sized rows (hidden and expert intermediate 256), 2 layers, 4 experts
TOKENIZERS = {
    "mixtral": "spm",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen2",
    "olmoe": "gpt2",
    "gpt_oss": "llama3",
}
ARCHS = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
}
# name: (family, extra model config, command-line options, (gate/up, down, rest) formats)
CASES = {
    "mixtral-q4_k": ("mixtral", {}, ["--experts", "q4_k"], ("q4_k", "q4_k", "f16")),
    "qwen2_moe-q4_k": ("qwen2_moe", {}, ["--experts", "q4_k"], ("q4_k", "q4_k", "f16")),
    "qwen3_moe-q4_k": ("qwen3_moe", {}, ["--experts", "q4_k"], ("q4_k", "q4_k", "f16")),
    "olmoe-q4_k": ("olmoe", {}, ["--experts", "q4_k"], ("q4_k", "q4_k", "f16")),
    "gpt_oss-q4_k": ("gpt_oss", {}, ["--experts", "q4_k"], ("q4_k", "q4_k", "f16")),
    "qwen3_moe-q4_k-down-q6_k-rest-f32": (
        "qwen3_moe",
        {},
        ["--experts", "q4_k", "--down", "q6_k", "--rest", "f32"],
        ("q4_k", "q6_k", "f32"),
    ),
    # the shared expert's down rows (48) are not q8_0 blocks: stored f16
    "qwen2_moe-q8_0-rest-q8_0": (
        "qwen2_moe",
        {},
        ["--experts", "q8_0", "--rest", "q8_0"],
        ("q8_0", "q8_0", "q8_0"),
    ),
    # expert rows of 96 are not q6_k blocks: down falls back to q8_0 (q4_k's fallback, q5_0: below)
    "olmoe-q6_k-rows-of-96-rest-bf16": (
        "olmoe",
        dict(intermediate_size=96),
        ["--experts", "q6_k", "--rest", "bf16"],
        ("q6_k", "q6_k", "bf16"),
    ),
    "mixtral-mxfp4": ("mixtral", {}, ["--experts", "mxfp4"], ("mxfp4", "mxfp4", "f16")),
}
GGML_TYPES = {
    "f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K",
    "mxfp4": "MXFP4", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "q4_0": "Q4_0", "q4_1": "Q4_1",
    "q5_0": "Q5_0", "q5_1": "Q5_1", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0",
}  # fmt: skip
BLOCK = {
    "f32": 1, "f16": 1, "bf16": 1, "q8_0": 32, "q4_k": 256, "q6_k": 256, "mxfp4": 32, "iq4_xs": 256,
    "iq4_nl": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "tq1_0": 256, "tq2_0": 256,
}  # fmt: skip
IDS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
PROMPT = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are small; on a busy 2-core machine the thread pool made quantising them many
    times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# llama-quantize's fallbacks for rows that are not whole blocks (llama-quant.cpp, tensor_type_fallback)
LLAMA_CPP_FALLBACKS = {"q4_k": "q5_0", "q6_k": "q8_0", "iq4_xs": "iq4_nl", "tq1_0": "q4_0", "tq2_0": "q4_0"}


def stored_format(fmt: str, row: int) -> str:
    """llama-quantize's choice: rows that are not whole blocks go to the fallback if they can, else f16."""
    if row % BLOCK[fmt] == 0:
        return fmt
    fallback = LLAMA_CPP_FALLBACKS.get(fmt, "f16")
    return fallback if row % BLOCK[fallback] == 0 else "f16"


def as_stored(tensor: torch.Tensor, fmt: str) -> torch.Tensor:
    """[.., out, in] -> the values a file holding it in `fmt` (row by row) gives back."""
    fmt = stored_format(fmt, tensor.shape[-1])
    return tensor if fmt == "f32" else dequantize(quantize(tensor.detach().float().contiguous(), fmt))


def with_stored_weights(hf_model, gate_up: str, down: str, rest: str):
    """A copy of `hf_model` whose parameters hold what the GGUF file stores: experts in their formats,
    other 2-D weights in `rest`; 1-D tensors, biases and routers (llama.cpp's ffn_gate_inp, and Qwen's
    shared-expert gate, stored [H]) stay f32."""
    model = copy.deepcopy(hf_model)
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(
                ("_bias", ".bias", "mlp.gate.weight", "router.weight", "expert_gate.weight")
            ):
                continue
            if ".experts." in name:
                fmt = down if name.endswith("down_proj") else gate_up
                w = p.transpose(-1, -2) if gpt_oss else p  # transformers stores GPT-OSS experts [E, in, out]
                stored = as_stored(w, fmt)
                p.copy_(stored.transpose(-1, -2) if gpt_oss else stored)
            else:
                p.copy_(as_stored(p, rest))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(transformers model, checkpoint directory with its tokenizer) per (family, extra config)."""
    made = {}

    def get(model_type: str, extra: dict):
        key = (model_type, tuple(sorted(extra.items())))
        if key not in made:
            model = make_model(
                model_type,
                hidden_size=256,
                num_hidden_layers=2,
                vocab_size=VOCAB,
                **{**GGUF_OVERRIDES[model_type], **SIZES[model_type], **extra},
            )
            directory = save_model(model, tmp_path_factory.mktemp(model_type))
            make, config = VARIANTS[TOKENIZERS[model_type]]
            save_hf_dir(make(), directory, **config)
            made[key] = model, directory
        return made[key]

    return get


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """case -> (transformers model, checkpoint directory, GGUF path, stderr lines), converted once."""
    done = {}

    def get(case: str):
        if case not in done:
            model_type, extra, options, _ = CASES[case]
            model, directory = checkpoints(model_type, extra)
            out = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                assert main(["quantize", str(directory), str(out), *options]) == 0
            done[case] = model, directory, out, stderr.getvalue().splitlines()
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_the_gguf_package_reads_the_file_with_the_types_asked_for(case, converted):
    model_type, _, _, (gate_up, down, rest) = CASES[case]
    model, _, out, _ = converted(case)
    reader = gguf.GGUFReader(out)
    arch = ARCHS[model_type]
    field = reader.fields["general.architecture"]
    assert field.contents() == arch
    assert reader.fields["general.quantization_version"].contents() == 2
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    intermediate = (
        model.config.intermediate_size
        if model_type in ("mixtral", "olmoe", "gpt_oss")
        else model.config.moe_intermediate_size
    )
    hidden = model.config.hidden_size
    for layer in range(2):
        blk = f"blk.{layer}."
        assert types[blk + "ffn_gate_exps.weight"] == GGML_TYPES[stored_format(gate_up, hidden)]
        assert types[blk + "ffn_up_exps.weight"] == GGML_TYPES[stored_format(gate_up, hidden)]
        assert types[blk + "ffn_down_exps.weight"] == GGML_TYPES[stored_format(down, intermediate)]
        assert types[blk + "attn_q.weight"] == GGML_TYPES[rest]
        assert types[blk + "ffn_gate_inp.weight"] == "F32"
        assert types[blk + "attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == GGML_TYPES[rest]
    assert types["output_norm.weight"] == "F32"
    # gguf-py's own name table for the arch knows every tensor name
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], 2)
    for name in types:
        assert names.get_type_and_name(name, try_suffixes=(".weight", ".bias")) is not None, name


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers_on_the_stored_weights(case, converted):
    _, _, _, formats = CASES[case]
    hf_model, _, out, _ = converted(case)
    oracle = with_stored_weights(hf_model, *formats)
    model = moerun.load(out, dtype=torch.float32)
    assert rel_err(model.logits(IDS), hf_logits(oracle, IDS)) <= 1e-4
    ours = [t.id for t in model.generate(PROMPT, max_new_tokens=8)]
    assert ours == hf_greedy(oracle, PROMPT, 8)[: len(ours)]
    assert len(ours) == 8 or ours[-1] in model.config.eos_token_ids  # moerun stops at the tokenizer's EOS


def test_fallbacks_are_said(converted):
    *_, log = converted("olmoe-q6_k-rows-of-96-rest-bf16")
    assert any("ffn_down_exps.weight: rows of 96" in line and "q8_0" in line for line in log)
    *_, log = converted("qwen2_moe-q8_0-rest-q8_0")
    assert any("ffn_down_shexp.weight: rows of 48" in line and "f16" in line for line in log)


REPORTED = {
    "olmoe-q6_k-rows-of-96-rest-bf16": (
        "experts gate/up q6_k, down q8_0 (rows of 96 are not whole 256-element q6_k blocks); "
        "other 2-D weights bf16; norms, biases and routers f32"
    ),
    "qwen2_moe-q8_0-rest-q8_0": (
        "experts gate/up q8_0, down q8_0; other 2-D weights q8_0, "
        "ffn_down_shexp.weight f16 (rows of 48 are not whole 32-element q8_0 blocks); "
        "norms, biases and routers f32"
    ),
}


@pytest.mark.parametrize("case", list(REPORTED))
def test_the_report_says_the_formats_written(case, converted):
    """Each layer's line and the summary name the formats the file holds (a fallback with its reason),
    as the gguf package reads them back, not the ones asked for."""
    *_, out, log = converted(case)
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
    experts = REPORTED[case].split(";")[0].removeprefix("experts ")
    layers = [line for line in log if re.match(r"moerun quantize: layer \d/2: 4 experts -> ", line)]
    assert [line.split(" -> ")[1].split(";")[0] for line in layers] == [experts, experts]
    assert f"moerun quantize: stored: {REPORTED[case]}" in log
    named = dict(
        re.findall(r"(?:experts |, )(gate/up|down|\w+\.weight) (\w+)", REPORTED[case].replace(";", ","))
    )
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_up_exps.weight"] == named["gate/up"]
    assert types["blk.1.ffn_down_exps.weight"] == named["down"]
    for kind, fmt in named.items():
        if kind.endswith(".weight"):
            assert types[f"blk.0.{kind}"] == types[f"blk.1.{kind}"] == fmt, kind


@pytest.mark.parametrize("model_type", list(GGUF_OVERRIDES))
def test_the_tokenizer_read_back_encodes_and_decodes_like_tokenizer_json(model_type, converted):
    case = f"{model_type}-q4_k"
    _, directory, out, _ = converted(case)
    original = Tokenizer.from_hf_dir(directory)
    ours = Tokenizer.from_gguf_metadata(GGUFFile(out).metadata, source=str(out))
    rng = random.Random(model_type)
    for text in [*STRINGS, "In 2024, 100% of 3-1 wins.", *(random_text(rng, 30) for _ in range(30))]:
        ids = original.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == original.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.bos_id == original.bos_id


def test_gpt_oss_mxfp4_experts_are_written_as_they_are(tmp_path):
    hf_model = make_model(
        "gpt_oss",
        hidden_size=256,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        **GGUF_OVERRIDES["gpt_oss"],
        **SIZES["gpt_oss"],
    )
    src = save_gpt_oss_mxfp4(hf_model, tmp_path / "src")
    out = tmp_path / "model.gguf"
    assert main(["quantize", str(src), str(out), "--experts", "mxfp4", "--rest", "f32"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    oracle = load_gpt_oss_mxfp4_with_transformers(src)  # transformers' own reading of the MXFP4 bytes
    model = moerun.load(out, dtype=torch.float32)
    assert rel_err(model.logits(IDS), hf_logits(oracle, IDS)) <= 1e-4


# what tests/gguf_from_hf.py writes for a model (as llama.cpp's converter) that quantize adds to it
ADDED_KEYS = {"general.name", "general.quantization_version", "key_length", "value_length", "yarn_beta"}


@pytest.mark.parametrize("model_type", list(GGUF_OVERRIDES))
def test_an_f32_file_is_what_llama_cpp_s_converter_writes(model_type, tmp_path):
    """Same keys, values and value types, same tensor names, shapes, types and bytes as the gguf
    package writes following convert_hf_to_gguf.py (tests/gguf_from_hf.py); only keys are added."""
    hf_model = make_model(model_type, **GGUF_OVERRIDES[model_type])
    src = save_model(hf_model, tmp_path / "src")
    assert main(["quantize", str(src), str(tmp_path / "ours.gguf"), "--experts", "f32", "--rest", "f32"]) == 0
    write_gguf(hf_model, tmp_path / "reference.gguf")
    ours, reference = gguf.GGUFReader(tmp_path / "ours.gguf"), gguf.GGUFReader(tmp_path / "reference.gguf")
    fields = {k: (f.types, f.contents()) for k, f in ours.fields.items() if not k.startswith("GGUF.")}
    expected = {k: (f.types, f.contents()) for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in fields.items() if k in expected} == expected
    assert all(any(a in k for a in ADDED_KEYS) for k in fields.keys() - expected.keys())
    tensors = {t.name: t for t in ours.tensors}
    assert sorted(tensors) == sorted(t.name for t in reference.tensors)
    for t in reference.tensors:
        assert (tensors[t.name].tensor_type, list(tensors[t.name].shape)) == (t.tensor_type, list(t.shape))
        assert np.array_equal(tensors[t.name].data, t.data), t.name


# ---------------------------------------------------------------- refusals


def test_an_existing_file_is_kept_unless_forced(checkpoints, tmp_path, capsys):
    _, src = checkpoints("olmoe", {})
    out = tmp_path / "model.gguf"
    out.write_bytes(b"keep me")
    assert main(["quantize", str(src), str(out), "--experts", "q8_0"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert main(["quantize", str(src), str(out), "--experts", "q8_0", "--force"]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "olmoe"


def test_an_interrupted_write_leaves_no_file(checkpoints, tmp_path, monkeypatch):
    _, src = checkpoints("olmoe", {})
    written, original = [], GGUFWriter._bytes

    def fail_after_three(tensor):
        if len(written) == 3:
            raise KeyboardInterrupt  # as Ctrl-C would, in the middle of the data section
        written.append(tensor)
        return original(tensor)

    monkeypatch.setattr(GGUFWriter, "_bytes", staticmethod(fail_after_three))
    # Ctrl-C ends the command with the shell's code for it, and no partial file
    assert main(["quantize", str(src), str(tmp_path / "model.gguf"), "--experts", "q8_0"]) == 130
    assert len(written) == 3  # it was writing tensors when it stopped
    assert list(tmp_path.iterdir()) == []


# The formats added with the i-quants, each read back by the gguf package and run against
# transformers on the stored weights (the cpu backend needs native kernels for them).
# name: (family, extra model config, options, (gate/up, down, rest) formats)
NEW_FORMAT_CASES = {
    "qwen3_moe-iq4_xs-down-q5_1-rest-q5_0": (
        "qwen3_moe",
        {},
        ["--experts", "iq4_xs", "--down", "q5_1", "--rest", "q5_0"],
        ("iq4_xs", "q5_1", "q5_0"),
    ),
    "mixtral-iq4_nl-down-q4_1-rest-iq4_nl": (
        "mixtral",
        {},
        ["--experts", "iq4_nl", "--down", "q4_1", "--rest", "iq4_nl"],
        ("iq4_nl", "q4_1", "iq4_nl"),
    ),
    "olmoe-tq2_0-down-tq1_0-rest-q5_1": (
        "olmoe",
        {},
        ["--experts", "tq2_0", "--down", "tq1_0", "--rest", "q5_1"],
        ("tq2_0", "tq1_0", "q5_1"),
    ),
    # down's rows of 96 are not whole 256-element blocks: llama-quantize's fallbacks, iq4_nl and q5_0
    "olmoe-q4_k-rows-of-96": (
        "olmoe",
        dict(intermediate_size=96),
        ["--experts", "q4_k"],
        ("q4_k",) * 2 + ("f16",),
    ),
    "olmoe-iq4_xs-rows-of-96": (
        "olmoe",
        dict(intermediate_size=96),
        ["--experts", "iq4_xs"],
        ("iq4_xs",) * 2 + ("f16",),
    ),
}


@pytest.fixture(scope="module")
def converted_new(checkpoints, tmp_path_factory):
    done = {}

    def get(case: str):
        if case not in done:
            model_type, extra, options, _ = NEW_FORMAT_CASES[case]
            model, directory = checkpoints(model_type, extra)
            out = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            with contextlib.redirect_stderr(io.StringIO()):
                assert main(["quantize", str(directory), str(out), *options]) == 0
            done[case] = model, out
        return done[case]

    return get


@pytest.mark.parametrize("case", list(NEW_FORMAT_CASES))
def test_new_formats_are_written_as_asked_and_read_by_the_gguf_package(case, converted_new):
    _, _, _, (gate_up, down, rest) = NEW_FORMAT_CASES[case]
    model, out = converted_new(case)
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    intermediate = getattr(model.config, "moe_intermediate_size", None) or model.config.intermediate_size
    assert types["blk.1.ffn_up_exps.weight"] == GGML_TYPES[gate_up]
    assert types["blk.1.ffn_down_exps.weight"] == GGML_TYPES[stored_format(down, intermediate)]
    assert types["blk.1.attn_q.weight"] == types["token_embd.weight"] == GGML_TYPES[rest]
    file_type = "MOSTLY_Q4_K_S" if gate_up == "q4_k" else f"MOSTLY_{gate_up.upper()}"
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType[file_type])
    # the bytes are those of moerun's quantiser on the checkpoint's weights (gguf's reader decodes them)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    up = model.model.layers[1].mlp.experts.gate_up_proj.detach().chunk(2, dim=-2)[1]
    np.testing.assert_array_equal(decoded, as_stored(up, gate_up).numpy())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(NEW_FORMAT_CASES))
def test_new_formats_match_transformers_on_the_stored_weights(case, backend, converted_new):
    *_, formats = NEW_FORMAT_CASES[case]
    hf_model, out = converted_new(case)
    oracle = with_stored_weights(hf_model, *formats)
    model = moerun.load(out, dtype=torch.float32, backend=backend)
    assert rel_err(model.logits(IDS), hf_logits(oracle, IDS)) <= 1e-4


@pytest.mark.parametrize(
    "options, message",
    [
        (["--experts", "q4_x"], r"--experts 'q4_x' is not a format moerun writes; use one of q2_k, .*mxfp4"),
        (["--experts", "q4_k", "--down", "q9"], r"--down 'q9' is not a format"),
        (
            ["--experts", "q4_k", "--rest", "q4_k"],
            r"--rest 'q4_k' is not a format moerun writes for the other 2-D weights; use one of f16, bf16, "
            r"f32, q8_0",
        ),
        (
            ["--experts", "iq2_xxs"],
            r"--experts iq2_xxs: moerun reads iq2_xxs but cannot write it: ggml makes it only with an "
            r"importance matrix .*llama-quantize",
        ),
        (["--experts", "q4_k", "--down", "iq3_s"], r"--down iq3_s: moerun reads iq3_s but cannot write it: "),
        (["--experts", "q4_k", "--rest", "iq1_m"], r"--rest iq1_m: moerun reads iq1_m but cannot write it: "),
    ],
)
def test_unknown_formats_are_refused(checkpoints, tmp_path, capsys, options, message):
    _, src = checkpoints("olmoe", {})
    assert main(["quantize", str(src), str(tmp_path / "model.gguf"), *options]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_what_is_not_a_hugging_face_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["quantize", str(tmp_path / "empty"), str(tmp_path / "a.gguf"), "--experts", "q4_k"]) == 2
    assert "no config.json, so this is not a Hugging Face checkpoint" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "a.gguf"), "--experts", "q4_k"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert main(["quantize", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "--experts", "q4_k"]) == 2
    assert "reads a Hugging Face checkpoint directory" in capsys.readouterr().err


def test_the_checkpoint_s_own_files_are_never_replaced(checkpoints, tmp_path, capsys):
    _, src = checkpoints("olmoe", {})
    inside = tmp_path / "src"
    shutil.copytree(src, inside)
    (inside / "old.gguf").write_bytes(b"part of the checkpoint")
    assert main(["quantize", str(inside), str(inside / "old.gguf"), "--experts", "q8_0", "--force"]) == 2
    assert "is a file of the checkpoint" in capsys.readouterr().err
    assert (inside / "old.gguf").read_bytes() == b"part of the checkpoint"
    assert main(["quantize", str(inside), str(tmp_path / "model"), "--experts", "q8_0"]) == 2
    assert "must end in .gguf" in capsys.readouterr().err


def test_a_hub_id_in_the_local_cache_is_read_and_its_blobs_are_never_replaced(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """A cache laid out as huggingface_hub lays it out: snapshot files are links to blobs."""
    _, src = checkpoints("olmoe", {})
    repo = tmp_path / "hub" / "models--org--tiny-olmoe"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate([*sorted(src.iterdir()), src / "model.gguf"]):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(file.read_bytes() if file.exists() else b"a GGUF file of the repository")
        (snapshot / file.name).symlink_to(blob)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    settings.cache_clear()
    try:
        out = tmp_path / "model.gguf"
        assert main(["quantize", "org/tiny-olmoe", str(out), "--experts", "q8_0"]) == 0
        assert gguf.GGUFReader(out).fields["general.name"].contents() == "tiny-olmoe"
        link = snapshot / "model.gguf"
        assert main(["quantize", "org/tiny-olmoe", str(link), "--experts", "q8_0", "--force"]) == 2
        assert "is a file of the checkpoint" in capsys.readouterr().err
        assert link.is_symlink() and link.read_bytes() == b"a GGUF file of the repository"
    finally:
        monkeypatch.delenv("HF_HUB_CACHE")
        settings.cache_clear()


@pytest.mark.parametrize(
    "model_type, config, message",
    [
        (
            "mixtral",
            dict(sliding_window=7),
            r"sliding_windows is \(7, 7, 7\) here but would be \(None, None, None\)",
        ),
        ("qwen2_moe", dict(mlp_only_layers=[1], use_sliding_window=False), r"layers \[1\] have a dense MLP"),
        (
            "qwen2_moe",
            dict(mlp_only_layers=[], use_sliding_window=False, norm_topk_prob=True),
            r"renormalize is True",
        ),
    ],
)
def test_models_a_gguf_arch_cannot_hold_are_refused(model_type, config, message, tmp_path, capsys):
    src = save_model(make_model(model_type, **config), tmp_path / "src")
    assert main(["quantize", str(src), str(tmp_path / "model.gguf"), "--experts", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "model.gguf").exists()


def test_families_without_a_gguf_arch_are_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "granitemoe"}')
    assert main(["quantize", str(tmp_path), str(tmp_path / "model.gguf"), "--experts", "q4_k"]) == 2
    assert "cannot write granitemoe models as GGUF; it writes mixtral, qwen2_moe" in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_json_gets_no_tokenizer_keys(tmp_path, capsys):
    src = save_model(make_model("olmoe"), tmp_path / "src")
    out = tmp_path / "model.gguf"
    assert main(["quantize", str(src), str(out), "--experts", "q8_0", "--rest", "f32"]) == 0
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert not [key for key in GGUFFile(out).metadata if key.startswith("tokenizer.")]
