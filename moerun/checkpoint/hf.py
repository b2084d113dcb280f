"""Hugging Face checkpoint names -> moerun's canonical names (`ModelConfig.tensor_shapes`), for
every family: the decoder-stack names are shared; each MoE block goes through its family's
`MOE_NAMES` table after per-expert tensors (`experts.{e}.w1` / `gate_proj`, ...) are stacked into
transformers' fused 3-D layout, and GPT-OSS's MXFP4 `*_blocks` / `*_scales` become QTensors.

With `assemble=False` (expert streaming) those two are not built: they come back as
`ExpertPieces` over views of the checkpoint, which the expert store reads expert by expert."""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from moerun.decoder.config import ModelConfig
from moerun.errors import TensorError, quote
from moerun.families import family
from moerun.families.moe_block import sanitize
from moerun.offload.pieces import MXFP4_GPT_OSS, ExpertPieces, Piece
from moerun.quant.formats import FormatError, QTensor, get_format, storage_free
from moerun.quant.halves import ExpertViews, GateUpHalves
from moerun.quant.mxfp4_layouts import gpt_oss_layout_bytes

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.norm.bias": "norm.bias",  # LayerNorm's (PhiMoE)
    "lm_head.weight": "lm_head.weight",
    "lm_head.bias": "lm_head.bias",
}
_IN_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "input_layernorm.bias": "attn_norm.bias",
    "post_attention_layernorm.bias": "mlp_norm.bias",
}
_ATTENTION = re.compile(
    r"self_attn\.(?:([qkvo]|q_a|q_b|kv_b)_proj\.(weight|bias)|(kv_a)_proj_with_mqa\.(weight|bias)"
    r"|(q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight|(sinks))"
)
_NORMS = {"q_a_layernorm": "q_a_norm", "kv_a_layernorm": "kv_a_norm"}  # MLA's
_BLOCK = re.compile(r"(?:mlp|block_sparse_moe)\.(.+)")
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def _attention_name(match: re.Match) -> str:
    proj, kind, mqa, mqa_kind, norm, sinks = match.groups()
    if proj or mqa:
        return f"attn.{proj or mqa}.{kind or mqa_kind}"
    return f"attn.{_NORMS.get(norm, norm)}.weight" if norm else "attn.sinks"


def canonical_tensors(
    model_type: str,
    config: ModelConfig,
    names: Iterable[str],
    get: Callable[[str], torch.Tensor],
    release: Callable[[str], None] = lambda name: None,
    assemble: bool = True,
    share=None,
    experts_only: bool = False,
    in_place_dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor | QTensor | ExpertPieces], dict[str, str]]:
    """(canonical tensors, canonical name -> checkpoint name). Names that fit nothing are kept
    under their own name, so the model's check lists them as unexpected. `get` returns a checkpoint
    tensor (a view of the mapped file); `release` is told when one has been copied and is not needed.
    `assemble=False`: per-expert and MXFP4 expert projections are described (`ExpertPieces`), not
    copied. `share` (expert parallelism, a moerun.distributed.ExpertShard): every MoE layer's
    expert tensors hold only its experts [start, stop), cut before anything is copied (per-expert
    tensors: only the share's are stacked). `experts_only` (expert parallelism, every rank but 0,
    which never computes the rest): every tensor but the routed experts is a storage-free stand-in
    (moerun.quant.formats.storage_free), and so is what is made of them: nothing of them is read.
    `in_place_dtype` (a backend that reads experts where they lie): per-expert projections in that
    dtype are not stacked but kept as views of the file (moerun.quant.halves: gate_up as
    `GateUpHalves` of two `ExpertViews`, down as `ExpertViews`)."""
    dense = (lambda name: storage_free(get(name))) if experts_only else get
    tensors: dict[str, torch.Tensor | QTensor] = {}
    sources: dict[str, str] = {}
    blocks: dict[int, dict[str, str]] = defaultdict(dict)  # layer -> block-relative name -> checkpoint name
    for name in names:
        if _IGNORED.fullmatch(name) or (config.tie_embeddings and name == "lm_head.weight"):
            continue  # tied: the output projection is the embedding, whatever copy a file carries
        canonical = _TOP.get(name)
        if canonical is None and (m := _LAYER.fullmatch(name)):
            layer, rest = int(m.group(1)), m.group(2)
            if config.num_layers <= layer < config.num_layers + config.extra_layers:
                continue  # a multi-token-prediction block: generation does not run it
            if rest in _IN_LAYER:
                canonical = f"layers.{layer}.{_IN_LAYER[rest]}"
            elif a := _ATTENTION.fullmatch(rest):
                canonical = f"layers.{layer}.{_attention_name(a)}"
            elif (b := _BLOCK.fullmatch(rest)) and layer < config.num_layers:
                blocks[layer][b.group(1)] = name
                continue
        canonical = canonical or name
        tensors[canonical], sources[canonical] = dense(name), name
    for layer, block in blocks.items():
        prefix = f"layers.{layer}."
        if config.moe_layers[layer]:
            moe, moe_sources = _moe_block(
                model_type, block, get, release, assemble, share, dense, in_place_dtype
            )
            tensors.update({prefix + "moe." + k: v for k, v in moe.items()})
            sources.update({prefix + "moe." + k: v for k, v in moe_sources.items()})
        else:
            mlp, mlp_sources = _dense_mlp(block, dense, release)
            tensors.update({prefix + k: v for k, v in mlp.items()})
            sources.update({prefix + k: v for k, v in mlp_sources.items()})
    return tensors, sources


