"""A checkpoint is untrusted input: moerun never unpickles anything while reading one, and never
writes to it or beside it. Checked on a checkpoint of every format the fuzz uses (fuzz_checkpoints:
safetensors with tokenizer files, shards, GPT-OSS MXFP4, GGUF with vocabularies), through loading,
logits, text generation, expert streaming and `moerun inspect`."""

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fuzz_checkpoints import build_seeds, snapshot

import moerun
from moerun.cli.main import main as cli
from moerun.loader import GGUFFile, SafetensorsCheckpoint

TESTS = Path(__file__).parent


def _use(path: Path) -> None:
    """Everything a user does with a checkpoint: load (resident and streamed), logits, generate
    (decoding text where it has a tokenizer), inspect."""
    for streamed in (None, 0.0005):
        model = moerun.load(path, dtype=torch.float32, expert_cache_gb=streamed)
        assert torch.isfinite(model.logits(torch.tensor([[1, 2, 3]]))).all()
        text = "".join(t.text for t in model.generate([1, 2], max_new_tokens=2))  # decoded where it can
        assert isinstance(text, str)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["inspect", str(path)]) == 0


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return build_seeds(tmp_path_factory.mktemp("untrusted"))


def test_checkpoints_are_never_written(seeds):
    directories = {name: (p if p.is_dir() else p.parent) for name, p in seeds.items()}
    before = {
        name: (snapshot(d), {p.name: p.stat().st_mtime_ns for p in d.iterdir()})
        for name, d in directories.items()
    }
    modes = {p: p.stat().st_mode for d in directories.values() for p in [d, *d.iterdir()]}
    try:
        for p, mode in modes.items():  # read-only, as a shared model directory often is
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        for path in seeds.values():
            _use(path)
            # writing into what the readers hand out changes a private copy, never the file
            if path.suffix == ".gguf":
                gguf = GGUFFile(path)
                for tensor_name in gguf.tensor_names():
                    gguf.raw(tensor_name).fill_(0xFF)
            else:
                checkpoint = SafetensorsCheckpoint(path)
                for tensor_name in checkpoint.names():
                    checkpoint.tensor(tensor_name).view(torch.uint8).fill_(0xFF)
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    after = {
        name: (snapshot(d), {p.name: p.stat().st_mtime_ns for p in d.iterdir()})
        for name, d in directories.items()
    }
    assert after == before


# Run in a fresh interpreter: the checkpoints are built first, then every use of pickle from here on
# is recorded (the pickle.find_class audit event, and the pickle module's entry points). A control
# unpickle at the end shows the recording works.
_WATCH = r"""
import collections, json, pickle, sys, _pickle, traceback
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fuzz_checkpoints import build_seeds
from test_untrusted_files import _use

seeds = build_seeds(Path(sys.argv[2]))
calls, control = [], []

def record(what):
    (control if controlling else calls).append((what, traceback.format_stack(limit=6)[:-2]))

def hook(event, args):
    if event == "pickle.find_class":
        record(f"find_class {args}")

def watched(module, name):
    original = getattr(module, name)
    def call(*args, **kwargs):
        record(f"{module.__name__}.{name}")
        return original(*args, **kwargs)
    setattr(module, name, call)

controlling = False
sys.addaudithook(hook)
for module in (pickle, _pickle):
    for name in ("load", "loads", "Unpickler"):
        watched(module, name)
for path in seeds.values():
    _use(path)
controlling = True
pickle.loads(pickle.dumps(collections.OrderedDict(a=1)))
print(json.dumps({"calls": calls, "control": len(control)}))
"""


def test_nothing_is_unpickled_while_reading_checkpoints(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}"}
    out = subprocess.run(
        [sys.executable, "-c", _WATCH, str(TESTS), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["control"] >= 1  # the recording sees an unpickle
    assert result["calls"] == []
