"""`make_peer_gguf.py --full-size`: a GGUF file of Qwen3-30B-A3B's full size (48 layers of 128 experts,
hidden 2048, expert intermediate 768, 32 query and 4 KV heads of 128, vocabulary 151936; 18.5 GB at
Q4_K_M), made from a few layers quantised by llama.cpp and repeated, so that it needs neither a 61 GB
F16 source nor the hours llama.cpp would take to quantise one.

llama.cpp picks a tensor's type from its name, its row length, its layer's index and the layer count
(Q4_K_M gives attn_v and ffn_down Q6_K in the first and last eighth of the layers and in every third
between), never from its row count. So:
1. llama.cpp quantises a 48-layer F16 file whose matrices have two rows each (each row as long as the
   real one): a few MB, seconds, and the type of every tensor of the real file;
2. llama.cpp quantises a 48-layer F16 file in which only a few layers (`distinct`, at least one per
   pattern of types found in 1) and the embeddings have their real rows, the others two;
3. the output is that file with every two-row tensor replaced by the same tensor of a real layer with
   the same types (each pattern's layers take its real layers in turn), written tensor by tensor from
   the map of 2. Its tensor names, types, shapes and order are those llama.cpp writes for the real model.

Routing is set by the F32 tensors, which llama.cpp keeps as they are (`RoutedValues`). A random
model's residual stream is dominated by what its blocks add, which changes little from token to token,
so its routers pick nearly the same experts for every token. Here the attention and FFN norms' weights
are NORM_WEIGHT, so the blocks add little and the residual stays close to the token's embedding: a
random N(0, 1) row plus one direction `c` shared by every token, of the same norm. A router row is a
random row orthogonal to `c` (which picks experts uniformly over varied tokens) plus, for a layer's hot
experts, `b` times `c` (a bias every token sees). `uniform`: no hot experts, each expert takes about
k/E of the requests (the worst case for any cache). `skewed`: a random eighth of each layer's experts
are hot, and `b` is set (by bisection on sampled tokens) so that they take 80% of the requests, as in
published traces of real models, where 10-20% of the experts take most of the traffic.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from make_peer_gguf import (
    PeerShape,
    Tensors,
    _tensors,
    copy_fields,
    quantize,
    random_values,
    write_f16_gguf,
)

FULL_SIZE = PeerShape(experts=128, layers=48, vocab=151936)  # Qwen3-30B-A3B; the rest are the defaults
NORM_WEIGHT = 1 / 64  # attn_norm and ffn_norm: the blocks add ~1/50 of the residual's norm each


@dataclass(frozen=True)
class Routing:
    """How the routers spread tokens over the experts: in every layer a random `hot_fraction` of the
    experts take `hot_share` of the requests (0, 0: uniformly)."""

    hot_fraction: float = 0.0
    hot_share: float = 0.0


ROUTINGS = {"uniform": Routing(), "skewed": Routing(hot_fraction=0.125, hot_share=0.8)}


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def _rms_rows(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True))


class RoutedValues:
    """The tensor values (a make_peer_gguf `Values`) of a model routed as `routing` says; see the
    module docstring. Every value depends on the seed and the tensor's name alone, so a layer has the
    same router whichever file it is written to."""

    def __init__(self, shape: PeerShape, routing: Routing, seed: int = 0):
        self.shape, self.routing, self.seed = shape, routing, seed
        c = np.random.default_rng([seed, 1]).standard_normal(shape.hidden)
        self.common = (c / np.linalg.norm(c)).astype(np.float32)  # the direction every token shares
        self.hot = round(routing.hot_fraction * shape.experts)
        self.bias = self._solve_bias() if self.hot else 0.0

    def __call__(self, name: str, dims: tuple[int, ...], dtype: type, rng: np.random.Generator):
        if name == "token_embd.weight":
            return self.embedding(dims, dtype)
        if name.endswith(("attn_norm.weight", "ffn_norm.weight")):
            return np.full(dims, NORM_WEIGHT, dtype)
        if name.endswith("ffn_gate_inp.weight"):
            return self.router(layer_of(name), dims[0]).astype(dtype)
        return random_values(name, dims, dtype, rng)

    def tokens(self, rows: int, rng: np.random.Generator) -> np.ndarray:
        """`rows` embedding rows float32 [rows, H]: N(0, 1) plus sqrt(H) times the shared direction."""
        H = self.shape.hidden
        return rng.standard_normal((rows, H), dtype=np.float32) + np.sqrt(H) * self.common

    def embedding(self, dims: tuple[int, ...], dtype: type) -> np.ndarray:
        rng, data = np.random.default_rng([self.seed, 2]), np.empty(dims, dtype)
        for start in range(0, dims[0], 8192):  # a bounded float32 draw
            data[start : start + 8192] = self.tokens(min(8192, dims[0] - start), rng)
        return data

    def _directions(self, rows: int, rng: np.random.Generator) -> np.ndarray:
        """`rows` random N(0, 1) rows [rows, H] with their component along the shared direction removed."""
        v = rng.standard_normal((rows, self.shape.hidden), dtype=np.float32)
        return v - np.outer(v @ self.common, self.common)

    def router(self, layer: int, experts: int) -> np.ndarray:
        """Layer `layer`'s router float32 [E, H], scaled so that the random part of the logits has
        about unit spread after the ffn norm."""
        rng = np.random.default_rng([self.seed, 3, layer])
        rows = self._directions(experts, rng)
        if self.hot:
            rows[rng.choice(experts, self.hot, replace=False)] += self.bias * self.common
        return rows / (NORM_WEIGHT * np.sqrt(self.shape.hidden / 2))

    def _solve_bias(self, samples: int = 4096) -> float:
        """The `b` with which a layer's `hot` experts take `hot_share` of the top-k requests of
        sampled tokens (bisection: their share grows with b)."""
        rng = np.random.default_rng([self.seed, 4])
        x = _rms_rows(self.tokens(samples, rng))  # what the router sees, up to the norm's scale
        random_part, shared = x @ self._directions(self.shape.experts, rng).T, x @ self.common  # [N, E], [N]
        k, low, high = self.shape.top_k, 0.0, 16.0
        for _ in range(40):
            b = (low + high) / 2
            logits = random_part.copy()
            logits[:, : self.hot] += b * shared[:, None]
            picked = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            share = (picked < self.hot).mean()
            low, high = (b, high) if share < self.routing.hot_share else (low, b)
        return (low + high) / 2


def _two_rows(tensors: Tensors, real: Callable[[str], bool]) -> Tensors:
    """`tensors` with every matrix but the `real` ones cut to two rows, each as long as its real row
    (3-d expert tensors: one expert of two rows)."""
    return [
        (name, dims if len(dims) < 2 or real(name) else (1,) * (len(dims) - 2) + (2, dims[-1]), dtype)
        for name, dims, dtype in tensors
    ]


def layer_types(reader: gguf.GGUFReader) -> dict[int, tuple]:
    """layer -> ((tensor name after blk.N., GGML type), ...) of a GGUF file's layers, in file order."""
    types: dict[int, list] = {}
    for t in reader.tensors:
        if (layer := layer_of(t.name)) is not None:
            types.setdefault(layer, []).append((t.name.split(".", 2)[2], t.tensor_type.name))
    return {layer: tuple(pairs) for layer, pairs in types.items()}