def _check_pieces(parts: list[list[str]], get) -> None:
    """Every expert's pieces alike (the same shapes and dtype as expert 0's, floating point, rows of
    the same width), or one TensorError naming the first tensor that is not."""
    first = [get(name) for name in parts[0]]
    for e, names in enumerate(parts):
        for i, name in enumerate(names):
            piece, like = get(name), first[i]
            if piece.dim() < 1 or not piece.is_floating_point():
                raise TensorError(
                    f"tensor {quote(name)} is {_kind(piece)}, not a floating-point matrix like an "
                    "expert weight."
                )
            if (piece.shape, piece.dtype) != (like.shape, like.dtype) or piece.shape[1:] != first[0].shape[
                1:
            ]:
                other = parts[0][i] if e else parts[0][0]
                raise TensorError(
                    f"tensor {quote(name)} is {_kind(piece)} but {quote(other)} is {_kind(get(other))}; "
                    "the experts' tensors must match to be stacked."
                )


def _kind(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _stacked(parts: list[list[str]], get, release) -> torch.Tensor:
    """parts[e] = checkpoint names of expert e's pieces, joined along rows -> [E, rows, cols], each
    piece copied straight into place and its mapped pages released."""
    _check_pieces(parts, get)
    shapes = [get(name).shape for name in parts[0]]
    rows = sum(s[0] for s in shapes)
    first = get(parts[0][0])  # (a stand-in's pieces: a stand-in)
    out = torch.empty((len(parts), rows, *shapes[0][1:]), dtype=first.dtype, device=first.device)
    for e, names in enumerate(parts):
        start = 0
        for name in names:
            piece = get(name)
            out[e, start : start + piece.shape[0]] = piece
            start += piece.shape[0]
            release(name)
    return out


def _dense_mlp(block: dict[str, str], get, release) -> tuple[dict, dict]:
    tensors, sources, rest = {}, {}, dict(block)
    gate, up = rest.pop("gate_proj.weight", None), rest.pop("up_proj.weight", None)
    if gate and up:
        tensors["mlp.gate_up"] = _stacked([[gate, up]], get, release)[0]
        sources["mlp.gate_up"] = f"{gate} + {up}"
    if down := rest.pop("down_proj.weight", None):
        tensors["mlp.down"], sources["mlp.down"] = get(down), down
    for rel, name in rest.items():
        tensors["mlp." + rel], sources["mlp." + rel] = get(name), name
    return tensors, sources


def _described(parts: list[list[str]], get) -> ExpertPieces | None:
    """parts[e] = checkpoint names of expert e's pieces, joined along rows, as `ExpertPieces` over
    views of them; None when the pieces do not line up (then `_stacked` reports what is wrong)."""
    views = [[get(name) for name in names] for names in parts]
    first = views[0]
    if any(v.dim() != 2 or v.shape[1:] != first[0].shape[1:] or v.dtype != first[0].dtype for v in first):
        return None
    if any([(v.shape, v.dtype) for v in expert] != [(f.shape, f.dtype) for f in first] for expert in views):
        return None
    rows = [0, *itertools.accumulate(f.shape[0] for f in first)]
    pieces = tuple(Piece([expert[i] for expert in views], row=rows[i]) for i in range(len(first)))
    return ExpertPieces((len(parts), rows[-1], first[0].shape[1]), first[0].dtype, None, pieces)


def _in_place(parts: list[list[str]], get, dtype: torch.dtype) -> GateUpHalves | ExpertViews | None:
    """parts[e] = checkpoint names of expert e's pieces ([gate, up] or [down]) as views where they
    lie: `GateUpHalves` of two `ExpertViews`, or one `ExpertViews`; None where they are not in `dtype`
    or not alike (then they are stacked, and `_stacked` reports what is wrong)."""
    try:
        columns = [ExpertViews([get(names[i]) for names in parts]) for i in range(len(parts[0]))]
    except ValueError:
        return None
    if columns[0].dtype != dtype or any(c.shape != columns[0].shape for c in columns):
        return None
    return columns[0] if len(columns) == 1 else GateUpHalves(*columns)


# per-expert projections joined into transformers' fused ones: (its name, the canonical name, the
# per-expert pieces joined along rows, what the model's messages call them)
_PER_EXPERT_PROJECTIONS = (
    ("experts.gate_up_proj", "experts.gate_up", ("gate", "up"), "experts.*.gate/up weights"),
    ("experts.down_proj", "experts.down", ("down",), "experts.*.down weights"),
)


def _moe_block(
    model_type: str,
    block: dict[str, str],
    get,
    release,
    assemble: bool,
    share=None,
    dense=None,
    in_place_dtype: torch.dtype | None = None,
) -> tuple[dict, dict]:
    """One MoE block's checkpoint names (relative to the block) -> canonical MoE tensors; `share`,
    `in_place_dtype`: see canonical_tensors (a tensor whose expert count is not the config's is left
    whole, for the model's check to report); `dense(name)`: the block's other tensors (router, shared
    experts), default `get`."""
    dense = dense or get

    def cut(t: torch.Tensor) -> torch.Tensor:  # [E, ...] -> the share's experts, a view
        return t if share is None else share.cut_one(t)

    per_expert: dict[str, dict[int, str]] = defaultdict(dict)
    fused: dict[str, torch.Tensor] = {}
    in_place: dict[str, GateUpHalves | ExpertViews] = {}  # canonical name -> experts where they lie
    in_place_origin: dict[str, str] = {}
    origin: dict[str, str] = {}
    quantised: dict[str, QTensor] = {}
    # a family's original-format names (checkpoints saved with save_original_format) -> transformers'
    renamed = getattr(family(model_type), "ORIGINAL_NAMES", {})
    for rel, name in block.items():
        rel = renamed.get(rel, rel)
        if m := _PER_EXPERT.fullmatch(rel):
            per_expert[_ROLE[m.group(2)]][int(m.group(1))] = name
        elif rel.endswith("_blocks") and (scales := block.get(rel[: -len("_blocks")] + "_scales")):
            join = _gpt_oss_mxfp4 if assemble else _gpt_oss_mxfp4_pieces
            try:
                quantised[rel[: -len("_blocks")]] = join(cut(get(name)), cut(get(scales)))
            except FormatError as err:
                raise TensorError(f"tensors {quote(name)} and {quote(scales)}: {err}") from None
            origin[rel[: -len("_blocks")]] = f"{name} + {scales}"
        elif not rel.endswith("_scales"):
            fused[rel], origin[rel] = cut(get(name)) if rel.startswith("experts.") else dense(name), name
    if per_expert:
        n = 1 + max(max(e) for e in per_expert.values())
        complete = {role: experts for role, experts in per_expert.items() if len(experts) == n}
        names, transposed = family(model_type).MOE_NAMES, getattr(family(model_type), "TRANSPOSED", ())

        held = range(n) if share is None or n != share.num_experts else range(share.start, share.stop)
        for rel, canonical, roles, where in _PER_EXPERT_PROJECTIONS:
            if not all(role in complete for role in roles):
                continue
            parts = [[complete[role][e] for role in roles] for e in held]
            as_is = names.get(canonical) == rel and rel not in transposed
            if assemble and as_is and in_place_dtype is not None:
                views = _in_place(parts, get, in_place_dtype)
                if views is not None:  # used where they lie: past the family's table, as they are
                    in_place[canonical], in_place_origin[canonical] = views, where
                    continue
            # streaming: described, where the family's table takes the stacked tensor as it is
            pieces = None if assemble or not as_is else _described(parts, get)
            fused[rel] = pieces if pieces is not None else _stacked(parts, get, release)
            origin[rel] = where
    tensors, sources = sanitize(model_type, fused)
    tensors.update(in_place)
    sources.update(in_place_origin)
    for rel, q in quantised.items():  # GPT-OSS MXFP4 blocks are stored [E, out, in/32, 16]: not transposed
        canonical = next((c for r, c, *_ in _PER_EXPERT_PROJECTIONS if r == rel), rel)
        tensors[canonical], sources[canonical] = q, origin[rel]
    known = {part for src in family(model_type).MOE_NAMES.values() for part in _parts(src)}
    for rel in fused.keys() - known:  # names the family's table does not know: reported as unexpected
        tensors[rel], sources[rel] = fused[rel], origin[rel]
    sources = {k: " + ".join(origin.get(p, p) for p in v.split(" + ")) for k, v in sources.items()}
    return tensors, sources


def _parts(source: str | tuple[str, ...]) -> tuple[str, ...]:
    return source if isinstance(source, tuple) else (source,)


def _gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QTensor:
    """`*_blocks` [E, out, in/32, 16] + `*_scales` [E, out, in/32] -> QTensor [E, out, in]."""
    data = gpt_oss_layout_bytes(blocks, scales)  # [E, out, in/32*17]
    return QTensor.from_bytes("mxfp4_gpt_oss", (*blocks.shape[:-2], blocks.shape[-2] * 32), data)


def _gpt_oss_mxfp4_pieces(blocks: torch.Tensor, scales: torch.Tensor) -> ExpertPieces:
    """The same projection described: expert e's blocks and scales, joined by the expert store."""
    gpt_oss_layout_bytes(blocks.to("meta"), scales.to("meta"))  # the shape checks, nothing read
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    fmt = get_format("mxfp4_gpt_oss")
    return ExpertPieces(shape, torch.uint8, fmt, (Piece(blocks), Piece(scales)), join=MXFP4_GPT_OSS)
