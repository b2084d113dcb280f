"""Generation: a model driven token by token. Prefill the prompt, then pick each next token from the
last position's logits (moerun.sampling), stop at an end-of-sequence id, a stop string, the token
budget or the end of the context, and keep the run's figures (why it finished among them).
The model computes logits; this module decides what to do with them."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moerun.sampling import Sampler, SamplingParams, token_logprobs
from moerun.text.stops import StopMatcher
from moerun.text.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from moerun.decoder.kv_cache import KVCache
    from moerun.decoder.model import MoEModel

# stats()["finish_reason"]: "stop" (an end-of-sequence id or a stop string), "length" (the token
# budget), "context" (the context filled first); None while running or after the caller stopped early
FINISH_REASONS = ("stop", "length", "context")


@dataclass(frozen=True)
class Token:
    """One generated token: its id, the text it completes ("" without a tokenizer) and, when asked
    for (`logprobs=N`), its log-probability and the N most likely (id, log-probability) pairs."""

    id: int
    text: str = ""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_ids(prompt, tokenizer) -> list[int]:
    """One prompt (text, which needs a tokenizer, or token ids) -> its ids; other types refused."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("This checkpoint has no tokenizer, so the prompt must be token ids.")
        return tokenizer.encode(prompt)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
            raise TypeError(
                f"A prompt tensor must be 1-D integer token ids, not {prompt.dtype} "
                f"of shape {list(prompt.shape)}."
            )
        return prompt.tolist()
    if isinstance(prompt, Sequence) and all(_integer(i) for i in prompt):
        return list(prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        raise TypeError(
            "generate takes one prompt (a str or a list of token ids); "
            "batches of prompts are not supported yet."
        )
    raise TypeError(f"A prompt is a str or a list of int token ids, not {type(prompt).__name__}.")


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
        max_new_tokens: int | None = 128,
        stop: Sequence[str] = (),
        reuse_prefix: bool = False,
        logprobs: int = 0,
        ctx_size: int | None = None,
        **sampling,
    ) -> Iterator[Token]:
        """Yield up to `max_new_tokens` tokens (None or -1: until the context ends) after `prompt`
        (text, which needs the checkpoint's tokenizer, or ids): greedy at temperature 0, else
        sampled (`temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, `seed`: see
        moerun.sampling.SamplingParams). Each item has `.id` and `.text` (the text it completes; ""
        without a tokenizer); with `logprobs=N` also `.logprob` and `.top_logprobs`. Stops after an
        end-of-sequence id (yielded, its text ""), where a `stop` string begins (the stop string is
        not output, nor a token whose text lies wholly inside it), or when the context (`ctx_size`
        positions, prompt included; default the model's) is full. Timings and `finish_reason` land
        in `stats()`. Arguments are checked here, before the first token is asked for.

        `reuse_prefix`: keep this generation's KV cache, and start from the previous such
        generation's where its tokens (prompt and output) begin this prompt, computing only the rest
        (a chat's next turn repeats the whole conversation). The reused positions were computed in
        other chunks, so logits may differ from a fresh run's in the last bits."""
        params = SamplingParams.from_options(**sampling)
        if max_new_tokens is not None and (not _integer(max_new_tokens) or max_new_tokens < -1):
            raise ValueError(
                f"max_new_tokens must be an integer >= 0, or -1 or None for no limit, got {max_new_tokens!r}."
            )
        if not _integer(logprobs) or logprobs < 0:
            raise ValueError(f"logprobs must be an integer >= 0 (alternatives per token), got {logprobs!r}.")
        ids = prompt_ids(prompt, self.model.tokenizer)
        if not ids:
            raise ValueError("generate needs a prompt of at least one token.")
        self.model.check_ids(torch.tensor(ids))
        longest = self.model.config.max_positions
        context = longest if ctx_size is None else ctx_size
        if not _integer(context) or not 0 < context <= longest:
            raise ValueError(f"ctx_size must be in [1, {longest}] (this model's context), got {ctx_size!r}.")
        if len(ids) > context:
            raise ValueError(f"The prompt's {len(ids)} tokens do not fit a context of {context} positions.")
        budget = None if max_new_tokens in (None, -1) else max_new_tokens
        tokens = self._ids(ids, budget, params, reuse_prefix, logprobs, context)
        if self.model.tokenizer is None:
            return (token for token, _ in tokens)
        return self._texts(tokens, stop)

    def _texts(self, tokens: Iterator[tuple[Token, bool]], stop: Sequence[str]) -> Iterator[Token]:
        """The tokens with their text, up to where a stop string begins. A token whose text is held
        back (it may begin a stop string, or ends inside a character) waits; at a stop, of the
        waiting tokens and the last only those the released text needs are yielded."""
        decoder, stops = StreamDecoder(self.model.tokenizer), StopMatcher(stop)
        waiting: list[Token] = []
        output: list[int] = []  # the ids yielded so far
        written = 0  # characters of text yielded so far
        for token, last in tokens:
            text, stopped = stops.push(decoder.push(token.id))
            if last and not stopped:  # the generation ends: release what was held back
                tail, stopped = stops.push(decoder.flush())
                text += tail + ("" if stopped else stops.flush())
            if stopped:
                self.last_run["finish_reason"] = "stop"
                tokens.close()
                waiting.append(token)
                needed = self._covering(output, waiting, written + len(text))
                waiting = waiting[: max(needed, 1 if text else 0)]
            if text or (last and not stopped) or (stopped and waiting):
                *before, token = [*waiting, token] if not stopped else waiting
                yield from before
                yield Token(token.id, text, token.logprob, token.top_logprobs)
                output += [t.id for t in before] + [token.id]
                written += len(text)
                waiting = []
            elif not stopped:
                waiting.append(token)
            if stopped or last:
                return

    def _covering(self, output: list[int], candidates: list[Token], length: int) -> int:
        """How many of `candidates`, after the ids `output`, it takes to decode to `length` characters."""
        decode = self.model.tokenizer.decode
        n = 0
        while n < len(candidates) and len(decode(output + [t.id for t in candidates[:n]])) < length:
            n += 1
        return n

    @torch.inference_mode()
    def _ids(
        self,
        prompt: list[int],
        max_new_tokens: int | None,
        params: SamplingParams,
        reuse_prefix: bool,
        logprobs: int,
        context: int,
    ) -> Iterator[tuple[Token, bool]]:
        """(token, whether the generation ends after it), its text not yet decoded; `max_new_tokens`
        None: until `context` positions are filled."""
        sampler = Sampler(params)
        ids = torch.tensor([prompt], dtype=torch.long)
        wanted = None if max_new_tokens is None else ids.shape[1] + max_new_tokens
        total = context if wanted is None else min(wanted, context)  # prompt + new tokens
        ran_out = "length" if total == wanted else "context"  # why it ends if no EOS comes first
        steps = total - ids.shape[1]
        eos = set(self.model.config.eos_token_ids) | (
            self.model.tokenizer.eos_ids if self.model.tokenizer else set()
        )
        cache = self.model.new_cache(1, max(total, 1))
        reused = self._reuse_prefix(prompt, cache) if reuse_prefix else 0
        run = self.last_run = {
            "prompt_tokens": len(prompt),
            "reused_tokens": reused,
            "prefill_s": 0.0,
            "new_tokens": 0,
            "decode_s": 0.0,
            "context": context,
            "finish_reason": None,
        }
        if steps == 0:
            run["finish_reason"] = ran_out
            return
        start = time.perf_counter()
        for s in range(reused, ids.shape[1], self.model.prefill_chunk):
            hidden = self.model.forward(ids[:, s : s + self.model.prefill_chunk], cache)
        seen = list(prompt)
        # the cache holds seen[:cache.length] whenever this generator stops (Ctrl-C included)
        self.prefix = (cache, seen) if reuse_prefix else None
        for step in range(steps):
            logits = self.model.hidden_logits(hidden[0, -1])  # [V]
            next_id = sampler(logits, seen)
            seen.append(next_id)
            token = Token(next_id)
            if logprobs:
                logprob, top = token_logprobs(logits, next_id, logprobs)
                token = Token(next_id, logprob=logprob, top_logprobs=top)
            last = next_id in eos or step == steps - 1
            if last:
                run["finish_reason"] = "stop" if next_id in eos else ran_out
            now = time.perf_counter()
            run["prefill_s" if step == 0 else "decode_s"] += now - start
            run["new_tokens"] += 1
            yield token, last
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
        limit = min(old.length, len(prompt) - 1, cache.capacity)
        n = 0
        while n < limit and old_ids[n] == prompt[n]:
            n += 1
        for new_layer, old_layer in zip(cache.keys + cache.values, old.keys + old.values, strict=True):
            new_layer[:, :, :n].copy_(old_layer[:, :, :n])
        cache.length = n
        return n

    def stats(self) -> dict:
        """Figures of the last generation: prompt tokens, prefill seconds (to the first new token),
        new tokens (every token the model picked, one that only completed a stop string included),
        decode seconds (for the others), the rates, the context and `finish_reason` (FINISH_REASONS;
        None if the caller stopped early); with expert streaming also "offload": slots, cache
        bytes, and OffloadStats counters of the last step and in total."""
        run = dict(self.last_run)
        if run.get("prefill_s"):
            run["prefill_tok_s"] = (run["prompt_tokens"] - run.get("reused_tokens", 0)) / run["prefill_s"]
        if run.get("decode_s"):
            run["decode_tok_s"] = (run["new_tokens"] - 1) / run["decode_s"]
        if self.model.expert_cache is not None:
            run["offload"] = self.model.expert_cache.summary()
        return run
