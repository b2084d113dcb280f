"""Choosing the next token from logits: greedy, or sampled after a repetition penalty, temperature,
top-k, top-p and min-p, in transformers' order (penalty, then temperature, top-k, top-p, min-p), so
the same settings mean the same distribution in both. A seed makes sampling reproducible."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens already in prompt or output
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalise_repeats(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """Logits of tokens in `seen` divided by `penalty` when positive, multiplied when negative."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), device=logits.device)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return out


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> the scaled logits with every token outside top-k / top-p / min-p at -inf."""
    logits = logits / params.temperature if params.temperature not in (0.0, 1.0) else logits.clone()
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - params.top_p
        remove[-1] = False  # keep at least the most likely token
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        remove = probs < params.min_p * probs.max()
        remove[probs.argmax()] = False
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class Sampler:
    """Picks tokens for one sequence; owns the random generator, so one seed gives one text."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seen: Sequence[int] = ()) -> int:
        """logits [V] -> the next token id; `seen`: the ids of the prompt and the output so far."""
        logits = penalise_repeats(logits.float().cpu(), seen, self.params.repetition_penalty)
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = filtered_logits(logits, self.params).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
