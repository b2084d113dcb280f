"""Grouped-query attention over a preallocated KV cache, with the variants the MoE families use:
biases, q/k RMSNorm per head (Qwen3) or over all heads (OLMoE), clipped q/k/v (OLMoE), sliding
windows, per-head attention sinks (GPT-OSS) and partial rotary (GLM-4: q and k in the order of each
head's dims that moerun.decoder.rope's `head_order` gives, so the KV cache holds keys in that order).

Queries are processed as a chunk of positions [start, start + T) against the keys [0, start + T)
already in the cache (sliding layers: only the window), so memory is T x cached, never a full
prompt squared. Attention runs in torch's scaled_dot_product_attention, except with sinks, which
it cannot express: there scores and softmax run in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moerun import cpu
from moerun.decoder.config import AttentionSpec
from moerun.decoder.norm import rms_norm
from moerun.decoder.rope import Rotary
from moerun.linear import Linear, linear, native_weight
from moerun.quant.formats import QTensor


def _heads_reordered(
    spec: AttentionSpec, t: Mapping[str, torch.Tensor | QTensor], order: torch.Tensor
) -> dict[str, torch.Tensor | QTensor]:
    """q and k with each head's dims in `order` (indices into a head of head_dim): the rows of their
    weights (quantised ones by whole rows of bytes) and biases, and their norm weights."""
    D, out = spec.head_dim, {}
    for proj, heads in (("q", spec.heads), ("k", spec.kv_heads)):
        rows = (torch.arange(heads)[:, None] * D + order[None, :]).reshape(-1)  # [heads * D]
        for name, index in (
            (f"{proj}.weight", rows),
            (f"{proj}.bias", rows),
            (f"{proj}_norm.weight", order if spec.qk_norm == "head" else rows),
        ):
            if (w := t.get(name)) is not None:
                data = w.data if isinstance(w, QTensor) else w
                picked = data.index_select(0, index.to(data.device))  # a fresh tensor, 64-byte aligned
                out[name] = QTensor(w.format, w.shape, picked) if isinstance(w, QTensor) else picked
    return out


class Attention:
    def __init__(
        self,
        spec: AttentionSpec,
        tensors: Mapping[str, torch.Tensor],
        rotary: Rotary,
        sliding_window: int | None = None,
        project: Linear = linear,
    ):
        """`project`: how the q, k, v and o projections compute (moerun.linear, as the model chose)."""
        self.spec, self.t, self.rotary, self.window = spec, dict(tensors), rotary, sliding_window
        order = rotary.head_order()
        if order is not None:
            self.t.update(_heads_reordered(spec, self.t, order))
        self.groups = spec.heads // spec.kv_heads
        self.project = project

    def _project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.project(x, self.t[f"{name}.weight"], self.t.get(f"{name}.bias"))

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """x [B, T, H] at positions [start, start + T); writes k, v there in the cache -> [B, T, H]."""
        q, k, v = self._qkv(x, cos_sin)
        return self._output(self._cached(q, k, v, cache_k, cache_v, start))

    def ragged(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        segments: list[tuple[torch.Tensor, torch.Tensor, int, int]],
    ) -> torch.Tensor:
        """Several sequences' tokens side by side: x [1, N, H], each segment (cache_k, cache_v,
        start, T) the next T of them at positions [start, start + T) of its own cache, `cos_sin`
        [N, D/2] at each token's position. The projections see all N tokens at once; each segment
        attends over its own cache -> [1, N, H]."""
        q, k, v = self._qkv(x, cos_sin)
        outs, s = [], 0
        for cache_k, cache_v, start, T in segments:
            part = slice(s, s + T)
            outs.append(self._cached(q[:, :, part], k[:, :, part], v[:, :, part], cache_k, cache_v, start))
            s += T
        return self._output(torch.cat(outs, dim=2))

    def _qkv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """x [B, T, H] -> q [B, nh, T, D], k and v [B, nkv, T, D], normed, clipped and rotated."""
        spec, t = self.spec, self.t
        B, T, _ = x.shape
        D, nh, nkv = spec.head_dim, spec.heads, spec.kv_heads
        q, k, v = self._project(x, "q"), self._project(x, "k"), self._project(x, "v")  # [B, T, n*D]
        if spec.qk_norm == "full":
            q, k = (
                rms_norm(q, t["q_norm.weight"], spec.norm_eps),
                rms_norm(k, t["k_norm.weight"], spec.norm_eps),
            )
        if spec.clip_qkv is not None:
            c = spec.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k, v = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, D)
        if spec.qk_norm == "head":
            q, k = (
                rms_norm(q, t["q_norm.weight"], spec.norm_eps),
                rms_norm(k, t["k_norm.weight"], spec.norm_eps),
            )
        cos, sin = cos_sin  # [T, D/2]
        q = Rotary.apply(q.transpose(1, 2), cos, sin)  # [B, nh, T, D]
        k = Rotary.apply(k.transpose(1, 2), cos, sin)  # [B, nkv, T, D]
        return q, k, v.transpose(1, 2)

    def _cached(self, q, k, v, cache_k, cache_v, start: int) -> torch.Tensor:
        """Write k, v [B, nkv, T, D] at [start, start + T) of the cache; q [B, nh, T, D] attends
        over the cached keys (sliding layers: the window) -> [B, nh, T, D]."""
        end = start + q.shape[2]
        cache_k[:, :, start:end] = k
        cache_v[:, :, start:end] = v
        first = 0 if self.window is None else max(0, start - self.window + 1)
        keys, values = cache_k[:, :, first:end], cache_v[:, :, first:end]  # [B, nkv, S, D]
        if keys.dtype != q.dtype:  # fp32 activations over a cache in the compute dtype
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return self._attend(q, keys, values, start, first)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, nh, T, D] -> the output projection [B, T, H]."""
        B, nh, T, D = out.shape
        return self._project(out.transpose(1, 2).reshape(B, T, nh * D), "o")

    def native_decode(self, norm: torch.Tensor, eps: float, cache_dtype: torch.dtype) -> cpu.AttentionDecode:
        """This block, with `norm` (the model's RMSNorm before it, epsilon `eps`), as one native
        decode call."""
        spec, t = self.spec, self.t

        def weight(name: str) -> cpu.LinearWeight:
            return (*native_weight(t[f"{name}.weight"]), t.get(f"{name}.bias"))

        shape = cpu.AttentionShape(
            hidden=t["o.weight"].shape[0],
            heads=spec.heads,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            eps=eps,
            qk_norm=spec.qk_norm,
            qk_eps=spec.norm_eps,
            window=self.window,
            clip=spec.clip_qkv,
        )
        linears = {name: weight(name) for name in ("q", "k", "v", "o")}
        vectors = {"norm": norm, "q_norm": t.get("q_norm.weight"), "k_norm": t.get("k_norm.weight")}
        return cpu.AttentionDecode(shape, linears, {**vectors, "sinks": t.get("sinks")}, cache_dtype)

    def _attend(self, q, keys, values, start: int, first: int) -> torch.Tensor:
        B, nh, T, D = q.shape
        S = keys.shape[2]
        allowed = None  # a single query with no window sees every cached key
        if T > 1 or self.window is not None:
            q_pos = torch.arange(start, start + T, device=q.device)[:, None]
            k_pos = torch.arange(first, first + S, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if self.window is not None:
                allowed &= q_pos - k_pos < self.window
        if not self.spec.sinks:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, enable_gqa=self.groups > 1, scale=self.spec.softmax_scale
            )
        return self._attend_with_sinks(q, keys, values, allowed)

    def _attend_with_sinks(self, q, keys, values, allowed) -> torch.Tensor:
        """GPT-OSS: each head's sink logit joins the softmax's denominator (then is dropped)."""
        B, nh, T, D = q.shape
        nkv, S = keys.shape[1], keys.shape[2]
        grouped = q.reshape(B, nkv, self.groups * T, D)  # query heads of one kv head together
        scale = D**-0.5 if self.spec.softmax_scale is None else self.spec.softmax_scale
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [B, nkv, g*T, S]
        scores = scores.view(B, nkv, self.groups, T, S)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = self.t["sinks"].float().view(1, nkv, self.groups, 1, 1).expand(B, -1, -1, T, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :S]
        probs = probs.to(values.dtype).view(B, nkv, self.groups * T, S)
        return torch.matmul(probs, values).view(B, nh, T, D)
