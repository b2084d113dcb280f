"""Perplexity of a model over a text, by the sliding window of transformers' "Perplexity of
fixed-length models" guide (llama.cpp's `llama-perplexity` scores the same way with a stride of half
the context): windows of `ctx_size` tokens start every `stride` tokens; each scores only the tokens
no earlier window scored, each predicted from the tokens before it in its window (a fresh KV cache
per window). With windows that overlap (stride < ctx_size) every token but the first is scored once;
side by side (stride = ctx_size) a window's first token has nothing before it and is not scored.
Perplexity = exp(mean negative log-likelihood of the scored tokens)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moerun.decoder.model import Decoder


def windows(length: int, ctx_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first scored position, end) of each window over `length` tokens."""
    spans, scored_to = [], 0
    for begin in range(0, length, stride):
        end = min(begin + ctx_size, length)
        spans.append((begin, max(scored_to, begin + 1), end))
        scored_to = end
        if end == length:
            break
    return spans


def perplexity(
    model: Decoder,
    ids: Sequence[int],
    ctx_size: int = 512,
    stride: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict:
    """Perplexity of `ids` under `model` -> {"perplexity", "nll" (mean, nats), "tokens" (scored),
    "windows", "ctx_size", "stride", "seconds", "tok_s"}. `stride` defaults to half of `ctx_size`;
    `progress(done, total, perplexity so far)` is told after each window."""
    stride = stride or max(ctx_size // 2, 1)
    if len(ids) < 2:
        raise ValueError(f"Perplexity needs a text of at least 2 tokens, got {len(ids)}.")
    if not 0 < ctx_size <= model.config.max_positions:
        raise ValueError(
            f"ctx_size must be in [1, {model.config.max_positions}] (this model's context), got {ctx_size}."
        )
    if not 0 < stride <= ctx_size:
        raise ValueError(f"stride must be in [1, ctx_size={ctx_size}], got {stride}.")
    tokens = torch.tensor(ids, dtype=torch.long)
    spans = windows(len(ids), ctx_size, stride)
    nll, scored, start = 0.0, 0, time.perf_counter()
    for done, (begin, first, end) in enumerate(spans, 1):
        logits = model.logits(tokens[None, begin:end])[0]  # [end - begin, V]
        # position p is predicted by the logits at p - 1
        logprobs = logits[first - begin - 1 : end - begin - 1].log_softmax(-1)
        targets = tokens[first:end].to(logprobs.device)
        nll -= float(logprobs.gather(1, targets[:, None]).double().sum())
        scored += end - first
        if progress:
            progress(done, len(spans), math.exp(nll / scored))
    seconds = time.perf_counter() - start
    return {
        "perplexity": math.exp(nll / scored),
        "nll": nll / scored,
        "tokens": scored,
        "windows": len(spans),
        "ctx_size": ctx_size,
        "stride": stride,
        "seconds": seconds,
        "tok_s": sum(end - begin for begin, _, end in spans) / seconds,
    }
