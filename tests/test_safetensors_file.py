"""The safetensors reader against files written by the safetensors package and by transformers'
`save_pretrained` (sharded), hand-written headers for the cases those writers never produce, and every
malformed file it must refuse with a CheckpointError naming the file."""

import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moerun.loader import CheckpointError, SafetensorsCheckpoint, SafetensorsFile


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    tensors = {
        "f64": x.double(),
        "f32": x,
        "f16": x.half(),
        "bf16": x.bfloat16(),
        "i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (7,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (2, 2, 2), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "f8_e4m3": x.to(torch.float8_e4m3fn),
        "f8_e5m2": x.to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    return tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None) -> None:
    """A safetensors file with a hand-written header (padded with spaces to 8 bytes, as writers do)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "sample.safetensors"
    tensors = sample_tensors()
    save_file(tensors, path, metadata={"format": "pt", "note": "héllo"})
    return path, tensors


def test_reads_what_the_safetensors_package_wrote(written):
    path, tensors = written
    f = SafetensorsFile(path)
    with safe_open(path, "pt") as ref:
        assert sorted(f.names()) == sorted(ref.keys())
        assert f.metadata == ref.metadata() == {"format": "pt", "note": "héllo"}
    for name, expected in tensors.items():
        got = f.tensor(name)
        assert f.dtype(name) == got.dtype == expected.dtype, name
        assert f.shape(name) == tuple(got.shape) == tuple(expected.shape), name
        assert torch.equal(bits(got), bits(expected)), name


def test_tensors_are_views_of_the_mapped_file(written):
    f = SafetensorsFile(written[0])
    a, b = f.tensor("f32"), f.tensor("f32")
    assert a.data_ptr() == b.data_ptr()
    assert a.untyped_storage().data_ptr() == f.tensor("u8").untyped_storage().data_ptr()


def test_reading_and_writing_into_tensors_never_changes_the_file(written):
    path, tensors = written
    before = sha(path)
    f = SafetensorsFile(path)
    f.tensor("f32").fill_(7.0)
    f.tensor("u8").zero_()
    assert sha(path) == before
    assert torch.equal(SafetensorsFile(path).tensor("f32"), tensors["f32"])


def test_a_misaligned_tensor_is_copied(tmp_path):
    path = tmp_path / "odd.safetensors"
    header = {
        "byte": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "pair": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }
    write_raw(path, header, b"\x05" + struct.pack("<2f", 1.5, -2.0))
    f = SafetensorsFile(path)
    assert f.metadata == {}
    assert f.tensor("byte").tolist() == [5]
    assert f.tensor("pair").tolist() == [1.5, -2.0]


def test_sharded_checkpoint_written_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert len(ckpt.files) > 1
    assert ckpt.files[0].name.startswith("model-00001-of-")
    state = model.state_dict()
    assert sorted(ckpt.names()) == sorted(state)
    for name, expected in state.items():
        assert ckpt.shape(name) == tuple(expected.shape) and ckpt.dtype(name) == expected.dtype
        assert torch.equal(ckpt.tensor(name), expected), name
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert {ckpt._file(name).path.name for name in index["weight_map"]} == {p.name for p in ckpt.files}


def test_checkpoint_from_a_file_a_directory_or_an_index(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2, dtype=torch.int32)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"k": "v"})
    for where in [tmp_path, tmp_path / "model.safetensors"]:
        ckpt = SafetensorsCheckpoint(where)
        assert ckpt.files == [tmp_path / "model.safetensors"] and ckpt.metadata == {"k": "v"}
        assert all(torch.equal(ckpt.tensor(n), t) for n, t in tensors.items())
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"a": tensors["a"]}, shards / "one.safetensors", metadata={"first": "1"})
    save_file({"b": tensors["b"], "unlisted": torch.zeros(1)}, shards / "two.safetensors")
    (shards / "w.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"b": "two.safetensors", "a": "one.safetensors"}})
    )
    ckpt = SafetensorsCheckpoint(shards / "w.safetensors.index.json")
    assert ckpt.names() == ["b", "a"] and "unlisted" not in ckpt
    assert ckpt.metadata == {"first": "1"}
    assert all(torch.equal(ckpt.tensor(n), t) for n, t in tensors.items())


F32_PAIR = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
BAD_HEADERS = {
    "unknown dtype": ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, "'x' has dtype 'Q4'"),
    "size mismatch": ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12 bytes"),
    "bad shape": ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "'x' has shape"),
    "reversed offsets": ({"x": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, "data_offsets"),
    "missing key": ({"x": {"dtype": "F32", "shape": [2]}}, "needs 'dtype', 'shape' and 'data_offsets'"),
    "metadata not str": ({**F32_PAIR, "__metadata__": {"n": 1}}, "'__metadata__'"),
    "beyond the end": (
        {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        "truncated: tensor 'x'",
    ),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_header_entries_are_refused(tmp_path, case):
    header, expected = BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, bytes(8))
    with pytest.raises(CheckpointError, match=expected) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "contents, expected",
    [
        (b"\x01\x00\x00", "too few"),
        (struct.pack("<Q", 10**9) + b"{}", "over the 100000000-byte limit"),
        (struct.pack("<Q", 100) + b"{}      ", "runs past the end"),
        (struct.pack("<Q", 8) + b"{not js}", "not valid JSON"),
        (struct.pack("<Q", 8) + b"\xff\xfe{}    ", "not UTF-8 text"),
        (struct.pack("<Q", 8) + b"[1, 2]  ", "holds a JSON array, not an object"),
    ],
)
def test_malformed_files_are_refused(tmp_path, contents, expected):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(contents)
    with pytest.raises(CheckpointError, match=expected) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


def test_truncated_copies_are_refused(written, tmp_path):
    path, _ = written
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    offsets = {name: entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"}
    for cut in [0, 5, 8, 8 + n // 2, 8 + n, 8 + n + 100, len(data) - 1]:
        short = tmp_path / f"cut{cut}.safetensors"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            SafetensorsFile(short)
        assert str(short) in str(e.value)
        if cut >= 8 + n:  # the first tensor in the file that the cut reaches is named
            first = min((o[0], name) for name, o in offsets.items() if 8 + n + o[1] > cut)[1]
            assert f"truncated: tensor {first!r}" in str(e.value)


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    save_file({"a": torch.zeros(2)}, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match="it holds c.safetensors but no index"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        SafetensorsCheckpoint(tmp_path / "absent")

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "c.safetensors", "b": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard 'gone.safetensors' \(holding tensor 'b'\) is not in"):
        SafetensorsCheckpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "c.safetensors", "c": "c.safetensors"}}))
    with pytest.raises(CheckpointError, match="names tensor 'c' in shard 'c.safetensors', which has no"):
        SafetensorsCheckpoint(tmp_path)
    index.write_text("{}")
    with pytest.raises(CheckpointError, match="'weight_map'") as e:
        SafetensorsCheckpoint(tmp_path)
    assert str(index) in str(e.value)
    with pytest.raises(CheckpointError, match="has no tensor named 'zz'") as e:
        SafetensorsCheckpoint(tmp_path / "c.safetensors").tensor("zz")
    assert "c.safetensors" in str(e.value)
