"""scripts/full_size_gguf.py (`make_peer_gguf.py --full-size`) on tiny shapes: the file made from a few
real layers repeated has the tensor names, types, shapes and order llama.cpp writes when it quantises
the whole model itself, its repeated layers hold their real layer's bytes, and its routers route as
asked, measured on the written router and embedding."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from full_size_gguf import ROUTINGS, choose_sources, write_full_size  # noqa: E402
from make_peer_gguf import PeerShape, main, quantize, write_f16_gguf  # noqa: E402

# rows of 256, so that llama.cpp's k-quants take them, as they take the full-size model's
TYPES = PeerShape(
    hidden=256,
    expert_intermediate=256,
    heads=2,
    kv_heads=1,
    head_dim=128,
    experts=4,
    top_k=2,
    layers=16,
    vocab=300,
)
ROUTED = PeerShape(
    hidden=256,
    expert_intermediate=256,
    heads=2,
    kv_heads=1,
    head_dim=128,
    experts=32,
    top_k=4,
    layers=2,
    vocab=4096,
)


def _quiet(message: str) -> None:
    pass


def test_real_layers_are_shared_out_among_the_patterns():
    a, b = ("A",), ("B",)
    types = {0: a, 1: a, 2: b, 3: a, 4: b, 5: a}
    assert choose_sources(types, 3) == {0: 0, 1: 1, 3: 0, 5: 1, 2: 2, 4: 2}  # A has 4 layers, B 2
    assert choose_sources(types, 1) == {0: 0, 1: 0, 3: 0, 5: 0, 2: 2, 4: 2}  # one per pattern at least


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    directory = tmp_path_factory.mktemp("full")
    whole = directory / "whole.gguf"
    quantize(write_f16_gguf(directory / "whole.f16.gguf", TYPES), whole, "q4_k_m")
    repeated = directory / "repeated.gguf"
    source_of = write_full_size(repeated, "q4_k_m", ROUTINGS["uniform"], TYPES, distinct=3, log=_quiet)
    return whole, repeated, source_of


def test_the_tensors_are_those_llama_cpp_writes_for_the_whole_model(files):
    whole, repeated, _ = files
    ours, theirs = gguf.GGUFReader(repeated), gguf.GGUFReader(whole)
    assert ours.fields["qwen3moe.block_count"].contents() == 16
    assert ours.fields["general.file_type"].contents() == theirs.fields["general.file_type"].contents()

    def table(reader):
        return [(t.name, t.tensor_type.name, tuple(t.shape.tolist()), int(t.n_bytes)) for t in reader.tensors]

    assert table(ours) == table(theirs)
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_K", "Q6_K"}  # both patterns of Q4_K_M
    assert repeated.stat().st_size == whole.stat().st_size


def test_repeated_layers_hold_their_real_layers_bytes_and_routers_their_own(files):
    _, repeated, source_of = files
    assert sorted(source_of) == list(range(16)) and len(set(source_of.values())) == 3
    tensors = {t.name: t for t in gguf.GGUFReader(repeated).tensors}
    for layer, real in source_of.items():
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_v"):
            ours, source = tensors[f"blk.{layer}.{name}.weight"], tensors[f"blk.{real}.{name}.weight"]
            assert np.array_equal(ours.data, source.data), (layer, name)
    real = sorted(set(source_of.values()))
    first, second = (tensors[f"blk.{layer}.ffn_gate_exps.weight"].data for layer in real[:2])
    assert first.shape != second.shape or not np.array_equal(first, second)  # distinct real layers
    repeat = next(layer for layer, source in source_of.items() if layer != source)
    own, source = (tensors[f"blk.{layer}.ffn_gate_inp.weight"].data for layer in (repeat, source_of[repeat]))
    assert not np.array_equal(own, source)  # every layer its own router


def _routing_shares(path: Path, top: int) -> list[float]:
    """Per layer, the share of the requests of every vocabulary token (each layer's router on the
    written embedding after the written ffn norm) that its `top` busiest experts take."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embedding = tensors["token_embd.weight"]
    x = gguf.quants.dequantize(embedding.data, embedding.tensor_type).astype(np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True))
    shares = []
    for layer in range(ROUTED.layers):
        logits = (x * tensors[f"blk.{layer}.ffn_norm.weight"].data) @ tensors[
            f"blk.{layer}.ffn_gate_inp.weight"
        ].data.T
        picked = np.argsort(-logits, axis=1)[:, : ROUTED.top_k]
        counts = np.bincount(picked.ravel(), minlength=ROUTED.experts)
        shares.append(np.sort(counts)[::-1][:top].sum() / counts.sum())
    return shares


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_routers_route_varied_tokens_as_asked(tmp_path, routing):
    pytest.importorskip("llama_cpp")
    path = tmp_path / f"{routing}.gguf"
    write_full_size(path, "q4_k_m", ROUTINGS[routing], ROUTED, distinct=1, log=_quiet)
    shares = _routing_shares(path, top=ROUTED.experts // 8)  # the busiest eighth of the experts
    if routing == "skewed":  # asked: a random eighth of each layer's experts takes 80%
        assert all(0.72 <= share <= 0.88 for share in shares), shares
    else:  # uniform: an eighth of the requests, up to the spread of 4096 tokens' choices
        assert all(share <= 0.16 for share in shares), shares


def test_the_script_refuses_what_it_cannot_make(tmp_path):
    with pytest.raises(SystemExit, match="give a quantised --ftype"):
        main([str(tmp_path / "a.gguf"), "--full-size", "--ftype", "f16"])
    with pytest.raises(SystemExit, match="Qwen3-MoE files only"):
        main([str(tmp_path / "a.gguf"), "--full-size", "--arch", "gpt-oss"])
    with pytest.raises(SystemExit, match="not both"):
        main([str(tmp_path / "a.gguf"), "--full-size", "--random-experts", "iq1_s"])
    assert list(tmp_path.iterdir()) == []
