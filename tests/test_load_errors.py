"""Bad checkpoints and bad requests through `moerun.load`: one clear error each, naming the file,
tensor or setting."""

import json
import re
import warnings
from pathlib import Path

import gguf
import pytest
import torch
from fuzz_checkpoints import MAX_MESSAGE
from gguf_from_hf import write_gguf
from hf_models import VOCAB, make_model, save_model
from safetensors.torch import load_file, save_file
from tiny_tokenizers import add_gguf_vocab, byte_level_tokenizer, save_hf_dir

import moerun
from moerun.checkpoint.describe import describe
from moerun.cli.main import main as cli
from moerun.decoder.model import ContextError
from moerun.errors import CheckpointError, ConfigError, TensorError
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


# ---------------------------------------------------------------------------------------------
# Regressions from the checkpoint fuzz (docs/RELIABILITY.md): each input that found a bug, rebuilt
# small here. Every refusal is a CheckpointError of one sentence naming the file and the field or
# tensor, with the value and what is allowed.


def _refused(path, error: type, pattern: str, load=moerun.load) -> str:
    with pytest.raises(error, match=pattern) as err:
        load(path)
    message = str(err.value)
    assert isinstance(err.value, CheckpointError) and len(message) <= MAX_MESSAGE, message
    return message


def _set(key, value):
    def edit(config):
        config[key] = value

    return edit


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            _set("num_hidden_layers", 10**9),
            r"num_hidden_layers is 1000000000; it must be an integer in \[1, 1024\]",
        ),
        (
            _set("num_hidden_layers", 2**62),
            r"num_hidden_layers is 4611686018427387904; it must be an integer",
        ),
        (_set("num_experts_per_tok", 9), r"num_experts_per_tok=9 must lie in \[1, 8\]"),
        (_set("num_experts_per_tok", 0), r"num_experts_per_tok is 0; it must be an integer in \[1, 1024\]"),
        (_set("hidden_size", "32"), r"hidden_size is '32'; it must be an integer in \[1, 65536\]"),
        (lambda c: c.pop("num_attention_heads"), r"num_attention_heads is missing"),
        (_set("rms_norm_eps", -1.0), r"rms_norm_eps is -1.0; it must be a finite number in \(0, 1\]"),
        (_set("rms_norm_eps", ""), r"rms_norm_eps is ''; it must be a finite number"),
        (_set("max_position_embeddings", 0), r"max_position_embeddings is 0; it must be an integer in \[1, "),
        (_set("clip_qkv", -3.0), r"clip_qkv is -3.0; it must be a finite number in \(0, "),
        (_set("hidden_act", "relu6"), r"hidden_act is 'relu6'; it must be one of \["),
        (_set("num_experts", "ü"), r"num_experts is 'ü'; it must be an integer"),
        (_set("vocab_size", None), r"vocab_size is null; it must be an integer"),
        (
            _set("num_experts_per_tok", None),
            r"num_experts_per_tok is null; it must be an integer in \[1, 1024\]",
        ),
        (
            lambda c: c["rope_parameters"].update(rope_theta=0),
            r"rope_parameters\.rope_theta is 0; it must be",
        ),
        (
            lambda c: c["rope_parameters"].update(rope_type="dynamic"),
            r"rope_parameters\.rope_type is 'dynamic'",
        ),
        (_set("num_key_value_heads", 3), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ],
)
def test_config_fields_are_checked_at_load(saved, tmp_path, edit, pattern):
    path = _copy(saved, tmp_path, edit_config=edit)
    message = _refused(path, ConfigError, rf"config\.json: {pattern}")
    assert message == _refused(path, ConfigError, pattern, load=describe)  # inspect says the same


@pytest.mark.parametrize(
    "text, pattern",
    [
        ('{"model_type": "olmoe", "hidden_size": ' + "9" * 5000 + "}", r"not valid JSON \(Exceeds the limit"),
        (
            '{"model_type": "olmoe", "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
            r"the JSON is nested deeper than moerun reads",
        ),
        ("[]", r"holds a JSON array, not an object"),
        (b"\xff\xfe{}", r"not UTF-8 text"),
    ],
)
def test_config_json_that_does_not_parse(saved, tmp_path, text, pattern):
    path = _copy(saved, tmp_path)
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    _refused(path, ConfigError, rf"config\.json: {pattern}")


