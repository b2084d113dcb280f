"""Generation: a model driven token by token. Prefill the prompt, then pick each next token from the
last position's logits (greedy, or sampled after a repetition penalty, temperature, top-k, top-p and
min-p, in transformers' order, so the same settings mean the same distribution in both; a seed makes
sampling reproducible), stop at an end-of-sequence id or a stop string, and keep the run's figures.
The model computes logits; this module decides what to do with them."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moerun.text.stops import StopMatcher
from moerun.text.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from moerun.decoder.kv_cache import KVCache
    from moerun.decoder.model import MoEModel


@dataclass(frozen=True)
class Token:
    """One generated token: its id and (when the model has a tokenizer) the text it completes."""

    id: int
    text: str = ""
    last: bool = field(default=False, repr=False, compare=False)  # the generation ends after it


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


class Generator:
    """Generates for one model: `generate` (the model's `generate`), `stats` (its `stats`). Holds
    the figures of the last generation and, for `reuse_prefix`, the KV cache it left."""

    def __init__(self, model: MoEModel):
        self.model = model
        self.last_run: dict = {}
        # generate(reuse_prefix=True): the KV cache of the last such generation and the ids it holds
        self.prefix: tuple[KVCache, list[int]] | None = None

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        reuse_prefix: bool = False,
        **sampling,
    ) -> Iterator[Token]:
        """Yield up to `max_new_tokens` tokens after `prompt` (text, which needs the checkpoint's
        tokenizer, or ids): greedy at temperature 0, else sampled (`top_k`, `top_p`, `min_p`,
        `repetition_penalty`: see SamplingParams). Each item has `.id` and `.text` (the text it
        completes; "" without a tokenizer). Stops after an end-of-sequence id, at a `stop` string
        (not output), or when the context is full. Timings land in `stats()`.

        `reuse_prefix`: keep this generation's KV cache, and start from the previous such
        generation's where its tokens (prompt and output) begin this prompt, computing only the rest
        (a chat's next turn repeats the whole conversation). The reused positions were computed in
        other chunks, so logits may differ from a fresh run's in the last bits."""
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise ValueError("This checkpoint has no tokenizer, so the prompt must be token ids.")
            prompt = self.model.tokenizer.encode(prompt)
        tokens = self._ids(
            list(prompt), max_new_tokens, SamplingParams(temperature, seed=seed, **sampling), reuse_prefix
        )
        if self.model.tokenizer is None:
            yield from tokens
            return
        decoder, stops = StreamDecoder(self.model.tokenizer), StopMatcher(stop)
        for token in tokens:
            text, stopped = stops.push(decoder.push(token.id))
            if token.last and not stopped:  # the generation ends: release what was held back
                tail, stopped = stops.push(decoder.flush())
                text += tail + ("" if stopped else stops.flush())
            yield Token(token.id, text, last=token.last or stopped)
            if stopped:
                return

    @torch.inference_mode()
    def _ids(
        self, prompt: list[int], max_new_tokens: int, params: SamplingParams, reuse_prefix: bool = False
    ) -> Iterator[Token]:
        sampler = Sampler(params)
        ids = torch.tensor([prompt], dtype=torch.long)
        if ids.shape[1] == 0:
            raise ValueError("generate needs a prompt of at least one token.")
        self.model.check_ids(ids)
        total = min(ids.shape[1] + max_new_tokens, self.model.config.max_positions)  # prompt + new tokens
        steps = total - ids.shape[1]
        eos = set(self.model.config.eos_token_ids) | (
            self.model.tokenizer.eos_ids if self.model.tokenizer else set()
        )
        cache = self.model.new_cache(1, total)
        reused = self._reuse_prefix(prompt, cache) if reuse_prefix else 0
        run = self.last_run = {
            "prompt_tokens": len(prompt),
            "reused_tokens": reused,
            "prefill_s": 0.0,
            "new_tokens": 0,
            "decode_s": 0.0,
        }
        start = time.perf_counter()
        for s in range(reused, ids.shape[1], self.model.prefill_chunk):
            hidden = self.model.forward(ids[:, s : s + self.model.prefill_chunk], cache)
        seen = list(prompt)
        # the cache holds seen[:cache.length] whenever this generator stops (Ctrl-C included)
        self.prefix = (cache, seen) if reuse_prefix else None
        for step in range(steps):
            next_id = sampler(self.model.hidden_logits(hidden[0, -1]), seen)  # logits [V]
            seen.append(next_id)
            last = next_id in eos or step == steps - 1
            now = time.perf_counter()
            run["prefill_s" if step == 0 else "decode_s"] += now - start
            run["new_tokens"] += 1
            yield Token(next_id, last=last)
            if last:
                return
            start = time.perf_counter()
            hidden = self.model.forward(torch.tensor([[next_id]]), cache)

    def _reuse_prefix(self, prompt: list[int], cache: KVCache) -> int:
        """Copy into `cache` the longest run of positions the previous reuse_prefix generation
        computed that starts `prompt` (all but its last token: that one's logits are needed);
        returns how many."""
        if self.prefix is None:
            return 0
        old, old_ids = self.prefix
        limit = min(old.length, len(prompt) - 1)
        n = 0
        while n < limit and old_ids[n] == prompt[n]:
            n += 1
        for new_layer, old_layer in zip(cache.keys + cache.values, old.keys + old.values, strict=True):
            new_layer[:, :, :n].copy_(old_layer[:, :, :n])
        cache.length = n
        return n

    def stats(self) -> dict:
        """Figures of the last generation: prompt tokens, prefill seconds (to the first new token),
        new tokens, decode seconds (for the others), and the rates; with expert streaming also
        "offload": slots, cache bytes, and OffloadStats counters of the last step and in total."""
        run = dict(self.last_run)
        if run.get("prefill_s"):
            run["prefill_tok_s"] = (run["prompt_tokens"] - run.get("reused_tokens", 0)) / run["prefill_s"]
        if run.get("decode_s"):
            run["decode_tok_s"] = (run["new_tokens"] - 1) / run["decode_s"]
        if self.model.expert_cache is not None:
            run["offload"] = self.model.expert_cache.summary()
        return run