def choose_sources(types: dict[int, tuple], distinct: int) -> dict[int, int]:
    """layer -> the real layer whose tensors it repeats. The `distinct` real layers (at least one per
    pattern of types) are shared out among the patterns by how many layers each has; a pattern's
    first layers are its real ones, and its other layers take them in turn."""
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(types):
        groups.setdefault(types[layer], []).append(layer)
    slots = dict.fromkeys(groups, 1)
    for _ in range(max(distinct - len(groups), 0)):
        pattern = max(groups, key=lambda p: len(groups[p]) / slots[p])  # most layers per real layer
        slots[pattern] += 1
    source_of = {}
    for pattern, layers in groups.items():
        real = layers[: slots[pattern]]
        for j, layer in enumerate(layers):
            source_of[layer] = real[j % len(real)]
    return source_of


def write_repeated(reader: gguf.GGUFReader, out: Path, source_of: dict[int, int]) -> int:
    """The file `reader` reads copied to `out`, every tensor of layer L whose shape differs from its
    source layer's (the two-row ones) replaced by the source's (`source_of[L]`), tensor by tensor from
    the map. Returns the bytes written."""
    by_name = {t.name: t for t in reader.tensors}
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer)
    chosen = []  # (name, the tensor whose type, shape and bytes it gets)
    for t in reader.tensors:
        layer, data = layer_of(t.name), t
        if layer is not None and source_of[layer] != layer:
            source = by_name[renamed(t.name, source_of[layer])]
            data = source if tuple(source.shape) != tuple(t.shape) else t
        chosen.append((t.name, data))
    for name, t in chosen:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in chosen:
        writer.write_tensor_data(t.data)  # from the map: the page cache holds it, not this process
    writer.close()
    return out.stat().st_size


