"""The decoder stack around the MoE layers: embed -> [attention, MoE or dense MLP] x layers -> norm
-> lm_head, run over a preallocated KV cache in chunks of positions.

`MoEModel` holds canonical tensors (`ModelConfig.tensor_shapes`); loaders build them from files.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moerun.layer import MoELayer, StateDictError
from moerun.model.attention import Attention, KVCache
from moerun.model.config import ModelConfig
from moerun.model.linear import linear
from moerun.model.norm import rms_norm
from moerun.model.rope import Rotary
from moerun.quant.cache import DequantCache
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor
from moerun.sampling import Sampler, SamplingParams


class ContextError(ValueError):
    """A sequence longer than the model's context."""


@dataclass(frozen=True)
class Token:
    """One generated token: its id and (when the model has a tokenizer) its text."""

    id: int
    text: str = ""


class DenseMLP:
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, activation):
        self.gate_up, self.down, self.activation = gate_up, down, activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(linear(x, self.gate_up).float()).to(x.dtype)  # [B, T, I]
        return linear(h, self.down)


class MoEModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor | QTensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "torch",
        dequant_cache: DequantCache | None = None,
        prefill_chunk: int = 512,
    ):
        check_model_tensors(config, tensors)
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.prefill_chunk = prefill_chunk

        def dense(name: str) -> torch.Tensor:
            t = tensors[name]
            t = dequantize(t) if isinstance(t, QTensor) else t
            return t.to(device=self.device, dtype=dtype)

        self.embed = dense("embed.weight")  # [V, H]
        self.lm_head = self.embed if config.tie_embeddings else dense("lm_head.weight")
        self.norm = dense("norm.weight")
        self.rotary = Rotary(config.attention.rope, config.attention.head_dim, self.device)
        self.attn_norms, self.mlp_norms, self.attentions, self.mlps = [], [], [], []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            self.attn_norms.append(dense(p + "attn_norm.weight"))
            self.mlp_norms.append(dense(p + "mlp_norm.weight"))
            attn_tensors = {k: dense(p + "attn." + k) for k in config.attention.tensor_shapes()}
            self.attentions.append(
                Attention(config.attention, attn_tensors, self.rotary, config.sliding_windows[i])
            )
            if config.moe_layers[i]:
                moe = {k: tensors[p + "moe." + k] for k in config.moe.tensor_shapes()}
                self.mlps.append(
                    MoELayer.from_tensors(
                        config.moe,
                        moe,
                        name=p + "moe",
                        dtype=dtype,
                        device=self.device,
                        backend=backend,
                        dequant_cache=dequant_cache,
                    )
                )
            else:
                act = config.dense_activation
                self.mlps.append(DenseMLP(dense(p + "mlp.gate_up"), dense(p + "mlp.down"), act))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.config.max_positions:
            raise ContextError(
                f"A sequence of {max_len} positions is longer than this model's context of "
                f"{self.config.max_positions} (max_position_embeddings)."
            )
        n = self.config.num_layers
        return KVCache.allocate(n, batch, self.config.attention, max_len, self.dtype, self.device)

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids [B, T] at the cache's next positions -> final hidden states [B, T, H]; advances the cache."""
        start, T = cache.length, ids.shape[1]
        if start + T > cache.capacity:
            raise ContextError(f"{start + T} positions do not fit a KV cache of {cache.capacity}.")
        eps = self.config.norm_eps
        positions = torch.arange(start, start + T, device=self.device)
        cos_sin = self.rotary.cos_sin(positions, self.dtype)
        x = F.embedding(ids.to(self.device), self.embed)  # [B, T, H]
        for i, (attn, mlp) in enumerate(zip(self.attentions, self.mlps, strict=True)):
            x = x + attn(rms_norm(x, self.attn_norms[i], eps), cos_sin, cache.keys[i], cache.values[i], start)
            x = x + mlp(rms_norm(x, self.mlp_norms[i], eps))
        cache.length = start + T
        return rms_norm(x, self.norm, eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids LongTensor [B, T] -> logits fp32 [B, T, vocab], with a fresh cache; prefill in chunks."""
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        self._check_ids(ids)
        cache = self.new_cache(ids.shape[0], ids.shape[1])
        chunks = [
            self._logits(self.forward(ids[:, s : s + self.prefill_chunk], cache))
            for s in range(0, ids.shape[1], self.prefill_chunk)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    @torch.inference_mode()
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        seed: int | None = None,
        **sampling,
    ) -> Iterator[Token]:
        """Yield up to `max_new_tokens` tokens after `prompt` (ids): greedy at temperature 0, else
        sampled (`top_k`, `top_p`, `min_p`, `repetition_penalty`: see moerun.sampling). Stops after
        an end-of-sequence id or when the context is full."""
        sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, **sampling))
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        if ids.shape[1] == 0:
            raise ValueError("generate needs a prompt of at least one token.")
        self._check_ids(ids)
        total = min(ids.shape[1] + max_new_tokens, self.config.max_positions)  # prompt + new tokens
        steps = total - ids.shape[1]
        cache = self.new_cache(1, total)
        for s in range(0, ids.shape[1], self.prefill_chunk):
            hidden = self.forward(ids[:, s : s + self.prefill_chunk], cache)
        seen = list(prompt)
        for step in range(steps):
            next_id = sampler(self._logits(hidden[0, -1]), seen)  # logits [V]
            seen.append(next_id)
            yield Token(next_id)
            if next_id in self.config.eos_token_ids or step == steps - 1:
                return
            hidden = self.forward(torch.tensor([[next_id]]), cache)

    def _check_ids(self, ids: torch.Tensor) -> None:
        length, V = ids.shape[-1], self.config.vocab_size
        if length > self.config.max_positions:
            raise ContextError(
                f"A sequence of {length} tokens is longer than this model's context of "
                f"{self.config.max_positions} (max_position_embeddings)."
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"Token ids must lie in [0, {V}) for this model's vocabulary of {V}.")


def check_model_tensors(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor | QTensor],
    sources: Mapping[str, str] | None = None,
    where: str = "",
) -> None:
    """One StateDictError listing every missing, unexpected and mis-shaped tensor of the model;
    `sources` (canonical name -> checkpoint name) and `where` (the file) make the message concrete."""

    def label(key: str) -> str:
        return f"{key} ({sources[key]})" if sources and sources.get(key, key) != key else key

    expected = config.tensor_shapes()
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    misshaped = [
        f"{label(k)} is {tuple(tensors[k].shape)}, expected {s}"
        for k, s in expected.items()
        if k in tensors and tuple(tensors[k].shape) != s
    ]
    problems = []
    if missing:
        problems.append("missing " + ", ".join(_abbreviate(missing)))
    if unexpected:
        problems.append("unexpected " + ", ".join(_abbreviate(unexpected)))
    if misshaped:
        problems.append("mis-shaped: " + "; ".join(misshaped))
    if problems:
        raise StateDictError(
            f"The {config.model_type} checkpoint's tensors do not fit its config: "
            + " | ".join(problems)
            + "."
        )


def _abbreviate(names: list[str], limit: int = 40) -> list[str]:
    return names if len(names) <= limit else [*names[:limit], f"... ({len(names) - limit} more)"]
