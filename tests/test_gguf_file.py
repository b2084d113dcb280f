"""The GGUF reader against files written by the gguf package's GGUFWriter: metadata and tensor infos
equal to GGUFReader's, dense tensors equal to what was written, quantised tensors dequantised by moerun
equal to gguf's numpy dequantisers on the same bytes; and every malformed file it must refuse with a
CheckpointError naming the file."""

import hashlib
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from moerun.errors import TensorError
from moerun.loader import CheckpointError, GGUFFile
from moerun.loader.gguf_file import GGML_TYPES
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor
from moerun.quant.quantize import quantize

SCALARS = {
    "u8": (200, V.UINT8),
    "i8": (-5, V.INT8),
    "u16": (60000, V.UINT16),
    "i16": (-30000, V.INT16),
    "u32": (4_000_000_000, V.UINT32),
    "i32": (-2_000_000_000, V.INT32),
    "f32": (0.1, V.FLOAT32),
    "true": (True, V.BOOL),
    "false": (False, V.BOOL),
    "str": ("héllo", V.STRING),
    "u64": (2**63 + 5, V.UINT64),
    "i64": (-(2**62), V.INT64),
    "f64": (0.1, V.FLOAT64),
}
NUMPY_OF = {
    V.UINT8: np.uint8,
    V.INT8: np.int8,
    V.UINT16: np.uint16,
    V.INT16: np.int16,
    V.UINT32: np.uint32,
    V.INT32: np.int32,
    V.FLOAT32: np.float32,
    V.UINT64: np.uint64,
    V.INT64: np.int64,
    V.FLOAT64: np.float64,
}
STRINGS = ["a", "", "ü", "<0x0A>", "tok"]
QUANT = {"q4_0": T.Q4_0, "q8_0": T.Q8_0, "mxfp4": T.MXFP4}  # bytes from gguf's own quantisers
KQUANT = {"q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}  # from moerun's


def write_gguf(path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A GGUF file with metadata of every value type and tensors of many types; returns the dense
    tensors written (numpy order = torch order) and the raw bytes of the quantised ones."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(f"meta.{key}", value, vtype)
    for vtype, dtype in NUMPY_OF.items():
        values = rng.integers(0, 100, 7).astype(dtype)
        w.add_key_value(f"meta.array.{vtype.name}", values.tolist(), V.ARRAY, sub_type=vtype)
    w.add_key_value("meta.array.BOOL", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("meta.array.STRING", STRINGS, V.ARRAY, sub_type=V.STRING)
    w.add_key_value("meta.nested", [[1, 2], [3]], V.ARRAY)
    w.add_key_value("meta.bad_utf8", b"\xff\xfeab", V.STRING)

    written = {
        "w.f32": rng.standard_normal((3, 8), dtype=np.float32),
        "w.f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "w.f64": rng.standard_normal(5),
        "w.i8": rng.integers(-128, 127, (2, 5), dtype=np.int8),
        "w.i16": rng.integers(-(2**15), 2**15 - 1, 6, dtype=np.int16),
        "w.i32": rng.integers(-(2**31), 2**31 - 1, (3, 2), dtype=np.int32),
        "w.i64": rng.integers(-(2**62), 2**62, 3, dtype=np.int64),
    }
    for name, array in written.items():
        w.add_tensor(name, array)
    raws = {"w.bf16": (T.BF16, gguf.quants.quantize(rng.standard_normal((4, 32), dtype=np.float32), T.BF16))}
    for fmt, qtype in QUANT.items():
        raws[f"w.{fmt}"] = (
            qtype,
            gguf.quants.quantize(rng.standard_normal((2, 3, 64), dtype=np.float32), qtype),
        )
    for fmt, qtype in KQUANT.items():
        raws[f"w.{fmt}"] = (qtype, quantize(torch.randn(2, 256), fmt).data.numpy())
    # Q8_K is a ggml type that no file holds (ggml keeps activations in it) and moerun does not read.
    raws["w.q8_k"] = (T.Q8_K, rng.integers(0, 256, size=(2, 292), dtype=np.uint8))
    for name, (qtype, raw) in raws.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
        written[name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(params=[None, 64], ids=["align32", "align64"])
def written(request, tmp_path):
    path = tmp_path / "model.gguf"
    return path, write_gguf(path, request.param)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patched(path, tmp_path, at: int, new: bytes, name: str = "patched.gguf"):
    data = bytearray(path.read_bytes())
    data[at : at + len(new)] = new
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def info_field(path, name: str) -> int:
    """Offset of the n_dims field of tensor `name`'s info (after its length-prefixed name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return path.read_bytes().rindex(key) + len(key)


def test_metadata_matches_gguf_reader_and_what_was_written(written):
    path, _ = written
    f, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert f.version == 3
    ref_fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(ref_fields)
    for key, field in ref_fields.items():
        if key in ("meta.nested", "meta.bad_utf8"):  # the reader flattens one and cannot decode the other
            continue
        ours, theirs = f.metadata[key], field.contents()
        if isinstance(ours, np.ndarray):
            assert np.array_equal(ours, np.array(theirs)), key
        else:
            assert ours == theirs, key
    for key, (value, vtype) in SCALARS.items():
        expected = float(np.float32(value)) if vtype == V.FLOAT32 else value
        assert f.metadata[f"meta.{key}"] == expected and type(f.metadata[f"meta.{key}"]) is type(value)
    for vtype, dtype in NUMPY_OF.items():
        assert f.metadata[f"meta.array.{vtype.name}"].dtype == dtype
    assert f.metadata["meta.array.BOOL"].tolist() == [True, False, True]
    assert f.metadata["meta.array.STRING"] == STRINGS
    assert [a.tolist() for a in f.metadata["meta.nested"]] == [[1, 2], [3]]
    assert f.metadata["meta.bad_utf8"].encode("utf-8", "surrogateescape") == b"\xff\xfeab"


def test_tensor_infos_and_bytes_match_gguf_reader(written):
    path, _ = written
    f, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert f.tensor_names() == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = f.info(t.name)
        assert info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert (info.ggml_type, info.type_name) == (int(t.tensor_type), t.tensor_type.name), t.name
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert f.raw(t.name).numpy().tobytes() == t.data.tobytes(), t.name


def test_dense_tensors_are_views_in_torch_order(written):
    path, arrays = written
    f = GGUFFile(path)
    for name in ["w.f32", "w.f16", "w.f64", "w.i8", "w.i16", "w.i32", "w.i64"]:
        got = f.tensor(name)
        assert torch.equal(got, torch.from_numpy(arrays[name])), name
        assert got.data_ptr() == f.raw(name).data_ptr(), name
    bf16 = f.tensor("w.bf16")
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (4, 32)
    assert torch.equal(bf16.float(), torch.from_numpy(gguf.quants.dequantize(arrays["w.bf16"], T.BF16)))


@pytest.mark.parametrize("fmt", [*QUANT, *KQUANT])
def test_quantised_tensors_dequantise_as_gguf_does(written, fmt):
    path, arrays = written
    f = GGUFFile(path)
    q = f.tensor(f"w.{fmt}")
    assert isinstance(q, QTensor) and q.format.name == fmt and f.info(f"w.{fmt}").format == fmt
    assert q.data.data_ptr() == f.raw(f"w.{fmt}").data_ptr()
    expected = gguf.quants.dequantize(arrays[f"w.{fmt}"], {**QUANT, **KQUANT}[fmt])
    assert q.shape == expected.shape
    assert torch.equal(dequantize(q), torch.from_numpy(expected))


def test_a_tensor_of_an_unsupported_type_can_be_inspected_but_not_read(written):
    path, arrays = written
    f = GGUFFile(path)
    info = f.info("w.q8_k")
    assert (info.type_name, info.format, info.shape) == ("Q8_K", None, (2, 256))
    assert f.raw("w.q8_k").numpy().tobytes() == arrays["w.q8_k"].tobytes()
    with pytest.raises(CheckpointError, match=r"tensor .w.q8_k. has ggml type Q8_K \(15\), which") as e:
        f.tensor("w.q8_k")
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointError, match="has no tensor named 'absent'"):
        f.info("absent")


def test_a_tensor_with_no_dims_is_refused(written, tmp_path):
    """ggml has no 0-d tensor: an info whose dims list is empty is refused as the infos are read,
    naming the tensor (it was an IndexError once its bytes were asked for)."""
    path, _ = written
    data = path.read_bytes()
    at = info_field(path, "w.q8_0")  # n_dims 3, dims (64, 3, 2), then the type
    out = tmp_path / "no_dims.gguf"
    out.write_bytes(data[:at] + struct.pack("<I", 0) + data[at + 4 + 3 * 8 :])
    with pytest.raises(TensorError, match=r"tensor 'w.q8_0' has no dims; GGUF tensors have 1 to 4") as e:
        GGUFFile(out)
    assert str(out) in str(e.value)


def test_an_unknown_type_or_a_partial_block_is_refused_when_asked_for(written, tmp_path):
    path, _ = written
    at = info_field(path, "w.q8_0")  # n_dims 3, dims (64, 3, 2), then the type
    unknown = GGUFFile(patched(path, tmp_path, at + 4 + 3 * 8, struct.pack("<I", 99)))
    assert unknown.info("w.q8_0").type_name == "unknown" and unknown.info("w.q8_0").nbytes is None
    assert torch.equal(unknown.tensor("w.f32"), GGUFFile(path).tensor("w.f32"))
    for read in (unknown.raw, unknown.tensor):
        with pytest.raises(CheckpointError, match=r"tensor 'w.q8_0' has ggml type unknown \(99\)") as e:
            read("w.q8_0")
        assert str(unknown.path) in str(e.value)
    partial = GGUFFile(patched(path, tmp_path, at + 4, struct.pack("<Q", 48), "partial.gguf"))
    with pytest.raises(
        CheckpointError, match="'w.q8_0' of type Q8_0 has rows of 48 elements, not a multiple"
    ):
        partial.tensor("w.q8_0")


def test_version_2_reads_as_version_3(written, tmp_path):
    path, _ = written
    v2 = GGUFFile(patched(path, tmp_path, 4, struct.pack("<I", 2)))
    assert v2.version == 2 and v2.info("w.q4_k") == GGUFFile(path).info("w.q4_k")


def test_reading_and_writing_into_tensors_never_changes_the_file(written):
    path, arrays = written
    before = sha(path)
    f = GGUFFile(path)
    f.tensor("w.f32").fill_(3.0)
    f.tensor("w.q8_0").data.zero_()
    f.raw("w.q8_k").fill_(1)
    assert sha(path) == before
    assert torch.equal(GGUFFile(path).tensor("w.f32"), torch.from_numpy(arrays["w.f32"]))


def test_ggml_type_table_matches_gguf():
    for ggml_type, (name, block_size, block_bytes) in GGML_TYPES.items():
        assert T(ggml_type).name == name
        if name != "Q8_1":  # gguf-py still has Q8_1's old float-scaled block (40 bytes); ggml's is 36
            assert gguf.GGML_QUANT_SIZES[T(ggml_type)] == (block_size, block_bytes), name


@pytest.mark.parametrize(
    "at, new, expected",
    [
        (0, b"GGUX", r"not a GGUF file: it starts with b'GGUX'"),
        (4, struct.pack("<I", 1), "GGUF version 1 is not supported"),
        (4, struct.pack("<I", 4), "GGUF version 4 is not supported"),
        (4, struct.pack(">I", 3), "big-endian GGUF file"),
    ],
)
def test_bad_headers_are_refused(written, tmp_path, at, new, expected):
    path = patched(written[0], tmp_path, at, new)
    with pytest.raises(CheckpointError, match=expected) as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_a_big_endian_file_written_by_gguf_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="big-endian"):
        GGUFFile(path)


def test_a_bad_alignment_is_refused(tmp_path):
    path = tmp_path / "align.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_key_value("general.alignment", 48, V.UINT32)  # add_custom_alignment refuses it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="general.alignment is 48, not a positive power of two"):
        GGUFFile(path)


def test_truncated_copies_are_refused(written, tmp_path):
    path, _ = written
    data, ref = path.read_bytes(), gguf.GGUFReader(path)
    strings = ref.fields["meta.array.STRING"].offset
    last = max(ref.tensors, key=lambda t: t.data_offset + t.n_bytes)
    cuts = {
        0: "truncated in the header",
        2: "truncated in the header",
        10: "truncated in the header",
        strings + 3: "truncated in metadata key",
        strings + 40: "truncated in the value of metadata key 'meta.array.STRING'",
        ref.tensors[0].field.offset + 10: "truncated in tensor info 0 of",
        last.data_offset + last.n_bytes - 1: f"truncated: tensor '{last.name}' ends at byte",
    }
    for cut, expected in cuts.items():
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=expected) as e:
            GGUFFile(short)
        assert str(short) in str(e.value)