def _raw_safetensors(path, header_text: str, data: bytes) -> None:
    raw = header_text.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _header(saved):
    data = (saved / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_a_safetensors_header_nested_too_deep(saved, tmp_path):
    header, data = _header(saved)
    path = _copy(saved, tmp_path)
    text = json.dumps(header)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _raw_safetensors(path / "model.safetensors", text, data)
    _refused(path, CheckpointError, r"model\.safetensors: the safetensors header: the JSON is nested deeper")


def test_a_tensor_named_twice_in_a_safetensors_header(saved, tmp_path):
    header, data = _header(saved)
    path = _copy(saved, tmp_path)
    name = "model.norm.weight"
    text = json.dumps(header)[:-1] + f', "{name}": {json.dumps(header[name])}}}'
    _raw_safetensors(path / "model.safetensors", text, data)
    _refused(
        path, CheckpointError, rf"model\.safetensors: the safetensors header: the key '{name}' appears twice"
    )


def test_overlapping_safetensors_tensors(saved, tmp_path):
    header, data = _header(saved)
    path = _copy(saved, tmp_path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _raw_safetensors(path / "model.safetensors", json.dumps(header), data)
    _refused(path, TensorError, r"model\.safetensors: tensors '.*' and '.*' overlap in the file")


def test_a_shard_outside_the_checkpoint_directory(tmp_path):
    save_model(make_model("olmoe", num_hidden_layers=1), tmp_path, original_format=False)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}})
    )
    _refused(
        tmp_path,
        CheckpointError,
        r"index\.json: 'weight_map' must map tensor names to the names of shard files",
    )


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_model(make_model("mixtral", num_hidden_layers=1), path, original_format=True)
    return path


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            lambda t: t[:, :-1].clone(),
            r"is float32 \[40, 31\] but '.*experts\.0\.w1\.weight' is float32 \[40, 32\]",
        ),
        (lambda t: t.view(torch.int32), r"is int32 \[40, 32\], not a floating-point matrix"),
    ],
)
def test_per_expert_tensors_that_differ(per_expert, tmp_path, change, pattern):
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    path = _copy(per_expert, tmp_path, edit_tensors=lambda t: t.update({name: change(t[name])}))
    _refused(path, TensorError, rf"{tmp_path}: tensor '{re.escape(name)}' {pattern}")


# GGUF files: a tiny OLMoE written as llama.cpp's converter writes it, with metadata set by `edit`.


def _gguf(tmp_path, edit=None) -> Path:
    path = tmp_path / "model.gguf"
    write_gguf(make_model("olmoe", num_hidden_layers=2), path, extra=edit)
    return path


def _metadata(key, value, vtype, sub=None):
    return lambda writer: writer.kv_data[0].update({key: gguf.GGUFValue(value, vtype, sub)})


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            _metadata("olmoe.block_count", 2**32 - 1, V.UINT32),
            r"metadata key olmoe\.block_count is 4294967295; it must be an integer in \[1, 1024\]",
        ),
        (
            _metadata("olmoe.expert_used_count", 0, V.UINT32),
            r"metadata key olmoe\.expert_used_count is 0; it must be an integer in \[1, ",
        ),
        (
            _metadata("olmoe.attention.head_count", 0, V.UINT32),
            r"metadata key olmoe\.attention\.head_count is 0",
        ),
        (
            _metadata("olmoe.attention.head_count", "x", V.STRING),
            r"metadata key olmoe\.attention\.head_count is 'x'",
        ),
        (
            _metadata("general.architecture", ["olmoe"], V.ARRAY, V.STRING),
            r"GGUF architecture \['olmoe'\] is not supported",
        ),
        (
            _metadata("olmoe.rope.freq_base", 0.0, V.FLOAT32),
            r"metadata key olmoe\.rope\.freq_base is 0\.0; it must be a finite number in \(0, ",
        ),
        (
            _metadata("olmoe.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32),
            r"metadata key olmoe\.attention\.layer_norm_rms_epsilon is nan; "
            r"it must be a finite number in \(0, 1\]",
        ),
    ],
)
def test_gguf_metadata_is_checked_at_load(tmp_path, edit, pattern):
    path = _gguf(tmp_path, edit)
    message = _refused(path, ConfigError, rf"model\.gguf: {pattern}")
    assert message == _refused(path, ConfigError, pattern, load=describe)


