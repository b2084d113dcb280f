"""Generation: a model driven token by token, through the batching engine (moerun.batching): one
prompt streamed token by token, or a list of prompts run side by side. Each prefills its prompt,
picks each next token from the last position's logits (moerun.sampling), and stops at an
end-of-sequence id, a stop string, the token budget or the end of the context; the run's figures
(why it finished among them) land in `stats()`. The model computes logits; this module and the
engine decide what to do with them."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from moerun.batching import FINISH_REASONS, Batch, Generation, GrammarError, Request, Token, prompt_ids

__all__ = ["FINISH_REASONS", "Generator", "Token", "prompt_ids"]

if TYPE_CHECKING:
    from moerun.decoder.kv_cache import KVCache
    from moerun.decoder.model import Decoder


def is_batch(prompt) -> bool:
    """A list of prompts (texts, or lists of ids), as opposed to one prompt."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and bool(prompt)
        and all(isinstance(p, Sequence) for p in prompt)
    )


class Generator:
    """Generates for one model: `generate` (the model's `generate`), `stats` (its `stats`). Holds
    the figures of the last generation and, for `reuse_prefix`, the KV cache it left."""

    def __init__(self, model: Decoder):
        self.model = model
        self.last_run: dict = {}
        # generate(reuse_prefix=True): the KV cache of the last such generation and the ids it holds
        self.prefix: tuple[KVCache, list[int]] | None = None

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
        max_new_tokens: int | None | Sequence[int | None] = 128,
        stop: Sequence[str] = (),
        reuse_prefix: bool = False,
        logprobs: int = 0,
        ctx_size: int | None = None,
        parallel: int | None = None,
        n: int = 1,
        response_format=None,
        **sampling,
    ) -> Iterator[Token] | list[list[Token]]:
        """Yield up to `max_new_tokens` tokens (None or -1: until the context ends) after `prompt`
        (text, which needs the checkpoint's tokenizer, or ids): greedy at temperature 0, else
        sampled (`temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, `seed`: see
        moerun.sampling.SamplingParams). Each item has `.id` and `.text` (the text it completes; ""
        without a tokenizer); with `logprobs=N` also `.logprob` and `.top_logprobs`. Stops after an
        end-of-sequence id (yielded, its text ""), where a `stop` string begins (the stop string is
        not output, nor a token whose text lies wholly inside it), or when the context (`ctx_size`
        positions, prompt included; default the model's) is full. Timings and `finish_reason` land
        in `stats()`. Arguments are checked here, before the first token is asked for.

        `response_format` constrains the text: OpenAI's `{"type": "json_schema", "json_schema":
        {"schema": {...}}}` or `{"type": "json_object"}`, or a moerun.text.grammar.Grammar (e.g.
        `Grammar.text(gbnf_or_lark)`); the output then parses (and validates) unless the budget or
        the context ends it first (`finish_reason` "length"). Needs `pip install 'moerun[structured]'`.

        `n` > 1 gives n choices of each prompt (its prompt prefilled once; choice i sampled with
        `seed` + i), returned as a list per choice, prompt by prompt, once all are done.

        A list of prompts runs them as one batch (moerun.batching: one forward pass per step over
        every sequence still going, each with its own cache, stops and length; `max_new_tokens` one
        value or one per prompt; at most `parallel` prompts at once, default all, the next prompt
        joining as one finishes) and returns each prompt's tokens, a list per prompt, once all are
        done; `stats()["sequences"]` holds each one's figures. Greedy, each list holds the tokens
        the prompt gives alone.

        `reuse_prefix` (one prompt): keep this generation's KV cache, and start from the previous
        such generation's where its tokens (prompt and output) begin this prompt, computing only
        the rest (a chat's next turn repeats the whole conversation). The reused positions were
        computed in other chunks, so logits may differ from a fresh run's in the last bits."""
        options = dict(
            stop=stop, logprobs=logprobs, ctx_size=ctx_size, n=n, response_format=response_format, **sampling
        )
        if is_batch(prompt) or n != 1:
            prompt = prompt if is_batch(prompt) else [prompt]
            if reuse_prefix:
                raise ValueError("reuse_prefix applies to one prompt and one choice.")
            budgets = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else None
            if budgets is not None and len(budgets) != len(prompt):
                raise ValueError(f"max_new_tokens has {len(budgets)} values for {len(prompt)} prompts.")
            budgets = budgets or [max_new_tokens] * len(prompt)
            if parallel is not None and (not isinstance(parallel, int) or parallel < 1):
                raise ValueError(f"parallel must be an integer >= 1 (sequences at once), got {parallel!r}.")
            pairs = zip(prompt, budgets, strict=True)
            requests = [Request.make(self.model, p, budget, **options) for p, budget in pairs]
            return self._batch(requests, parallel or len(requests))
        if parallel is not None:
            raise ValueError("parallel applies to a list of prompts.")
        request = Request.make(self.model, prompt, max_new_tokens, **options)
        return self._stream(request, reuse_prefix)

    def _stream(self, request: Request, reuse_prefix: bool) -> Iterator[Token]:
        """One request's tokens as they come (the batch holds only it)."""
        batch = Batch(self.model)
        sequence = batch.add(request, self.prefix if reuse_prefix else None)
        self.last_run = sequence.stats
        # the cache holds seen[:cache.length] whenever this generator stops (Ctrl-C included)
        self.prefix = (sequence.cache, sequence.seen) if reuse_prefix else None
        while batch.running:
            for _, tokens in batch.step():
                yield from tokens
        if "error" in sequence.stats:
            raise GrammarError(sequence.stats["error"])

    def _batch(self, requests: list[Request], parallel: int) -> list[list[Token]]:
        """Every request's tokens (each choice's, in order), at most `parallel` requests running at
        once (their caches allocated as they join)."""
        batch = Batch(self.model)
        waiting = collections.deque(requests)
        sequences: list[Generation] = []
        outputs: dict[int, list[Token]] = {}
        steps, start = 0, time.perf_counter()
        while waiting or batch.running:
            while waiting and len({id(s.request) for s in batch.running}) < parallel:
                sequence = batch.add(waiting.popleft())
                sequences += sequence.choices
                outputs.update((id(choice), []) for choice in sequence.choices)
            for sequence, tokens in batch.step():
                outputs[id(sequence)] += tokens
            steps += 1
        seconds = time.perf_counter() - start
        per_sequence = [self._rates(s.stats) for s in sequences]
        new = sum(s["new_tokens"] for s in per_sequence)
        self.last_run = {
            "sequences": per_sequence,
            "prompt_tokens": sum(s.stats["prompt_tokens"] for s in sequences if s.index == 0),  # once each
            "new_tokens": new,
            "steps": steps,
            "seconds": seconds,
            "tok_s": new / seconds if seconds else 0.0,
        }
        self.prefix = None
        return [outputs[id(s)] for s in sequences]

    @staticmethod
    def _rates(run: dict) -> dict:
        run = dict(run)
        if run.get("prefill_s"):
            run["prefill_tok_s"] = (run["prompt_tokens"] - run.get("reused_tokens", 0)) / run["prefill_s"]
        if run.get("decode_s"):
            run["decode_tok_s"] = (run["new_tokens"] - 1) / run["decode_s"]
        return run

    def stats(self) -> dict:
        """Figures of the last generation: prompt tokens, prefill seconds (to the first new token),
        new tokens (every token the model picked, one that only completed a stop string included),
        decode seconds (for the others), the rates, the context and `finish_reason` (FINISH_REASONS;
        None if the caller stopped early); after a batch, "sequences" (those figures per prompt),
        the totals, "steps", "seconds" and "tok_s" (new tokens over the batch's seconds); with
        expert streaming also "offload": slots, cache bytes, and OffloadStats counters of the last
        step and in total."""
        run = self._rates(self.last_run) if "sequences" not in self.last_run else dict(self.last_run)
        if self.model.expert_cache is not None:
            run["offload"] = self.model.expert_cache.summary()
        return run
