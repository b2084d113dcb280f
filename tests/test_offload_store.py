"""ExpertStore reading `ExpertPieces` recipes straight from a file, each against the joined tensor
built in RAM by plain torch ops: rows stacked from per-expert tensors, rows interleaved (preadv
scatter), dtype conversion and transposition through a staging buffer, GPT-OSS MXFP4 regrouping.
(The file reads themselves: test_file_reads.py; a file cut short under the store: test_offload_cache.)"""

import pytest
import torch
from safetensors.torch import save_file

from moerun.loader import SafetensorsFile
from moerun.loader.mapped import MappedFile
from moerun.offload import ExpertStore
from moerun.offload.pieces import MXFP4_GPT_OSS, ExpertPieces, Piece
from moerun.quant.formats import get_format
from moerun.quant.mxfp4_layouts import gpt_oss_layout_bytes

E, I, H = 5, 6, 64


def _saved(tmp_path, tensors: dict[str, torch.Tensor]) -> SafetensorsFile:
    path = tmp_path / "pieces.safetensors"
    save_file(tensors, path)
    return SafetensorsFile(path)


def _read_all(f: SafetensorsFile, gate_up, down, dtype) -> list[dict[str, torch.Tensor]]:
    store = ExpertStore({"l": {"gate_up": gate_up, "down": down}}, dtype, [MappedFile(f.path, f.mapped)])
    assert store.file_backed("l") == {"gate_up": True, "down": True}
    out = []
    for e in range(E):
        dests = store.empty("l")
        store.read_into(("l", e), dests)
        out.append(dests)
    store.close()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["as-stored", "converted"])
@pytest.mark.parametrize("interleave", [False, True], ids=["gate-then-up", "interleaved"])
def test_per_expert_rows_joined_from_the_file(tmp_path, dtype, interleave):
    gen = torch.Generator().manual_seed(0)
    gate, up, down = (
        torch.randn(E, rows, cols, generator=gen).bfloat16() for rows, cols in ((I, H), (I, H), (H, I))
    )
    f = _saved(
        tmp_path, {f"{n}.{e}": t[e] for n, t in (("g", gate), ("u", up), ("d", down)) for e in range(E)}
    )
    views = {n: [f.tensor(f"{n}.{e}") for e in range(E)] for n in "gud"}
    if interleave:
        pieces = (Piece(views["g"], row=0, step=2), Piece(views["u"], row=1, step=2))
        want = torch.stack([gate, up], dim=-2).flatten(-3, -2)  # gate row j at 2j, up row j at 2j + 1
    else:
        pieces = (Piece(views["g"]), Piece(views["u"], row=I))
        want = torch.cat([gate, up], dim=-2)
    gate_up = ExpertPieces((E, 2 * I, H), torch.bfloat16, None, pieces)
    down_pieces = ExpertPieces((E, H, I), torch.bfloat16, None, (Piece(views["d"]),))
    for e, got in enumerate(_read_all(f, gate_up, down_pieces, dtype)):
        assert torch.equal(got["gate_up"], want[e].to(dtype))
        assert torch.equal(got["down"], down[e].to(dtype))


def test_transposed_experts_are_read_whole_and_transposed(tmp_path):
    gen = torch.Generator().manual_seed(1)
    stored = {"gate_up": torch.randn(E, H, 2 * I, generator=gen), "down": torch.randn(E, I, H, generator=gen)}
    f = _saved(tmp_path, stored)
    got = _read_all(
        f, f.tensor("gate_up").transpose(-1, -2), f.tensor("down").transpose(-1, -2), torch.float32
    )
    for e in range(E):
        assert torch.equal(got[e]["gate_up"], stored["gate_up"][e].T)
        assert torch.equal(got[e]["down"], stored["down"][e].T)


def test_gpt_oss_mxfp4_blocks_and_scales_regrouped_per_expert(tmp_path):
    gen = torch.Generator().manual_seed(2)
    names = {"gate_up": (2 * I, H), "down": (H, 2 * 32)}
    stored = {}
    for name, (rows, cols) in names.items():
        stored[f"{name}_blocks"] = torch.randint(
            0, 256, (E, rows, cols // 32, 16), generator=gen, dtype=torch.uint8
        )
        stored[f"{name}_scales"] = torch.randint(
            100, 140, (E, rows, cols // 32), generator=gen, dtype=torch.uint8
        )
    f = _saved(tmp_path, stored)
    fmt = get_format("mxfp4_gpt_oss")
    pieces = {
        name: ExpertPieces(
            (E, rows, cols),
            torch.uint8,
            fmt,
            (Piece(f.tensor(f"{name}_blocks")), Piece(f.tensor(f"{name}_scales"))),
            join=MXFP4_GPT_OSS,
        )
        for name, (rows, cols) in names.items()
    }
    got = _read_all(f, pieces["gate_up"], pieces["down"], torch.bfloat16)
    for name in names:
        want = gpt_oss_layout_bytes(stored[f"{name}_blocks"], stored[f"{name}_scales"])
        for e in range(E):
            assert torch.equal(got[e][name], want[e])