def _patch_tensor_info(path: Path, part: int, value) -> None:
    """Set part `part` of the second tensor's info in place (5: its offset in the data section)."""
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[1].field.parts[part][0] = value(reader)
    reader.data.flush()


def test_a_misaligned_gguf_tensor(tmp_path):
    path = _gguf(tmp_path)
    _patch_tensor_info(path, 5, lambda r: r.tensors[1].data_offset - r.data_offset + 4)
    _refused(
        path,
        TensorError,
        r"model\.gguf: tensor '.*' starts at offset \d+ of the data section, "
        r"not a multiple of the file's alignment \(32\)",
    )


def test_overlapping_gguf_tensors(tmp_path):
    path = _gguf(tmp_path)
    _patch_tensor_info(path, 5, lambda r: r.tensors[0].data_offset - r.data_offset)
    _refused(path, TensorError, r"model\.gguf: tensors '.*' and '.*' overlap in the file")


def test_a_gguf_name_length_that_swallows_the_file_gives_a_short_message(tmp_path):
    path = _gguf(tmp_path)
    _patch_tensor_info(path, 0, lambda r: 20_000)  # the name now runs 20 kB into the file
    _refused(path, CheckpointError, r"model\.gguf")


# Tokenizer files that cannot be read: the model loads without text support, and says why once.


@pytest.mark.parametrize(
    "name, contents, pattern",
    [
        (
            "tokenizer.json",
            b'{"version": "1.0", "model": {',
            r"tokenizer\.json: the tokenizers library cannot read it",
        ),
        ("tokenizer.json", b"\xff\xfe\x00", r"tokenizer\.json: the tokenizers library cannot read it"),
        ("tokenizer_config.json", b"[]", r"tokenizer_config\.json: holds a JSON array, not an object"),
        ("generation_config.json", b"[]", r"generation_config\.json: holds a JSON array, not an object"),
        (
            "tokenizer_config.json",
            b'{"added_tokens_decoder": {"5": "x"}}',
            r"added_tokens_decoder entry '5' is 'x'",
        ),
    ],
)
def test_a_bad_tokenizer_file_is_one_warning(saved, tmp_path, name, contents, pattern):
    path = _copy(saved, tmp_path)
    save_hf_dir(byte_level_tokenizer(), path, generation_config={"eos_token_id": 2}, eos_token="<|im_end|>")
    assert moerun.load(path).tokenizer is not None  # readable before the edit
    (path / name).write_bytes(contents)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = moerun.load(path, dtype=torch.float32)
    assert model.tokenizer is None and model.logits(torch.tensor([[1, 2]])).isfinite().all()
    assert len(caught) == 1 and re.search(pattern, str(caught[0].message)), [str(w.message) for w in caught]
    assert "loads without a tokenizer" in str(caught[0].message)


def test_a_gguf_vocabulary_with_bad_merges_is_one_warning(tmp_path):
    tok = byte_level_tokenizer()

    def vocab(writer):
        add_gguf_vocab(writer, tok, "gpt2", "gpt2")
        writer.kv_data[0]["tokenizer.ggml.merges"] = gguf.GGUFValue([1, 2, 3], V.ARRAY, V.INT32)

    path = _gguf(tmp_path, vocab)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = moerun.load(path, dtype=torch.float32)
    assert model.tokenizer is None
    assert len(caught) == 1 and "model.gguf: the GGUF vocabulary cannot be rebuilt" in str(caught[0].message)


def test_inspect_errors_name_the_file(saved, tmp_path, capsys):
    path = _copy(saved, tmp_path, edit_config=_set("num_hidden_layers", "3"))
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path / 'config.json'}: num_hidden_layers is '3'" in err and len(err) < MAX_MESSAGE


def test_every_tensor_misshaped_is_still_one_short_sentence(saved, tmp_path):
    """Fuzz seed 1 case 1732 (an expert count that fits no expert tensor, in a deep directory) gave
    a message over 500 characters: now two names per list."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = _copy(saved, deep, edit_config=_set("num_experts", 3))
    message = _refused(path, StateDictError, r"mis-shaped: .*\(\d+ more\)")
    assert str(deep) in message
