"""Where moerun's numbers and llama.cpp's part, on one GGUF file.

Four views, all on the same random prompt, llama.cpp (llama-cpp-python) in this process:

1. Logits at every position: moerun in fp32 with exact and with int8 activations, each with the
   YaRN correction range as moerun reads it from the file and rounded as llama.cpp rounds it
   (floor / ceil, ggml_rope_yarn_corr_dims; moerun leaves gpt-oss's unrounded, as it was trained),
   against llama.cpp; and moerun's two activation modes against each other, a yardstick of how far
   this model carries a small difference.
2. YaRN files: q after RoPE, position by position, with either range, against llama.cpp's.
3. Each decoder block fed llama.cpp's own input for it: llama.cpp runs with an eval callback that
   copies its intermediate tensors (attn_norm-N, Qcur-N, Kcur-N, Vcur-N, kqv_out-N, attn_out-N,
   attn_post_norm-N or ffn_norm-N, ffn_moe_topk-N, ffn_moe_out-N); moerun's attention i is run on
   attn_norm-i and its MoE block i on the MoE's input, so each block's own distance shows apart from
   what it inherits. Attention is split into its stages: q after RoPE, v, and the attention itself
   on llama.cpp's own q, k and v.
4. The expert choices of the whole model run by each: at how many positions of each MoE layer
   moerun's top-k experts differ from llama.cpp's, and the router's margin there (the k-th logit
   minus the next). A choice that differs changes that position's MoE output by a whole expert's
   share, and attention carries it to every later position and layer.

    .venv/bin/python scripts/make_peer_gguf.py /tmp/gpt-oss.gguf --arch gpt-oss --ftype mxfp4
    .venv/bin/python scripts/compare_llama_cpp.py /tmp/gpt-oss.gguf --tokens 160

llama.cpp runs as `moerun bench --peer llama.cpp` runs it (llama_cpp.Llama's settings: no flash
attention, its F16 KV cache). The eval callback reads ggml's tensor struct through ctypes as
ggml.h lays it out (checked with llama-cpp-python 0.3.36); a layout whose dims make no sense is
refused. moerun's blocks are entered at their stages (Attention._qkv, ._cached), so a change there
shows here first.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from moerun.checkpoint.gguf import gguf_model, gguf_model_config
from moerun.decoder.config import ModelConfig
from moerun.loader.gguf_file import GGUFFile
from moerun.model import MoEModel
from moerun.moe.backends.base import ActivationMode
from moerun.moe.routing import route, router_logits
from moerun.moe.run import RunSpec

# llama.cpp's names of the tensors views 2 to 4 read, before "-{layer}"
BLOCK_TENSORS = (
    "attn_norm",
    "Qcur",
    "Kcur",
    "Vcur",
    "kqv_out",
    "attn_out",
    "attn_post_norm",  # gpt-oss's MoE input
    "ffn_norm",  # the other archs'
    "ffn_moe_topk",
    "ffn_moe_out",
)
GGML_TYPES = {0: np.float32, 26: np.int32}  # GGML_TYPE_F32, GGML_TYPE_I32


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h), as far as `name`: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int32),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def _copy(t: GgmlTensor) -> np.ndarray | None:
    """A host tensor's values, [ne3, ne2, ne1, ne0] (ggml's dims reversed), strides honoured; None
    where its dims make no sense (a ggml_tensor laid out otherwise than GgmlTensor reads it)."""
    ne, nb = list(t.ne), list(t.nb)
    if min(ne) < 1 or max(ne) > 1 << 31 or not t.data:
        return None
    extent = sum((n - 1) * b for n, b in zip(ne, nb, strict=True)) + np.dtype(GGML_TYPES[t.type]).itemsize
    raw = np.frombuffer((ctypes.c_char * extent).from_address(t.data), dtype=GGML_TYPES[t.type])
    return np.lib.stride_tricks.as_strided(raw, shape=ne[::-1], strides=nb[::-1]).copy()


def llama_cpp_run(path: Path, ids: list[int], threads: int) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """llama.cpp on `ids` in one batch: (logits fp32 [T, V] of every position, the BLOCK_TENSORS of
    every layer by name)."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "compare_llama_cpp: it needs llama-cpp-python (`pip install llama-cpp-python`, which builds "
            "llama.cpp for minutes)."
        ) from None
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # as llama_cpp.Llama(verbose=False)
    tensors: dict[str, np.ndarray | None] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def keep(pointer, ask, _user):  # an exception here would be lost in ctypes: None marks a bad read
        t = ctypes.cast(pointer, ctypes.POINTER(GgmlTensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return name.rpartition("-")[0] in BLOCK_TENSORS
        if t.type in GGML_TYPES:
            tensors[name] = _copy(t)
        return True

    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise SystemExit(f"compare_llama_cpp: llama.cpp could not load {path}.")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = len(ids)
    params.n_threads = params.n_threads_batch = threads
    params.cb_eval = keep
    # as llama_cpp.Llama (the bench's peer) sets them
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.yarn_attn_factor, params.yarn_beta_fast, params.yarn_beta_slow = 1.0, 32.0, 1.0
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise SystemExit(f"compare_llama_cpp: llama.cpp could not make a context for {path}.")
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    try:
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"compare_llama_cpp: llama.cpp could not evaluate the prompt on {path}.")
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = torch.stack(
            [
                torch.from_numpy(
                    np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (vocab,)).copy()
                )
                for i in range(len(ids))
            ]
        )
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    unread = [name for name, values in tensors.items() if values is None]
    if unread or not tensors:
        raise SystemExit(
            f"compare_llama_cpp: this llama.cpp's ggml_tensor is laid out otherwise than GgmlTensor reads it "
            f"({', '.join(unread[:3]) or 'no tensor'} unread)."
        )
    return logits, tensors


