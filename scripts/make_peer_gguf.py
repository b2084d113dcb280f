"""Write a Qwen3-MoE- or GPT-OSS-shaped GGUF file for `moerun bench --model FILE --peer llama.cpp`.

qwen3moe (the default): Qwen3-30B-A3B's layer shapes (hidden 2048, expert intermediate 768, 32 query
heads and 4 KV heads of head_dim 128, top-8 routing), with 64 experts, 4 layers and a 32000-token
vocabulary, so the file is small enough to make and run in minutes yet reads like the real model per
layer. `--arch gpt-oss`: gpt-oss-20b's layer shapes (hidden and expert intermediate 2880, 64 query
heads and 8 KV heads of 64, 32 experts top-4) and the metadata its converted files carry (YaRN factor
32 from an original context of 4096, rope base 150000, a sliding window of 128 on every other layer),
with attention biases and sinks, router and expert biases; 4 layers, a 32000-token vocabulary. Weights
are random, N(0, 0.02) in F16 (norms 1, the router in F32 as llama.cpp keeps it; biases N(0, 0.02) and
sinks N(0, 1) in F32); the vocabulary is a
SentencePiece-style one (<unk> <s> </s>, the 256 <0xNN> byte tokens, ▁ (a space), then letter strings
with and without it in front) that llama.cpp and moerun both read. The F16 file is written with the
`gguf` package and then quantised by llama.cpp itself (`llama_cpp.llama_model_quantize`, as
llama-quantize does), so the quantised tensors are exactly what llama.cpp writes; finally the script
checks that moerun loads the result.

Rerun the comparison (llama-cpp-python installed: `pip install llama-cpp-python`, it builds for minutes):

    .venv/bin/python scripts/make_peer_gguf.py /tmp/peer-q4_k_m.gguf --ftype q4_k_m
    .venv/bin/moerun bench --model /tmp/peer-q4_k_m.gguf --peer llama.cpp

`--ftype f16` writes the F16 file only (no llama.cpp needed); `--layers`, `--experts` and the other
shape options change the shapes (`--ftype mxfp4` is llama.cpp's MXFP4_MOE: experts MXFP4, the rest
q8_0, as gpt-oss files ship). llama.cpp writes IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M only with an
importance matrix; `--random-experts iq2_xxs` (say, with `--ftype q4_k_m`) puts random valid blocks
of that format in the routed experts after llama.cpp quantised the rest.

`--full-size` writes Qwen3-30B-A3B at its full size (48 layers, 128 experts, vocabulary 151936; about
18.5 GB at q4_k_m) without its 61 GB F16 source: llama.cpp quantises a few real layers
(`--distinct-layers`, 4 by default, at least one per pattern of types llama.cpp gives the 48 layers),
and the others repeat them, with the tensor names, types and order llama.cpp writes for the whole
model (scripts/full_size_gguf.py says how). It needs about 6 GB of disk beside the output for the
real layers' F16 file, and minutes. `--routing uniform` (its default) or `skewed` sets how the routers
spread varied tokens over the experts: uniformly (the worst case for an expert cache), or as published
traces of real models do (in each layer a random eighth of the experts take 80% of the requests);
without `--full-size`, `--routing` sets a small file's routers the same way. A full-size file is
checked by reading its header with moerun, not by loading it:

    .venv/bin/python scripts/make_peer_gguf.py /tmp/full-q4_k_m.gguf --full-size --routing skewed
    .venv/bin/moerun bench --model /tmp/full-q4_k_m.gguf --peer llama.cpp --memory-limit-gb 9
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import gguf
import numpy as np

# llama.cpp's llama_ftype values (include/llama.h), by the names llama-quantize takes
FTYPES = {
    "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_m": 12, "q4_k_m": 15,
    "q5_k_m": 17, "q6_k": 18, "iq3_xxs": 23, "iq4_nl": 25, "iq3_s": 26, "iq3_m": 27, "iq4_xs": 30,
    "tq1_0": 36, "tq2_0": 37, "mxfp4": 38,
}  # fmt: skip
# Expert formats llama.cpp writes only with an importance matrix: `--random-experts` puts random valid
# blocks of one of them in every routed expert tensor of a file llama.cpp quantised otherwise.
RANDOM_EXPERT_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m")
ARCHS = ("qwen3moe", "gpt-oss")
Tensors = list[tuple[str, tuple[int, ...], type]]  # (name, torch-order shape, numpy dtype) in file order
Values = Callable[[str, tuple[int, ...], type, np.random.Generator], np.ndarray]


@dataclass(frozen=True)
class PeerShape:
    arch: str = "qwen3moe"
    hidden: int = 2048
    expert_intermediate: int = 768
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 64
    top_k: int = 8
    layers: int = 4
    vocab: int = 32000
    context: int = 4096
    dense_intermediate: int = 6144  # Qwen3-30B-A3B's intermediate_size (no layer uses it)


# gpt-oss-20b's layer shapes and context (its vocabulary has 201088 tokens; 4 of its 24 layers)
GPT_OSS_20B = PeerShape(
    arch="gpt-oss",
    hidden=2880,
    expert_intermediate=2880,
    heads=64,
    kv_heads=8,
    head_dim=64,
    experts=32,
    top_k=4,
    context=131072,
    dense_intermediate=2880,
)
DEFAULT_SHAPES = {"qwen3moe": PeerShape(), "gpt-oss": GPT_OSS_20B}


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` tokens: (tokens, scores, llama.cpp token types)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    types = [2, 3, 3] + [6] * 256 + [1]  # unknown, control, control, byte, normal
    if size < len(tokens):
        raise SystemExit(f"make_peer_gguf: a vocabulary needs at least {len(tokens)} tokens, not {size}.")
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for word in map("".join, itertools.product(letters, repeat=n)):
            for token in ("▁" + word, word):
                if len(tokens) == size:
                    return tokens, [0.0] * 259 + [-float(i) for i in range(size - 259)], types
                tokens.append(token)
                types.append(1)
    raise AssertionError("unreachable")


def _tensors(shape: PeerShape) -> Tensors:
    """(name, torch-order shape, numpy dtype) of every tensor, in file order."""
    H, I, E, q, kv = shape.hidden, shape.expert_intermediate, shape.experts, shape.heads, shape.kv_heads
    d, f32, f16 = shape.head_dim, np.float32, np.float16
    gpt_oss = shape.arch == "gpt-oss"
    out = [("token_embd.weight", (shape.vocab, H), f16)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        attention = [
            (b + "attn_q.weight", (q * d, H), f16),
            (b + "attn_k.weight", (kv * d, H), f16),
            (b + "attn_v.weight", (kv * d, H), f16),
            (b + "attn_output.weight", (H, q * d), f16),
        ]
        experts = [
            (b + "ffn_gate_exps.weight", (E, I, H), f16),
            (b + "ffn_up_exps.weight", (E, I, H), f16),
            (b + "ffn_down_exps.weight", (E, H, I), f16),
        ]
        router = [(b + "ffn_gate_inp.weight", (E, H), f32)]  # llama.cpp never quantises the router
        if gpt_oss:  # biases everywhere, sinks; its MLP norm is named post_attention_norm
            attention += [(name[:-6] + "bias", dims[:1], f32) for name, dims, _ in attention]
            attention.append((b + "attn_sinks.weight", (q,), f32))
            router.append((b + "ffn_gate_inp.bias", (E,), f32))
            experts += [(name[:-6] + "bias", dims[:2], f32) for name, dims, _ in experts]
            norms = [(b + "post_attention_norm.weight", (H,), f32)]
        else:
            attention += [(b + "attn_q_norm.weight", (d,), f32), (b + "attn_k_norm.weight", (d,), f32)]
            norms = [(b + "ffn_norm.weight", (H,), f32)]
        out += [(b + "attn_norm.weight", (H,), f32), *attention, *norms, *router, *experts]
    return out + [("output_norm.weight", (H,), f32), ("output.weight", (shape.vocab, H), f16)]


def random_values(name: str, dims: tuple[int, ...], dtype: type, rng: np.random.Generator) -> np.ndarray:
    """A tensor's values: norms 1, sinks N(0, 1), everything else N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype)
    if name.endswith("attn_sinks.weight"):
        return rng.standard_normal(dims, dtype=np.float32)
    data = np.empty(dims, dtype)  # one expert (or the whole matrix) at a time keeps the float32 draw small
    for part in data.reshape(-1, *dims[-2:]) if len(dims) == 3 else [data]:
        part[...] = rng.standard_normal(part.shape, dtype=np.float32) * 0.02
    return data


