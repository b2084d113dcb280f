"""One token of one sequence in native calls: the decode step of a model on the cpu backend
(`Backend.one_call_decode`).

Each layer's attention block is one native call (moerun.cpu.AttentionDecode, built on the first
step); each MoE block is the layer's own forward with the model's RMSNorm fused into the route's
native call, so its norm, router and routing are one call and its experts a second (streamed
experts are fetched between the two: a streamed layer computes the resident one's bits). The
residual stream stays fp32 through the layers; the KV cache holds the compute dtype.

Those calls compute RMSNorms, scale scores by 1/sqrt(head_dim) and add each block's output as it
is: other stacks (MLA, PhiMoE's LayerNorms, GraniteMoE's multipliers) decode through the model's
forward pass, their MoE layers still on the native kernels.
"""

from __future__ import annotations

import torch

from moerun import cpu
from moerun.decoder.config import AttentionSpec
from moerun.decoder.kv_cache import KVCache
from moerun.decoder.norm import rms_norm


class NativeDecodeStep:
    """Built by the model (moerun.decoder.model.Decoder) for itself; reads its layers and caches."""

    def __init__(self, model):
        self.model = model
        self.attention_steps: list[cpu.AttentionDecode] | None = None  # built on the first step
        self._norms32: list[torch.Tensor] = []

    @staticmethod
    def supports(model) -> bool:
        """Whether `model` decodes one token in native calls: its backend has them, its stack is one
        they compute, and this process runs the model (with expert parallelism: rank 0)."""
        config, ep = model.config, model.expert_parallel
        moe_layers = [mlp for mlp, moe in zip(model.mlps, config.moe_layers, strict=True) if moe]
        return (
            model.run.backend.one_call_decode
            and (ep is None or ep.leads)
            and isinstance(config.attention, AttentionSpec)
            and config.attention.softmax_scale is None
            and config.norm == "rms"
            and config.residual_multiplier == 1.0
            and all(layer.backend.one_call_decode for layer in moe_layers)
        )

    def _build(self) -> None:
        model = self.model
        eps = model.config.norm_eps
        self._norms32 = [n.float().contiguous() for n in model.mlp_norms]
        self.attention_steps = [
            attn.native_decode(norm, eps, model.dtype)
            for attn, norm in zip(model.attentions, model.attn_norms, strict=True)
        ]

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The model's `forward` of one token ids [1, 1] at the cache's next position -> the final
        hidden state [1, 1, H] in the compute dtype; advances the cache."""
        if self.attention_steps is None:
            self._build()
        model = self.model
        eps, pos = model.config.norm_eps, cache.length
        int8 = model.run.backend.int8_activations
        reach = max(pos + 1, cache.rope_reach)
        cos, sin = (
            c[0].contiguous() for c in model.rotary.cos_sin(torch.tensor([pos]), torch.float32, reach)
        )
        x = model._embed(ids).reshape(1, -1).float().contiguous()  # [1, H] fp32, updated in place
        if model.expert_cache is not None:
            model.expert_cache.begin_step()
        with model._parallel_step(1, torch.float32, model._prefetches()):  # MoE inputs fp32 here
            for i, (step, mlp) in enumerate(zip(self.attention_steps, model.mlps, strict=True)):
                step(x[0], cache.keys[i], cache.values[i], pos, cos, sin, int8)
                norm = self._norms32[i]
                if model.config.moe_layers[i]:
                    x += mlp(x, model._after_fetch(i, x), norm=(norm, eps))
                else:
                    x += mlp(rms_norm(x, norm, eps))
        cache.length = pos + 1
        if model.expert_cache is not None:
            model.expert_cache.end_step()
        return rms_norm(x, model.norm, eps).to(model.dtype).view(1, 1, -1)
