"""Blocks whose fp16 scale is inf or NaN: found per format against the gguf package's own values, and
refused at load (resident) or as a streamed expert is read, in one sentence naming the file and tensor."""

import gguf
import numpy as np
import pytest
import torch
from hf_models import make_model

import moerun
from moerun.errors import TensorError
from moerun.offload.store import ExpertReadError
from moerun.quant.formats import FORMATS
from moerun.quant.scales import first_nonfinite_block

SCALED = [n for n, f in FORMATS.items() if f.ggml_type is not None and not f.is_float and n != "mxfp4"]


@pytest.mark.parametrize("name", SCALED)
def test_first_nonfinite_block_is_the_first_block_gguf_decodes_to_inf_or_nan(name):
    """Random bytes: a block's values (gguf's) hold an inf or a NaN exactly where a scale is not
    finite (every value is a finite scale times a bounded integer otherwise)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(3)
    for trial in range(4):
        blocks = rng.integers(0, 256, size=(300, fmt.block_bytes), dtype=np.uint8)
        if trial == 3:  # no block damaged: clear every exponent's top bit (finite scales only)
            blocks[:] = 0
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(fmt.ggml_type))
        bad = ~np.isfinite(values.reshape(300, -1)).all(-1)
        expected = int(bad.argmax()) if bad.any() else None
        assert first_nonfinite_block(fmt, torch.from_numpy(blocks)) == expected, trial


def _damage(path, tensor: str, blocks: list[int]) -> None:
    """Set the first fp16 field (d) of each of `blocks` of `tensor` to +inf (in the test's own file)."""
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == tensor]
    size = FORMATS[t.tensor_type.name.lower()].block_bytes
    data = bytearray(path.read_bytes())
    for block in blocks:
        at = int(t.data_offset) + block * size
        data[at : at + 2] = np.float16(np.inf).tobytes()
    path.write_bytes(bytes(data))


@pytest.fixture
def qwen_gguf(tmp_path):
    from gguf_from_hf import write_gguf

    model = make_model("qwen3_moe", hidden_size=64, intermediate_size=64, moe_intermediate_size=32)
    path = tmp_path / "model.gguf"
    write_gguf(model, path, "q8_0", attention="q8_0")
    return path


def test_a_damaged_attention_block_is_refused_at_load(qwen_gguf):
    _damage(qwen_gguf, "blk.1.attn_q.weight", [5])
    with pytest.raises(TensorError, match=r"block 5 has a scale that is not a number") as e:
        moerun.load(qwen_gguf, dtype=torch.float32)
    assert f"{qwen_gguf}: tensor 'blk.1.attn_q.weight' (q8_0): block 5 has" in str(e.value)


def test_a_damaged_expert_block_is_refused_resident_and_when_streamed(qwen_gguf):
    per_expert = 64 * 32 // 32  # down [64, 32] in q8_0: 64 blocks of 32
    _damage(qwen_gguf, "blk.0.ffn_down_exps.weight", [e * per_expert + 7 for e in range(8)])
    with pytest.raises(TensorError, match=r"block 7 has a scale that is not a number") as e:
        moerun.load(qwen_gguf, dtype=torch.float32, backend="torch")  # joined copies: checked at load
    assert str(qwen_gguf) in str(e.value)
    in_place = moerun.load(qwen_gguf, dtype=torch.float32, backend="cpu")  # each expert as first used
    with pytest.raises(
        TensorError, match=r"layers\.0\.moe: expert \d+'s down weights \(q8_0\): block 7 has a"
    ):
        in_place.logits(torch.arange(8)[None])
    model = moerun.load(qwen_gguf, dtype=torch.float32, expert_cache_gb=4e-5)
    try:
        with pytest.raises(ExpertReadError, match=r"expert \d+ of .*down: block 7 has a scale that") as e:
            model.logits(torch.arange(8)[None])
        assert str(qwen_gguf) in str(e.value)
    finally:
        model.close()
