"""The format table against the gguf package's, and QTensor's checks of shapes and bytes."""

import gguf
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from moerun.quant.formats import FORMATS, FormatError, QTensor, get_format


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.ggml_type is not None])
def test_block_sizes_match_gguf(name):
    fmt = FORMATS[name]
    qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    assert qtype.name.lower() == name
    assert GGML_QUANT_SIZES[qtype] == (fmt.block_size, fmt.block_bytes)


def test_qtensor_expert_is_a_contiguous_slice():
    data = torch.arange(3 * 4 * 144, dtype=torch.int64).remainder(256).to(torch.uint8)
    q = QTensor.from_bytes("q4_k", (3, 4, 256), data)
    assert q.data.shape == (3, 4, 144)
    expert = q.expert(1)
    assert expert.shape == (4, 256) and expert.data.is_contiguous()
    assert torch.equal(expert.data.flatten(), data[4 * 144 : 8 * 144])


def test_row_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(FormatError, match=r"row of 100 elements cannot be stored as q8_0.*multiple of 32"):
        QTensor.from_bytes("q8_0", (2, 100), torch.zeros(2 * 4 * 34, dtype=torch.uint8))


def test_byte_count_must_match_the_shape():
    with pytest.raises(FormatError, match=r"q8_0 tensor of shape \(2, 64\) needs 136 bytes, got 135"):
        QTensor.from_bytes("q8_0", (2, 64), torch.zeros(135, dtype=torch.uint8))


def test_unknown_format_is_named():
    with pytest.raises(FormatError, match="Unknown weight format 'q7_k'"):
        get_format("q7_k")


def test_qtensor_refuses_wrong_dtype():
    with pytest.raises(FormatError, match="needs uint8 bytes"):
        QTensor(FORMATS["q8_0"], (1, 32), torch.zeros(1, 34, dtype=torch.int8))