def write_f16_gguf(
    path: str | Path,
    shape: PeerShape = PeerShape(),
    seed: int = 0,
    tensors: Tensors | None = None,
    values: Values = random_values,
) -> Path:
    """Write the model as F16 (norms and routers F32) to `path`, one tensor at a time: `tensors`
    (default: `_tensors(shape)`), each filled by `values(name, dims, dtype, rng)`."""
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"peer-{shape.arch}-{shape.layers}x{shape.experts}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.dense_intermediate)
    writer.add_expert_feed_forward_length(shape.expert_intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if shape.arch == "gpt-oss":  # GptOssModel.set_gguf_parameters, from gpt-oss-20b's config.json
        writer.add_rope_freq_base(150000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    else:
        writer.add_rope_freq_base(1e6)
        writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = vocabulary(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    tensors = _tensors(shape) if tensors is None else tensors
    for name, dims, dtype in tensors:
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, dtype in tensors:
        writer.write_tensor_data(values(name, dims, dtype, rng))
    writer.close()
    return path


def quantize(f16: Path, out: Path, ftype: str, threads: int = 0) -> None:
    """llama.cpp's quantiser (llama-quantize's code) from `f16` to `out` as `ftype`."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "make_peer_gguf: quantising needs llama-cpp-python (`pip install llama-cpp-python`, it builds "
            "llama.cpp for minutes); --ftype f16 writes the unquantised file without it."
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"make_peer_gguf: llama.cpp failed to quantise {f16} to {ftype} (status {status}).")


def random_blocks(fmt: str, rows: int, row_elements: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid `fmt` blocks uint8 [rows, row_bytes]: every byte random but the fp16 scale d,
    which is set so that the values have about the spread of N(0, 0.02) weights (IQ1_M keeps d in
    the top nibbles of its last 4 uint16)."""
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * row_elements // block, size), dtype=np.uint8)
    d = np.float16(0.0005 if fmt.startswith("iq2") else 0.002)
    if fmt == "iq1_m":
        bits = int(d.view(np.uint16))
        words = blocks[:, 48:56].copy().view("<u2") & 0x0FFF
        for k in range(4):
            words[:, k] |= ((bits >> (4 * k)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def with_random_experts(src: Path, out: Path, fmt: str, seed: int) -> None:
    """`src` copied to `out` with every routed expert tensor (ffn_{gate,up,down}_exps) replaced by
    random valid `fmt` blocks of the same shape."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # torch order: the row last
        if "_exps." in t.name:
            data = random_blocks(fmt, int(np.prod(shape[:-1])), shape[-1], rng)
            qtype = gguf.GGMLQuantizationType[fmt.upper()]
            writer.add_tensor(t.name, data.reshape(*shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every metadata field of `reader` but the architecture (the writer has it) into `writer`."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.alignment":
            writer.data_alignment = value
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, field.types[0])


def check_loads(path: Path) -> str:
    """Load `path` with moerun; a one-line description of what it found."""
    import torch

    import moerun

    model = moerun.load(path, dtype=torch.bfloat16, device="cpu")
    c = model.config
    moes = [mlp for mlp, moe in zip(model.mlps, c.moe_layers, strict=True) if moe]
    formats = sorted({t.format.name for moe in moes for t in moe.tensors.values() if hasattr(t, "format")})
    return (
        f"moerun loads {path}: {c.model_type}, {c.num_layers} layers, hidden {c.hidden}, {c.moe.num_experts} "
        f"experts top-{c.moe.top_k}, vocab {c.vocab_size}; expert formats {', '.join(formats) or 'dense'}"
    )


def main(argv: list[str] | None = None) -> int:
    from full_size_gguf import FULL_SIZE, ROUTINGS, RoutedValues  # it imports this module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--ftype", choices=["f16", *FTYPES], default="q4_k_m")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3moe", help="whose shapes and metadata")
    for field in asdict(PeerShape()):
        if field != "arch":
            defaults = ", ".join(f"{getattr(s, field)} ({arch})" for arch, s in DEFAULT_SHAPES.items())
            parser.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"default: {defaults}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp's quantiser threads (0: all)")
    parser.add_argument("--no-check", action="store_true", help="skip loading the result with moerun")
    parser.add_argument(
        "--random-experts",
        choices=RANDOM_EXPERT_TYPES,
        help="then replace the routed experts by random valid blocks of this format (formats llama.cpp "
        "writes only with an importance matrix)",
    )
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="Qwen3-30B-A3B's full size (48 layers, 128 experts, vocabulary 151936: 18.5 GB at q4_k_m), "
        "from a few layers llama.cpp quantises, repeated (scripts/full_size_gguf.py)",
    )
    parser.add_argument(
        "--distinct-layers", type=int, default=4, help="with --full-size: the layers the others repeat"
    )
    parser.add_argument(
        "--routing",
        choices=sorted(ROUTINGS),
        help="qwen3moe: routers that spread varied tokens uniformly over the experts (the worst case for "
        "a cache), or skewed (in each layer an eighth of the experts take 80%% of the requests); default "
        "with --full-size: uniform, without: the random model's own (concentrated)",
    )
    args = parser.parse_args(argv)
    given = {f: getattr(args, f) for f in asdict(PeerShape()) if f != "arch"}
    base = FULL_SIZE if args.full_size else DEFAULT_SHAPES[args.arch]
    shape = replace(base, **{f: v for f, v in given.items() if v is not None})
    if args.out.exists():
        raise SystemExit(f"make_peer_gguf: {args.out} exists; it is not overwritten.")
    if args.routing and args.arch != "qwen3moe":
        raise SystemExit("make_peer_gguf: --routing sets Qwen3-MoE routers; leave --arch out.")
    if args.full_size:
        return _full_size(args, shape)
    values = random_values if args.routing is None else RoutedValues(shape, ROUTINGS[args.routing], args.seed)
    f16 = args.out if args.ftype == "f16" else args.out.with_name(args.out.stem + ".f16.gguf")
    start = time.perf_counter()
    write_f16_gguf(f16, shape, args.seed, values=values)
    print(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s")
    if args.ftype != "f16":
        start = time.perf_counter()
        try:
            quantize(f16, args.out, args.ftype, args.threads)
        finally:
            f16.unlink()
        size = args.out.stat().st_size / 2**30
        print(
            f"quantised to {args.ftype}: {args.out} ({size:.2f} GiB) in {time.perf_counter() - start:.0f} s"
        )
    if args.random_experts:
        base = args.out.with_name(args.out.stem + ".base.gguf")
        args.out.rename(base)
        try:
            with_random_experts(base, args.out, args.random_experts, args.seed)
        finally:
            base.unlink()
        print(f"routed experts replaced by random {args.random_experts} blocks: {args.out}")
    if not args.no_check:
        print(check_loads(args.out))
    return 0


def _full_size(args: argparse.Namespace, shape: PeerShape) -> int:
    from full_size_gguf import ROUTINGS, check_header, write_full_size

    if args.random_experts:
        raise SystemExit("make_peer_gguf: give --full-size or --random-experts, not both.")
    if args.arch != "qwen3moe":
        raise SystemExit("make_peer_gguf: --full-size writes Qwen3-MoE files only; leave --arch out.")
    start = time.perf_counter()
    routing = args.routing or "uniform"
    write_full_size(
        args.out, args.ftype, ROUTINGS[routing], shape, args.distinct_layers, args.seed, args.threads
    )
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e9:.2f} GB, {routing} routing) in {time.perf_counter() - start:.0f} s")
    if not args.no_check:
        print(check_header(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
