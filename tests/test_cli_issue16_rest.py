"""Paths and what `moerun inspect` says of a checkpoint's text side: a file that is neither a checkpoint
directory nor a GGUF file is refused naming the file (not its directory), files inside a checkpoint
directory still open it, and inspect says whether a tokenizer and a chat template are there."""

import json
import subprocess
import sys

import pytest
from gguf_from_hf import write_gguf
from hf_models import make_model, save_model
from tiny_tokenizers import CHATML, add_gguf_vocab, byte_level_tokenizer, save_hf_dir

from moerun.cli.main import main

NEITHER = "neither a checkpoint directory nor a GGUF file"


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A tiny checkpoint without tokenizer files."""
    path = tmp_path_factory.mktemp("bare")
    save_model(make_model("qwen3_moe"), path)
    return path


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["generate", "inspect", "perplexity"])
@pytest.mark.parametrize("where", ["alone", "in a checkpoint"])
def test_a_file_that_is_no_checkpoint_is_named(command, where, bare, tmp_path, capsys, monkeypatch):
    """notes.txt alone gave ".: no config.json" (its directory); in a checkpoint directory, a
    safetensors header error."""
    notes = (tmp_path if where == "alone" else bare) / "notes.txt"
    notes.write_text("some notes\n")
    monkeypatch.chdir(notes.parent)
    argv = {
        "generate": ["generate", "-m", "notes.txt", "--prompt-ids", "1,2", "-n", "1"],
        "inspect": ["inspect", "notes.txt"],
        "perplexity": ["perplexity", "-m", "notes.txt", "-f", "notes.txt"],
    }[command]
    err = _one_line(capsys, argv)
    assert f"notes.txt: {NEITHER}" in err and "config.json:" not in err and ".: " not in err


def test_a_file_that_is_no_checkpoint_in_a_subprocess(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes\n")
    run = subprocess.run(
        [sys.executable, "-m", "moerun", "generate", "--model", str(notes), "-p", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.strip() == (
        f"moerun generate: {notes}: {NEITHER}; give a Hugging Face checkpoint directory (config.json and "
        ".safetensors files) or a file whose name ends in .gguf."
    )


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_inside_a_checkpoint_directory_opens_it(name, bare, capsys):
    assert main(["generate", "-m", str(bare / name), "--prompt-ids", "1,2", "-n", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 2
    assert main(["inspect", str(bare / name), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "qwen3_moe"


def _inspect(capsys, path) -> tuple[dict, str]:
    assert main(["inspect", str(path), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("text ")]
    return described, line.removeprefix("text").strip()


def test_inspect_says_a_checkpoint_has_no_tokenizer(bare, capsys):
    d, line = _inspect(capsys, bare)
    assert (d["tokenizer"], d["chat_template"], d["tokenizer_note"]) == (None, None, None)
    assert line == "no tokenizer (token ids only); no chat template"


@pytest.mark.parametrize("template_in", ["tokenizer_config.json", "chat_template.jinja", "named", "none"])
def test_inspect_names_the_tokenizer_and_chat_template_files(template_in, tmp_path, capsys):
    config = {"eos_token": "<|im_end|>"}
    if template_in == "tokenizer_config.json":
        config["chat_template"] = CHATML
    if template_in == "named":  # transformers' named templates: the "default" one is used
        config["chat_template"] = [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": CHATML},
        ]
    tok = byte_level_tokenizer("qwen2")
    save_hf_dir(tok, tmp_path, **config)
    if template_in == "chat_template.jinja":
        (tmp_path / "chat_template.jinja").write_text(CHATML)
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size()), tmp_path)
    d, line = _inspect(capsys, tmp_path)
    where = {"named": "tokenizer_config.json", "none": None}.get(template_in, template_in)
    assert (d["tokenizer"], d["chat_template"]) == ("tokenizer.json", where)
    template = f"chat template in {where}" if where else "no chat template"
    assert line == f"tokenizer in tokenizer.json; {template}"


def test_inspect_says_why_a_tokenizer_is_not_read(tmp_path, capsys):
    save_model(make_model("qwen3_moe"), tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    d, line = _inspect(capsys, tmp_path)
    assert (d["tokenizer"], d["chat_template"]) == (None, None)
    assert "tokenizer_config.json: not valid JSON" in d["tokenizer_note"] and d["tokenizer_note"] in line
    (tmp_path / "tokenizer_config.json").unlink()
    d, line = _inspect(capsys, tmp_path)
    note = "tokenizer.model alone: moerun reads tokenizer.json"
    assert line == f"no tokenizer (token ids only); no chat template ({note})"


@pytest.mark.parametrize("template", [CHATML, None])
def test_inspect_reads_a_gguf_file_s_tokenizer_keys(template, tmp_path, capsys):
    tok = byte_level_tokenizer("gpt2")
    hf_model = make_model("olmoe", vocab_size=tok.get_vocab_size())
    path = tmp_path / "model.gguf"
    write_gguf(
        hf_model, path, extra=lambda w: add_gguf_vocab(w, tok, "gpt2", pre="gpt-2", chat_template=template)
    )
    d, line = _inspect(capsys, path)
    tokenizer = f"tokenizer.ggml.* (gpt2, {tok.get_vocab_size()} tokens)"
    assert d["tokenizer"] == tokenizer
    assert d["chat_template"] == ("tokenizer.chat_template" if template else None)
    assert line == f"tokenizer in {tokenizer}; " + (
        "chat template in tokenizer.chat_template" if template else "no chat template"
    )
    bare = tmp_path / "bare.gguf"
    write_gguf(hf_model, bare)
    d, line = _inspect(capsys, bare)
    assert (d["tokenizer"], d["chat_template"]) == (None, None)