def llama_cpp_rounding(config: ModelConfig) -> ModelConfig:
    """`config` with YaRN's correction range rounded to whole dims, as llama.cpp rounds it."""
    rope = dataclasses.replace(config.attention.rope, truncate=True)
    return dataclasses.replace(config, attention=dataclasses.replace(config.attention, rope=rope))


def moerun_fp32(path: Path, int8: bool, rounded: bool) -> MoEModel:
    """The file in moerun, fp32 compute, on the native CPU kernels; `rounded`: llama.cpp's YaRN range."""
    config, tensors = gguf_model(GGUFFile(path))
    if rounded:
        config = llama_cpp_rounding(config)
    mode = ActivationMode.INT8 if int8 else ActivationMode.EXACT
    return MoEModel(config, tensors, RunSpec.make("cpu", torch.float32, "auto", mode))


def distance(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    """max |ours - theirs| / max |theirs| over [positions, ...], and top-1 agreement for logits."""
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return f"{rel:.2e}, top-1 {100 * top1:.0f}%"


def _rel_by_position(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [T]: max |ours - theirs| / max |theirs| at each position."""
    ours, theirs = ours.flatten(1).float(), theirs.flatten(1).float()
    return (ours - theirs).abs().amax(1) / theirs.abs().amax(1)


def _spread(rel: torch.Tensor) -> str:
    return f"max {rel.max():.1e} median {rel.median():.1e}"


def rope_distance(model: MoEModel, tensors: dict[str, np.ndarray], T: int, layer: int = 0) -> str:
    """q after RoPE from llama.cpp's attn_norm-`layer` against its Qcur, by position."""
    x = _positions_first(tensors[f"attn_norm-{layer}"])[None]
    q = model.attentions[layer]._qkv(x, model.rotary.cos_sin(torch.arange(T), torch.float32))[0]
    rel = _rel_by_position(q[0].transpose(0, 1), _positions_first(tensors[f"Qcur-{layer}"]))
    at = sorted({0, T // 4, T // 2, 3 * T // 4, T - 1})
    return f"{_spread(rel)}; at positions " + ", ".join(f"{p}: {rel[p]:.1e}" for p in at)


def blocks(model: MoEModel, tensors: dict[str, np.ndarray], T: int) -> list[str]:
    """View 3: each of moerun's blocks on llama.cpp's input for it."""

    def t(name: str) -> torch.Tensor:
        return _positions_first(tensors[name])

    cos_sin = model.rotary.cos_sin(torch.arange(T), torch.float32)
    lines = []
    for i, (attn, moe) in enumerate(zip(model.attentions, model.mlps, strict=True)):
        x = t(f"attn_norm-{i}")[None]  # [1, T, H]
        q, k, v = attn._qkv(x, cos_sin)  # [1, heads, T, D]
        Q, K, V = (t(f"{n}-{i}").transpose(0, 1)[None] for n in ("Qcur", "Kcur", "Vcur"))
        rq = _rel_by_position(q[0].transpose(0, 1), Q[0].transpose(0, 1))
        rv = _rel_by_position(v[0].transpose(0, 1), V[0].transpose(0, 1))
        cache = model.new_cache(1, T)
        out = attn._cached(Q, K, V, cache.keys[i], cache.values[i], 0)[0].transpose(0, 1)  # [T, heads, D]
        window = "" if attn.window is None else f", window {attn.window}"
        line = f"  layer {i} attention{window}: "
        if f"attn_out-{i}" in tensors:  # gpt-oss names its block's output; qwen3moe does not
            cache = model.new_cache(1, T)
            whole = attn(x, cos_sin, cache.keys[i], cache.values[i], 0)[0]
            line += f"whole block {_spread(_rel_by_position(whole, t(f'attn_out-{i}')))}; "
        lines.append(
            line
            + f"q after RoPE {_spread(rq)} (first position {rq[0]:.1e}, last {rq[-1]:.1e}); v {_spread(rv)}; "
            f"attention on llama.cpp's q, k, v {_spread(_rel_by_position(out, t(f'kqv_out-{i}')))}"
        )
        if f"ffn_moe_out-{i}" in tensors:
            h = t(f"attn_post_norm-{i}" if f"attn_post_norm-{i}" in tensors else f"ffn_norm-{i}")
            rm = _rel_by_position(moe(h[None])[0], t(f"ffn_moe_out-{i}"))
            same = _same_experts(moe, h, t(f"ffn_moe_topk-{i}"))[0]
            lines.append(
                f"  layer {i} MoE: {_spread(rm)}; where both chose the same experts "
                f"({int(same.sum())}/{T} positions) {_spread(rm[same])}"
            )
    return lines


def _positions_first(a: np.ndarray) -> torch.Tensor:
    """llama.cpp's [1, 1, T, H] or [1, T, heads, D] -> [T, H] or [T, heads, D]."""
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    return torch.from_numpy(a)


def _same_experts(moe, h: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moerun's router on h [T, H] against llama.cpp's choices [T, k]: (same set [T] bool, the
    router's margin at each position: its k-th logit minus the next [T])."""
    t = moe.tensors
    logits = router_logits(h.float(), t["router.weight"].float(), t.get("router.bias"))
    _, ids = route(moe.spec.routing, logits, t.get("router.score_bias"))
    ours = ids.sort(-1).values
    same = (ours == theirs.long().sort(-1).values).all(-1)
    k, top = ids.shape[-1], logits.sort(-1, descending=True).values
    return same, top[:, k - 1] - top[:, k]


class _Inputs:
    """A MoE block that keeps its last input (view 4)."""

    def __init__(self, block):
        self.block, self.input = block, None

    def __call__(self, h, *args, **kwargs):
        self.input = h
        return self.block(h, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.block, name)


def expert_choices(model: MoEModel, ids: list[int], tensors: dict[str, np.ndarray]) -> list[str]:
    """View 4: the whole model run by each; where their expert choices part."""
    T, lines = len(ids), []
    kept = [_Inputs(block) for block in model.mlps]
    model.mlps[:] = kept
    try:
        model.logits(torch.tensor([ids]))
    finally:
        model.mlps[:] = [k.block for k in kept]
    for i, k in enumerate(kept):
        name = f"ffn_moe_topk-{i}"
        if name not in tensors:
            continue
        theirs = _positions_first(tensors[name])
        same, margin = _same_experts(k.block, k.input[0], theirs)
        parted = torch.nonzero(~same).flatten().tolist()
        shown = ", ".join(f"{p} ({margin[p]:.1e})" for p in parted[:8]) + (", ..." if len(parted) > 8 else "")
        lines.append(
            f"  layer {i}: different experts at {len(parted)}/{T} positions{': ' if parted else ''}{shown}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a GGUF file both read")
    parser.add_argument("--tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="threads for both (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    T = args.tokens
    vocab = GGUFFile(args.model).metadata["tokenizer.ggml.tokens"]
    ids = torch.randint(0, len(vocab), (T,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    reference, tensors = llama_cpp_run(args.model, ids, args.threads)
    yarn = gguf_model_config(GGUFFile(args.model)).attention.rope.kind == "yarn"
    print(f"{args.model}: {T} random tokens (seed {args.seed}), {args.threads} thread(s)")
    print("1. logits at every position against llama.cpp's: max |moerun - llama.cpp| / max |llama.cpp|")
    logits = {}
    with torch.inference_mode():
        for int8 in (False, True):
            for rounded in (False, True) if yarn else (False,):
                model = moerun_fp32(args.model, int8, rounded)
                logits[int8, rounded] = model.logits(torch.tensor([ids]))[0]
                what = f"fp32, {'int8' if int8 else 'exact'} activations" + (
                    f", YaRN range {'rounded (llama.cpp)' if rounded else 'as moerun reads the file'}"
                    if yarn
                    else ""
                )
                print(f"  {what:<72} {distance(logits[int8, rounded], reference)}")
        yardstick = distance(logits[False, False], logits[True, False])
        print(f"  {'moerun exact against moerun int8 (the yardstick)':<72} {yardstick}")
        like = moerun_fp32(args.model, int8=True, rounded=yarn)
        if yarn:
            own = moerun_fp32(args.model, int8=True, rounded=False)
            print(
                "2. q after RoPE in layer 0 on llama.cpp's input, YaRN range as moerun reads the file: "
                + rope_distance(own, tensors, T)
            )
            print("   the same, the range rounded as llama.cpp rounds it: " + rope_distance(like, tensors, T))
        else:
            print("2. no YaRN: the two rotate alike (q after RoPE, block by block below)")
        print(
            "3. each block on llama.cpp's input for it (moerun: int8 activations"
            + (", llama.cpp's YaRN range)" if yarn else ")")
        )
        print("\n".join(blocks(like, tensors, T)))
        print(
            "4. the whole model: where moerun's expert choices (same settings) differ from llama.cpp's "
            "(position (router margin))"
        )
        print("\n".join(expert_choices(like, ids, tensors)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
