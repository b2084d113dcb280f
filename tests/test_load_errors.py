"""Bad checkpoints and bad requests through `moerun.load`: one clear error each, naming the file,
tensor or setting."""

import json

import pytest
import torch
from hf_models import VOCAB, make_model, save_model
from safetensors.torch import load_file, save_file

import moerun
from moerun.decoder.model import ContextError
from moerun.loader import CheckpointError
from moerun.moe.layer import StateDictError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe")
    save_model(make_model("olmoe"), path, original_format=False)
    return path


def _copy(saved, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(saved / "model.safetensors")
    config = json.loads((saved / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_truncated_safetensors_names_the_file_and_a_tensor(saved, tmp_path):
    data = (saved / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        moerun.load(tmp_path)


def test_corrupt_header_names_the_file(saved, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        moerun.load(tmp_path)


def test_unknown_architecture(saved, tmp_path):
    path = _copy(saved, tmp_path, edit_config=lambda c: c.update(model_type="llama4_text"))
    with pytest.raises(CheckpointError, match=r"config\.json.*llama4_text"):
        moerun.load(path)


def test_missing_and_misshaped_tensors_are_listed_together(saved, tmp_path):
    def edit(t):
        del t["model.layers.0.self_attn.q_proj.weight"]
        del t["model.layers.2.mlp.gate.weight"]
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"][
            :, :, :-1
        ].clone()
        t["model.layers.1.extra.weight"] = torch.zeros(3)

    with pytest.raises(StateDictError) as err:
        moerun.load(_copy(saved, tmp_path, edit_tensors=edit), dtype=torch.float32)
    message = str(err.value)
    for name in (
        "layers.0.attn.q.weight",
        "layers.2.moe.router.weight",
        "layers.1.moe.experts.down",
        "extra",
    ):
        assert name in message


def test_no_config_json(saved, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((saved / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="config.json"):
        moerun.load(tmp_path)


def test_sequence_longer_than_the_context(saved, tmp_path):
    path = _copy(saved, tmp_path, edit_config=lambda c: c.update(max_position_embeddings=16))
    model = moerun.load(path, dtype=torch.float32)
    with pytest.raises(ContextError, match="context of 16"):
        model.logits(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ContextError, match="context of 16"):
        next(model.generate(list(range(17)), max_new_tokens=1))
    # a prompt that fits generates until the context is full, then stops
    assert len(list(model.generate(list(range(10)), max_new_tokens=50))) == 6


def test_token_ids_outside_the_vocabulary(saved):
    model = moerun.load(saved, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB}"):
        model.logits(torch.tensor([[1, VOCAB]]))
