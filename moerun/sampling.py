"""Sampling: the next token of one sequence from one position's logits. Greedy, or sampled after a
repetition penalty, temperature, top-k, top-p and min-p, in transformers' order, so the same
settings mean the same distribution in both; a seed makes sampling reproducible. Also each token's
log-probability and the most likely alternatives, from the model's own distribution (before any
penalty or filter, as vLLM and OpenAI report them)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was already output
    seed: int | None = None

    def __post_init__(self):
        check_sampling({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_options(cls, **options) -> SamplingParams:
        """SamplingParams from keyword options, an unknown name refused with the names there are."""
        known = [f.name for f in fields(cls)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"Unknown sampling option {name!r}{hint}; the options are {', '.join(known)}."
                )
        return cls(**options)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def unused(self) -> list[str]:
        """The options set away from their default that greedy decoding does not use."""
        if not self.greedy:
            return []
        default = SamplingParams()
        return [n for n in ("top_k", "top_p", "min_p", "seed") if getattr(self, n) != getattr(default, n)]


# option -> (whether a value is allowed, what the allowed values are)
_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0 (0: greedy)"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: off)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1] (1: off)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1] (0: off)"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0 (1: off)"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
    "seed": (lambda v: v is None or _integer(v), "an integer or None"),
}


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling(values: Mapping[str, object], names: Mapping[str, str] | None = None) -> None:
    """Raise ValueError on the first option outside its range, named as `names` calls it (the
    command line's flags) or by its own name."""
    for option, value in values.items():
        allowed, what = _RULES[option]
        if not allowed(value):
            name = (names or {}).get(option, option)
            raise ValueError(f"{name} must be {what}, got {value!r}.")


def penalise_repeats(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """Logits of tokens in `seen` divided by `penalty` when positive, multiplied when negative."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), device=logits.device)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return out


def penalise_output(
    logits: torch.Tensor, output: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: each token already in `output` loses `presence`,
    and `frequency` times its count, from its logit."""
    if (presence == 0 and frequency == 0) or not output:
        return logits
    counts = torch.bincount(torch.tensor(output), minlength=logits.numel())[: logits.numel()].float()
    return logits - presence * (counts > 0).float() - frequency * counts


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


def token_logprobs(
    logits: torch.Tensor, token_id: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """logits [V] -> (log-probability of `token_id`, the `top` most likely (id, log-probability)
    pairs, most likely first), from the model's distribution (under a grammar, the masked one: the
    alternatives are tokens it allows, those it forbids, at -inf, never listed)."""
    logprobs = logits.float().log_softmax(-1)
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    return float(logprobs[token_id]), tuple((i, v) for i, v in pairs if v != float("-inf"))


class Sampler:
    """Picks tokens for one sequence; owns the random generator, so one seed gives one text."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def argmax_only(self) -> bool:
        """Whether the next token is the argmax of the logits as they come (greedy, no penalty), so
        a batch may take every such sequence's argmax in one call."""
        p = self.params
        return p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == p.frequency_penalty == 0

    def __call__(self, logits: torch.Tensor, seen: Sequence[int] = (), output: Sequence[int] = ()) -> int:
        """logits [V] -> the next token id; `seen`: the ids of the prompt and the output so far,
        `output`: the output's alone (the presence and frequency penalties count only those)."""
        p = self.params
        logits = penalise_repeats(logits.float().cpu(), seen, p.repetition_penalty)
        logits = penalise_output(logits, output, p.presence_penalty, p.frequency_penalty)
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = filtered_logits(logits, self.params).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