def renamed(name: str, layer: int) -> str:
    """A layer tensor's name in layer `layer`."""
    return f"blk.{layer}.{name.split('.', 2)[2]}"


def _tensor_bytes(tensors: Tensors) -> int:
    return sum(int(np.prod(dims)) * np.dtype(dtype).itemsize for _, dims, dtype in tensors)


def _check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SystemExit(
            f"make_peer_gguf: {what} needs {needed / 1e9:.1f} GB in {directory}, which has "
            f"{free / 1e9:.1f} GB free."
        )


def write_full_size(
    out: Path,
    ftype: str,
    routing: Routing,
    shape: PeerShape = FULL_SIZE,
    distinct: int = 4,
    seed: int = 0,
    threads: int = 0,
    log: Callable[[str], None] = print,
) -> dict[int, int]:
    """Write `shape`'s model as `ftype` to `out` from `distinct` real layers (see the module
    docstring); returns layer -> the real layer it repeats."""
    if shape.arch != "qwen3moe":
        raise SystemExit("make_peer_gguf: --full-size writes Qwen3-MoE files only; leave --arch out.")
    if ftype == "f16":
        raise SystemExit("make_peer_gguf: --full-size repeats quantised layers: give a quantised --ftype.")
    parts = {
        kind: out.with_name(f"{out.stem}.{kind}.gguf")
        for kind in ("types.f16", "types", "layers.f16", "layers")
    }
    if existing := [str(p) for p in (out, *parts.values()) if p.exists()]:
        raise SystemExit(f"make_peer_gguf: {', '.join(existing)} exists; it is not overwritten.")
    values = RoutedValues(shape, routing, seed)
    try:
        write_f16_gguf(parts["types.f16"], shape, seed, _two_rows(_tensors(shape), _router), values)
        quantize(parts["types.f16"], parts["types"], ftype, threads)
        types = layer_types(gguf.GGUFReader(parts["types"]))  # a reader takes seconds: 150k tokens
        source_of = choose_sources(types, distinct)
        real = set(source_of.values())
        patterns = len(set(types.values()))
        log(f"llama.cpp's {ftype}: {patterns} patterns of layer types; real layers {sorted(real)}")

        def kept(name: str) -> bool:
            return _router(name) or layer_of(name) in real or layer_of(name) is None

        tensors = _two_rows(_tensors(shape), kept)
        _check_space(out.parent, 2 * _tensor_bytes(tensors), "the real layers' F16 file")
        write_f16_gguf(parts["layers.f16"], shape, seed, tensors, values)
        quantize(parts["layers.f16"], parts["layers"], ftype, threads)
        parts["layers.f16"].unlink()
        reader = gguf.GGUFReader(parts["layers"])
        if (got := layer_types(reader)) != types:
            bad = sorted(layer for layer in types if got.get(layer) != types[layer])
            raise SystemExit(f"make_peer_gguf: llama.cpp typed layers {bad} otherwise with their real rows.")
        sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
        _check_space(out.parent, _repeated_bytes(sizes, source_of), "the full-size file")
        write_repeated(reader, out, source_of)
        del reader  # its map of the file, before the file goes
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    return source_of


def _router(name: str) -> bool:
    return name.endswith("ffn_gate_inp.weight")  # F32, small: every layer's own, with real rows


def _repeated_bytes(sizes: dict[str, int], source_of: dict[int, int]) -> int:
    total = 0
    for name, n in sizes.items():
        layer = layer_of(name)
        total += n if layer is None else max(n, sizes[renamed(name, source_of[layer])])
    return total


def check_header(path: Path) -> str:
    """What moerun reads from `path`'s header (no weights loaded: a full-size file is a big load)."""
    from moerun.checkpoint.describe import describe

    d = describe(path)
    return (
        f"moerun reads {path}: {d['architecture']}, {d['layers']} layers, hidden {d['hidden']}, "
        f"{d['experts_per_layer']} experts top-{d['top_k']}, vocab {d['vocab']}, {d['file_type']}, "
        f"{d['weights_bytes'] / 1e9:.2f} GB of weights"
    )
