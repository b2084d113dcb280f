"""Perplexity of a model over a text, counted one of two ways (a fresh KV cache per window in both;
perplexity = exp(mean negative log-likelihood of the scored tokens)):

- **chunks**, llama.cpp's `llama-perplexity` (its default, `perplexity` in
  tools/perplexity/perplexity.cpp), used when no stride is given: the ids are cut into
  len(ids) // ctx_size side-by-side chunks of `ctx_size` (the rest dropped); where the tokenizer adds
  BOS (`bos` given) each chunk's first id is replaced by BOS; of each chunk only the second half is
  scored: the tokens at positions ctx_size // 2 + 1 ... ctx_size - 1, each predicted from the chunk's
  tokens before it (`max_chunks`: only the first so many, as its `--chunks`). On the same file and
  ctx_size this is the number `llama-perplexity -c ctx_size` prints ("Final estimate: PPL"), up to
  the two programs' arithmetic (the same tokens, chunks and scored positions); llama.cpp refuses texts
  of fewer than 2 * ctx_size tokens, which this scores (from one chunk).
- **windows**, the sliding window of transformers' "Perplexity of fixed-length models" guide, used
  when a stride is given: windows of `ctx_size` tokens start every `stride` tokens; each scores only
  the tokens no earlier window scored, each predicted from the tokens before it in its window. With
  windows that overlap (stride < ctx_size) every token but the first is scored once; side by side
  (stride = ctx_size) a window's first token has nothing before it and is not scored. This equals
  transformers' own loss over the same windows; it is not llama.cpp's `--ppl-stride` variant."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moerun.decoder.model import Decoder


def windows(length: int, ctx_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first scored position, end) of each sliding window over `length` tokens."""
    spans, scored_to = [], 0
    for begin in range(0, length, stride):
        end = min(begin + ctx_size, length)
        spans.append((begin, max(scored_to, begin + 1), end))
        scored_to = end
        if end == length:
            break
    return spans


def chunks(length: int, ctx_size: int) -> list[tuple[int, int, int]]:
    """(begin, first scored position, end) of each of llama.cpp's chunks over `length` tokens:
    `first = n_ctx/2` there is the first position whose logits are read, so the first token scored
    is the one after it."""
    return [
        (begin, begin + ctx_size // 2 + 1, begin + ctx_size)
        for begin in range(0, length - ctx_size + 1, ctx_size)
    ]


def perplexity(
    model: Decoder,
    ids: Sequence[int],
    ctx_size: int = 512,
    stride: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    bos: int | None = None,
    max_chunks: int | None = None,
) -> dict:
    """Perplexity of `ids` under `model` -> {"perplexity", "nll" (mean, nats), "tokens" (scored),
    "method" ("chunks" or "windows"), "windows" (chunks or windows run), "ctx_size", "stride",
    "seconds", "tok_s"}. Without `stride`, llama.cpp's chunks, each beginning with `bos` when given
    (the BOS id where the tokenizer adds one), at most `max_chunks` of them; with it, sliding windows
    `stride` apart (`bos` and `max_chunks` unused). `progress(done, total, perplexity so far)` is told
    after each chunk or window."""
    if not 0 < ctx_size <= model.config.max_positions:
        raise ValueError(
            f"ctx_size must be in [1, {model.config.max_positions}] (this model's context), got {ctx_size}."
        )
    tokens = torch.tensor(ids, dtype=torch.long)
    if stride is None:
        if ctx_size < 3:
            raise ValueError(f"ctx_size must be at least 3 to score half of each chunk, got {ctx_size}.")
        if len(ids) < ctx_size:
            raise ValueError(
                f"Perplexity in chunks of {ctx_size} tokens needs a text of at least {ctx_size} tokens, "
                f"got {len(ids)} (llama.cpp's needs {2 * ctx_size}); give a smaller context."
            )
        if max_chunks is not None and max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, got {max_chunks}.")
        method, spans, stride = "chunks", chunks(len(ids), ctx_size)[:max_chunks], ctx_size
    else:
        if len(ids) < 2:
            raise ValueError(f"Perplexity needs a text of at least 2 tokens, got {len(ids)}.")
        if not 0 < stride <= ctx_size:
            raise ValueError(f"stride must be in [1, ctx_size={ctx_size}], got {stride}.")
        method, spans, bos = "windows", windows(len(ids), ctx_size, stride), None
    nll, scored, start = 0.0, 0, time.perf_counter()
    for done, (begin, first, end) in enumerate(spans, 1):
        window = tokens[begin:end].clone()
        if bos is not None:
            window[0] = bos
        logits = model.logits(window[None])[0]  # [end - begin, V]
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
        "method": method,
        "windows": len(spans),
        "ctx_size": ctx_size,
        "stride": stride,
        "seconds": seconds,
        "tok_s": sum(end - begin for begin, _, end in spans) / seconds,
    }
