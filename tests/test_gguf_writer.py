"""Our GGUF writer against the gguf package's reader (an independent one) and our own."""

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType

from moerun.export.gguf_writer import FLOAT32, INT32, UINT64, GGUFWriter
from moerun.loader import CheckpointError, GGUFFile
from moerun.quant.dequant import dequantize
from moerun.quant.quantize import quantize


def _writer():
    gen = torch.Generator().manual_seed(0)
    w = GGUFWriter()
    w.add("general.architecture", "olmoe")
    w.add("olmoe.block_count", 3)
    w.add("olmoe.attention.layer_norm_rms_epsilon", 1e-5)
    w.add("tokenizer.ggml.add_bos_token", True)
    w.add("big", 2**40, UINT64)
    w.add("tokenizer.ggml.tokens", ["<s>", "é", "日本", "▁a"])
    w.add("tokenizer.ggml.scores", np.array([0.0, -1.5, -2.0, -3.25], dtype=np.float32))
    w.add("tokenizer.ggml.token_type", [3, 1, 1, 1], elem_type=INT32)
    w.add("temperature", 0.5, FLOAT32)
    tensors = {
        "a.f32": torch.randn(5, 7, generator=gen),
        "b.f16": torch.randn(3, 4, generator=gen).half(),
        "c.bf16": torch.randn(2, 3, 6, generator=gen).bfloat16(),
        "d.q4_k": quantize(torch.randn(2, 3, 512, generator=gen), "q4_k"),
        "e.mxfp4": quantize(torch.randn(4, 64, generator=gen), "mxfp4"),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    return w, tensors


def test_the_gguf_package_reads_what_we_write(tmp_path):
    w, tensors = _writer()
    path = w.write(tmp_path / "out.gguf")
    reader = GGUFReader(path)
    fields = reader.fields
    assert fields["general.architecture"].contents() == "olmoe"
    assert fields["olmoe.block_count"].types == [GGUFValueType.UINT32]
    assert fields["olmoe.block_count"].contents() == 3
    assert fields["big"].contents() == 2**40
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert fields["tokenizer.ggml.tokens"].contents() == ["<s>", "é", "日本", "▁a"]
    assert fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert fields["tokenizer.ggml.scores"].contents() == [0.0, -1.5, -2.0, -3.25]
    theirs = {t.name: t for t in reader.tensors}
    for name, tensor in tensors.items():
        expected = tensor.data if hasattr(tensor, "format") else tensor
        raw = np.asarray(theirs[name].data).view(np.uint8).reshape(-1)
        assert bytes(raw) == expected.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_our_reader_round_trips(tmp_path):
    w, tensors = _writer()
    f = GGUFFile(w.write(tmp_path / "out.gguf"))
    assert f.metadata["olmoe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    for name, tensor in tensors.items():
        ours = f.tensor(name)
        if hasattr(tensor, "format"):
            assert ours.format == tensor.format and ours.shape == tensor.shape
            assert torch.equal(dequantize(ours), dequantize(tensor))
        else:
            assert ours.dtype == tensor.dtype and torch.equal(ours, tensor)


def test_never_writes_over_a_file_unless_forced(tmp_path):
    target = tmp_path / "out.gguf"
    target.write_bytes(b"user data")
    w, _ = _writer()
    with pytest.raises(CheckpointError, match="exists"):
        w.write(target)
    assert target.read_bytes() == b"user data"
    w.write(target, force=True)
    assert GGUFFile(target).metadata["general.architecture"] == "olmoe"


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    w, _ = _writer()

    def fail(source, target, length=0):
        target.write(source.read(100))  # part of the data section
        raise KeyboardInterrupt

    monkeypatch.setattr("moerun.export.gguf_writer.shutil.copyfileobj", fail)
    with pytest.raises(KeyboardInterrupt):
        w.write(tmp_path / "out.gguf")
    assert list(tmp_path.iterdir()) == []
