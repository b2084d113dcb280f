"""Multi-head latent attention (DeepSeek-V2/V3; one module for every family that uses it).

Per position the KV cache holds the normed latent (kv_lora_rank) and the rotary key
(qk_rope_head_dim, shared by every head), never per-head keys and values. A step's queries attend
over keys and values expanded from the cached latents by `kv_b`:

    q = q_b(norm(q_a(x)))  (or q(x))   -> per head [nope | rope]
    latent, k_rope = kv_a(x) -> norm(latent), rope(k_rope)
    k = [kv_b(latent)_nope | k_rope], v = kv_b(latent)_v, softmax scale 1/sqrt(nope + rope) x mscale^2

DeepSeek lays the rotary dimensions out in interleaved pairs; they are gathered into halves (evens,
then odds) for q and k alike before the half-split rotation moerun.decoder.rope applies, which
leaves every q.k product as transformers computes it.

The same interface as moerun.decoder.attention.Attention: `__call__` for a batch of sequences at
one start position, `ragged` for several sequences side by side (batched generation).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moerun.decoder.config import MLASpec
from moerun.decoder.norm import rms_norm
from moerun.decoder.rope import Rotary
from moerun.linear import Linear, linear

# Queries per sequence up to which a step attends in the absorbed form (decode), not by expanding
# every cached latent through kv_b (prefill, where the expansion is shared by many queries)
ABSORB_BELOW = 4


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention:
    def __init__(
        self,
        spec: MLASpec,
        tensors: Mapping[str, torch.Tensor],
        rotary: Rotary,
        sliding_window: int | None = None,
        project: Linear = linear,
    ):
        if sliding_window is not None:
            raise ValueError("MLA attention has no sliding window.")
        self.spec, self.t, self.rotary, self.project = spec, dict(tensors), rotary, project
        self.window = None
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # kv_b per head, for the absorbed form

    def _project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.project(x, self.t[f"{name}.weight"], self.t.get(f"{name}.bias"))

    def __call__(self, x, cos_sin, cache_latent, cache_rope, start: int) -> torch.Tensor:
        """x [B, T, H] at positions [start, start + T); writes the latents and rotary keys there
        in the cache -> [B, T, H]."""
        q, latent, k_rope = self._qkv(x, cos_sin)
        return self._output(self._cached(q, latent, k_rope, cache_latent, cache_rope, start))

    def ragged(self, x, cos_sin, segments) -> torch.Tensor:
        """Several sequences side by side (see Attention.ragged): x [1, N, H] -> [1, N, H]."""
        q, latent, k_rope = self._qkv(x, cos_sin)
        outs, s = [], 0
        for cache_latent, cache_rope, start, T in segments:
            part = slice(s, s + T)
            outs.append(
                self._cached(
                    q[:, :, part], latent[:, :, part], k_rope[:, :, part], cache_latent, cache_rope, start
                )
            )
            s += T
        return self._output(torch.cat(outs, dim=2))

    def _qkv(self, x: torch.Tensor, cos_sin):
        """x [B, T, H] -> q [B, heads, T, nope + rope] (rotated), latent [B, 1, T, kv_lora_rank]
        (normed), k_rope [B, 1, T, rope] (rotated)."""
        spec, t = self.spec, self.t
        B, T, _ = x.shape
        nope, rope = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            q = self._project(x, "q")
        else:
            q = self._project(rms_norm(self._project(x, "q_a"), t["q_a_norm.weight"], spec.norm_eps), "q_b")
        q = q.view(B, T, spec.heads, nope + rope).transpose(1, 2)  # [B, h, T, nope + rope]
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self._project(x, "kv_a").split([spec.kv_lora_rank, rope], dim=-1)
        latent = rms_norm(latent, t["kv_a_norm.weight"], spec.norm_eps).view(B, 1, T, spec.kv_lora_rank)
        k_rope = k_rope.reshape(B, 1, T, rope)
        if spec.interleaved_rope:
            q_rope, k_rope = _halves(q_rope), _halves(k_rope)
        cos, sin = cos_sin  # [T, rope / 2]
        q = torch.cat((q_nope, Rotary.apply(q_rope, cos, sin)), dim=-1)
        return q, latent, Rotary.apply(k_rope, cos, sin)

    def _cached(self, q, latent, k_rope, cache_latent, cache_rope, start: int) -> torch.Tensor:
        """Write latent and k_rope at [start, start + T) of the cache; q [B, h, T, nope + rope]
        attends over every cached position's expanded keys and values -> [B, h, T, v_head_dim]."""
        spec = self.spec
        B, h, T, _ = q.shape
        end = start + T
        cache_latent[:, :, start:end] = latent
        cache_rope[:, :, start:end] = k_rope
        latents, rotary_keys = cache_latent[:, :, :end], cache_rope[:, :, :end]  # [B, 1, S, *]
        if latents.dtype != q.dtype:
            latents, rotary_keys = latents.to(q.dtype), rotary_keys.to(q.dtype)
        if T <= ABSORB_BELOW:
            return self._absorbed(q, latents, rotary_keys, start)
        kv = self._project(latents, "kv_b").view(B, end, h, spec.qk_nope_head_dim + spec.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
        k = torch.cat((k_nope, rotary_keys.expand(B, h, end, spec.qk_rope_head_dim)), dim=-1)
        allowed = None
        if T > 1:
            q_pos = torch.arange(start, end, device=q.device)[:, None]
            allowed = torch.arange(end, device=q.device)[None, :] <= q_pos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=spec.softmax_scale)

    def _absorbed(self, q, latents, rotary_keys, start: int) -> torch.Tensor:
        """The same attention with kv_b folded into the query and the output, so no cached position
        is expanded: q_nope . (W_k latent) = (W_k^T q_nope) . latent, and the values' W_v applied
        once to the attention-weighted latent. A step's work no longer grows as heads x
        (nope + v) x kv_lora_rank per cached position; q [B, h, T, nope + rope] -> [B, h, T, v]."""
        spec = self.spec
        B, h, T, _ = q.shape
        w_k, w_v = self._kv_b_parts(q.dtype)  # [h, nope, r], [h, v, r]
        q_nope, q_rope = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_k)
        lat, rot = latents[:, 0], rotary_keys[:, 0]  # [B, S, r], [B, S, rope]
        scores = torch.einsum("bhtr,bsr->bhts", q_latent, lat) + torch.einsum("bhtd,bsd->bhts", q_rope, rot)
        scores = scores.float() * spec.softmax_scale
        if T > 1:
            S = lat.shape[1]
            q_pos = torch.arange(start, start + T, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(S, device=q.device)[None, :] > q_pos, float("-inf"))
        weights = scores.softmax(dim=-1).to(q.dtype)
        return torch.einsum("bhvr,bhtr->bhtv", w_v.unsqueeze(0).expand(B, -1, -1, -1), weights @ lat[:, None])

    def _kv_b_parts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's key and value halves per head, dense in `dtype` (dequantised once if stored
        quantised)."""
        if self._parts is None or self._parts[0].dtype != dtype:
            spec = self.spec
            w = self.t["kv_b.weight"]
            if not isinstance(w, torch.Tensor):
                from moerun.quant.dequant import dequantize

                w = dequantize(w)
            w = w.to(dtype).view(spec.heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
            self._parts = (
                w[:, : spec.qk_nope_head_dim].contiguous(),
                w[:, spec.qk_nope_head_dim :].contiguous(),
            )
        return self._parts

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        B, h, T, D = out.shape
        return self._project(out.transpose(1, 2).reshape(B, T, h * D), "o")
