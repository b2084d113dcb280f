"""Continuous batching: several generations advanced together, one forward pass per step.

A `Batch` holds the running sequences, each with its own KV cache, sampler, token budget and stop
strings. Each `step` feeds every sequence its next input (a chunk of the prompt it has not read yet,
or the token it picked last) to one `Decoder.forward_sequences` pass, where the MoE layers see all
the step's tokens as one batch, so an expert that several sequences chose is read once. Then each
sequence whose input is all read picks its next token from its last position's logits
(moerun.sampling), and the tokens it releases come back. Sequences join between steps (`add`) and
leave when they finish (an end-of-sequence id, a stop string, their budget or their context) or are
cancelled, without stalling the rest. `model.generate` runs one on one prompt or a list of them;
a server adds requests as they come.

A request may ask for `n` choices: its prompt is prefilled once, by the first, and the others copy
that cache when it is full and pick their first token from the same logits, each with its own
sampler (seed + i) and from then on its own cache. A request under a grammar (moerun.text.grammar)
gives each sequence its own matcher; each step the masks of all constrained sequences are computed
in one call and applied to their logits before anything else sees them (penalties, temperature,
top-k/p, logprobs), and the sequence ends where its grammar is complete.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moerun.sampling import Sampler, SamplingParams, token_logprobs
from moerun.text.grammar import (
    CompiledGrammar,
    Grammar,
    GrammarError,
    Matcher,
    apply_masks,
    mask_bias,
    response_format_grammar,
    start_masks,
)
from moerun.text.stops import StopMatcher
from moerun.text.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from moerun.decoder.kv_cache import KVCache
    from moerun.decoder.model import Decoder

__all__ = ["FINISH_REASONS", "Batch", "Generation", "Grammar", "GrammarError", "Request", "Token"]

# a sequence's finish_reason: "stop" (an end-of-sequence id, a stop string or a complete grammar),
# "length" (its token budget), "context" (its context filled first), "cancelled", "error" (its grammar
# engine failed; stats["error"] says how); None while it runs
FINISH_REASONS = ("stop", "length", "context", "cancelled", "error")


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


@dataclass(frozen=True)
class Request:
    """One generation as asked for, checked (`Request.make`): prompt ids, at most `max_new_tokens`
    new tokens (None: until the context is full), sampling, stop strings, `logprobs` alternatives
    per token, the context in positions, prompt included, `n` choices and the grammar the text
    must match (None: any text)."""

    prompt: tuple[int, ...]
    max_new_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    context: int = 1
    n: int = 1
    grammar: CompiledGrammar | None = None

    @classmethod
    def make(
        cls,
        model: Decoder,
        prompt,
        max_new_tokens: int | None = 128,
        stop: Sequence[str] = (),
        logprobs: int = 0,
        ctx_size: int | None = None,
        n: int = 1,
        response_format: dict | Grammar | None = None,
        **sampling,
    ) -> Request:
        """A Request for `model`, every argument checked (ValueError or TypeError naming it):
        `prompt` text (which needs the model's tokenizer) or ids, `max_new_tokens` -1 or None for
        no limit, `ctx_size` None for the model's context, `n` choices, `response_format` OpenAI's
        (`{"type": "json_schema", "json_schema": {"schema": ...}}`, `{"type": "json_object"}`) or a
        moerun.text.grammar.Grammar (GrammarError, a ValueError, naming what cannot be enforced),
        sampling options as SamplingParams."""
        params = SamplingParams.from_options(**sampling)
        if max_new_tokens is not None and (not _integer(max_new_tokens) or max_new_tokens < -1):
            raise ValueError(
                f"max_new_tokens must be an integer >= 0, or -1 or None for no limit, got {max_new_tokens!r}."
            )
        if not _integer(logprobs) or logprobs < 0:
            raise ValueError(f"logprobs must be an integer >= 0 (alternatives per token), got {logprobs!r}.")
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise TypeError("stop is a list of strings.")
        if not _integer(n) or n < 1:
            raise ValueError(f"n must be an integer >= 1 (choices), got {n!r}.")
        ids = prompt_ids(prompt, model.tokenizer)
        if not ids:
            raise ValueError("A prompt needs at least one token.")
        model.check_ids(torch.tensor(ids))
        longest = model.config.max_positions
        context = longest if ctx_size is None else ctx_size
        if not _integer(context) or not 0 < context <= longest:
            raise ValueError(f"ctx_size must be in [1, {longest}] (this model's context), got {ctx_size!r}.")
        if len(ids) > context:
            raise ValueError(f"The prompt's {len(ids)} tokens do not fit a context of {context} positions.")
        budget = None if max_new_tokens in (None, -1) else max_new_tokens
        grammar = _compiled_grammar(model, response_format)
        return cls(tuple(ids), budget, params, tuple(stop), logprobs, context, n, grammar)


def _compiled_grammar(model: Decoder, response_format) -> CompiledGrammar | None:
    grammar = response_format
    if response_format is not None and not isinstance(response_format, Grammar):
        grammar = response_format_grammar(response_format)
    if grammar is None:
        return None
    if model.tokenizer is None:
        raise ValueError("Structured output needs the checkpoint's tokenizer; this one has none.")
    return grammar.compile(model.tokenizer, model.config.vocab_size, end_ids(model))


def end_ids(model: Decoder) -> set[int]:
    """The ids that end a generation: the config's and the tokenizer's end-of-sequence ids."""
    return set(model.config.eos_token_ids) | (model.tokenizer.eos_ids if model.tokenizer else set())


def prompt_ids(prompt, tokenizer: Tokenizer | None) -> list[int]:
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
    raise TypeError(f"A prompt is a str or a list of int token ids, not {type(prompt).__name__}.")


class TextRelease:
    """One sequence's tokens in, the same tokens with their text out, held back where the text may
    begin a stop string or ends inside a character. At a stop, of the held tokens and the last only
    those the released text needs come out; the stop string itself never does."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.decoder, self.stops = StreamDecoder(tokenizer), StopMatcher(stop)
        self.waiting: list[Token] = []
        self.output: list[int] = []  # the ids released so far
        self.written = 0  # characters of text released so far

    def push(self, token: Token, last: bool) -> tuple[list[Token], bool]:
        """`token` (`last`: the generation ends after it) -> (the tokens released now, whether a
        stop string began)."""
        text, stopped = self.stops.push(self.decoder.push(token.id))
        if last and not stopped:  # the generation ends: release what was held back
            tail, stopped = self.stops.push(self.decoder.flush())
            text += tail + ("" if stopped else self.stops.flush())
        waiting = self.waiting
        if stopped:
            waiting.append(token)
            needed = self._covering(waiting, self.written + len(text))
            waiting = waiting[: max(needed, 1 if text else 0)]
        if text or (last and not stopped) or (stopped and waiting):
            *before, final = waiting if stopped else [*waiting, token]
            released = [*before, Token(final.id, text, final.logprob, final.top_logprobs)]
            self.output += [t.id for t in released]
            self.written += len(text)
            self.waiting = []
            return released, stopped
        if not stopped:
            waiting.append(token)
        return [], stopped

    def _covering(self, candidates: list[Token], length: int) -> int:
        """How many of `candidates`, after the ids released, it takes to decode to `length` characters:
        a binary search (more ids never decode to less text), so a stop string held back over many
        tokens costs a few decodes, not one per token."""
        ids = self.output + [t.id for t in candidates]
        low, high = 0, len(candidates)
        while low < high:
            middle = (low + high) // 2
            if len(self.tokenizer.decode(ids[: len(self.output) + middle])) < length:
                low = middle + 1
            else:
                high = middle
        return low


class Generation:
    """One generation in a batch: its cache holds `seen[:cache.length]` (prompt, then output), and
    its next input is whatever of `seen` the cache does not hold yet. Choice `index` of its request;
    the first choice holds the others (`choices`, itself first), which wait in `forks` until its
    prompt is read and then start from a copy of its cache."""

    def __init__(
        self,
        model: Decoder,
        request: Request,
        prefix: tuple[KVCache, list[int]] | None = None,
        index: int = 0,
    ):
        self.request, self.index = request, index
        prompt = list(request.prompt)
        budget = request.max_new_tokens
        wanted = None if budget is None else len(prompt) + budget
        total = request.context if wanted is None else min(wanted, request.context)  # prompt + new tokens
        self.ran_out = "length" if total == wanted else "context"  # why it ends if no EOS comes first
        self.steps_left = total - len(prompt)
        self.eos = end_ids(model)
        self.cache = model.new_cache(1, max(total, 1))
        self.seen = prompt
        reused = self._reuse(*prefix) if prefix is not None else 0
        seed = request.params.seed
        params = request.params if seed is None else dataclasses.replace(request.params, seed=seed + index)
        self.sampler = Sampler(params)
        self.matcher: Matcher | None = request.grammar.matcher() if request.grammar is not None else None
        self.text = TextRelease(model.tokenizer, request.stop) if model.tokenizer is not None else None
        self.stats = {
            "prompt_tokens": len(prompt),
            "reused_tokens": reused,
            "prefill_s": 0.0,
            "new_tokens": 0,
            "decode_s": 0.0,
            "context": request.context,
            "finish_reason": None if self.steps_left else self.ran_out,
        }
        self.forks: list[Generation] = []
        if index == 0:
            self.forks = [Generation(model, request, None, i) for i in range(1, request.n)]
        self.choices = [self, *self.forks]

    @property
    def finished(self) -> bool:
        return self.stats["finish_reason"] is not None

    @property
    def argmax_only(self) -> bool:
        """Whether its next token is the argmax of the logits as they come (see Sampler.argmax_only)."""
        return self.matcher is None and self.sampler.argmax_only

    def next_input(self, limit: int) -> list[int]:
        """At most `limit` of the ids the cache does not hold yet."""
        start = self.cache.length
        return self.seen[start : start + limit]

    def pick(self, logits: torch.Tensor, next_id: int | None = None) -> list[Token]:
        """The next token from its logits [V] (under a grammar, already masked: `Batch.step`), or
        `next_id`, their argmax where nothing else decides (`argmax_only`) -> the tokens this
        releases (finishing the sequence when it is an end-of-sequence id, completes a stop string
        or the grammar, or is the last there is room for)."""
        if next_id is None:
            next_id = self.sampler(logits, self.seen, self.seen[len(self.request.prompt) :])
        self.seen.append(next_id)
        token = Token(next_id)
        if self.request.logprobs:
            logprob, top = token_logprobs(logits, next_id, self.request.logprobs)
            token = Token(next_id, logprob=logprob, top_logprobs=top)
        self.steps_left -= 1
        self.stats["new_tokens"] += 1
        complete = False
        if self.matcher is not None and next_id not in self.eos:
            try:
                self.matcher.advance(next_id)
            except GrammarError as e:  # this sequence ends; the batch goes on
                self.stats["finish_reason"], self.stats["error"] = "error", str(e)
                return []
            complete = self.matcher.done  # nothing may follow: no need to wait for an end id
        last = next_id in self.eos or complete or self.steps_left == 0
        released, stopped = self.text.push(token, last) if self.text is not None else ([token], False)
        if stopped or last:
            ended = stopped or complete or next_id in self.eos
            self.stats["finish_reason"] = "stop" if ended else self.ran_out
        return released

    def start_forks(self, logits: torch.Tensor) -> list[tuple[Generation, list[Token]]]:
        """(The first choice, its prompt just read.) The other choices take a copy of its cache and
        pick their first tokens from the same logits [V] -> (choice, the tokens it released)."""
        out = []
        for fork in self.forks:
            fork.cache.copy_prefix(self.cache, len(self.request.prompt))
            out.append((fork, fork.pick(logits)))
        self.forks = []
        return out

    def _reuse(self, old: KVCache, old_ids: list[int]) -> int:
        """Copy into this cache the longest run of positions `old` holds that starts the prompt (all
        but its last token: that one's logits are needed) -> how many."""
        limit = min(old.length, len(self.seen) - 1, self.cache.capacity)
        n = 0
        while n < limit and old_ids[n] == self.seen[n]:
            n += 1
        self.cache.copy_prefix(old, n)
        return n


class Batch:
    """The running sequences of one model, stepped together."""

    def __init__(self, model: Decoder):
        self.model = model
        self.running: list[Generation] = []
        # seconds the steps spent on grammars beyond the forward pass: starting the masks, waiting
        # for them after it, applying them, and each matcher taking its token
        self.grammar_s = 0.0

    def add(self, request: Request, prefix: tuple[KVCache, list[int]] | None = None) -> Generation:
        """Start `request` (joining at the next step) -> its first choice (`.choices`: all of them);
        `prefix`: a cache and the ids it holds, whose positions that begin this prompt are copied
        rather than computed again."""
        sequence = Generation(self.model, request, prefix)
        if not sequence.finished:
            self.running.append(sequence)
        return sequence

    def cancel(self, sequence: Generation) -> None:
        """Stop `sequence` and its other choices now (a client gone): they leave at once, their
        caches freed with them."""
        for choice in sequence.choices:
            if choice in self.running:
                self.running.remove(choice)
            if not choice.finished:
                choice.stats["finish_reason"] = "cancelled"
        sequence.forks = []

    @torch.inference_mode()
    def step(self) -> list[tuple[Generation, list[Token]]]:
        """One forward pass over every running sequence's next input -> (sequence, the tokens it
        released) for each that picked a token; finished sequences leave. Each sequence reading its
        prompt takes a chunk of it, within a step's budget of `prefill_chunk` tokens (the decoding
        sequences' one token each come first), so a long prompt joins over several steps. A first
        choice whose prompt is read starts its other choices from the same logits."""
        decoding = sum(1 for s in self.running if s.stats["new_tokens"])
        room = max(self.model.prefill_chunk - decoding, 0)  # prompt tokens this step
        stepping, inputs = [], []
        for s in self.running:
            if s.stats["new_tokens"]:
                ids = s.next_input(1)
            elif room > 0:
                ids = s.next_input(room)
                room -= len(ids)
            else:
                continue
            stepping.append(s)
            inputs.append(torch.tensor(ids, dtype=torch.long))
        if not stepping:
            return []
        decoded = [s.stats["new_tokens"] > 0 for s in stepping]  # else this step's time is prefill's
        start = time.perf_counter()
        # the sequences that pick a token this step: those whose input reaches the end of `seen`
        ready_at = [i for i, s in enumerate(stepping) if s.cache.length + len(inputs[i]) == len(s.seen)]
        ready = [stepping[i] for i in ready_at]
        started = time.perf_counter()
        masks = self._start_masks(ready)  # the grammars' masks, computed while the model runs
        grammar_s = time.perf_counter() - started if masks is not None else 0.0
        hidden = self.model.forward_sequences(inputs, [s.cache for s in stepping])  # [S, H]
        out = []
        if ready:
            if len(stepping) == 1:
                logits = self.model.hidden_logits(hidden[0]).unsqueeze(0)  # [1, V] fp32
            else:
                logits = self.model.hidden_logits(hidden[torch.tensor(ready_at)])  # [S', V] fp32
            if masks is not None:
                masked = time.perf_counter()
                logits = self._masked(logits, ready, masks)
                grammar_s += time.perf_counter() - masked
            matchers = [s.matcher for s in ready if s.matcher is not None]
            advanced = sum(m.seconds for m in matchers)
            # the greedy sequences' tokens from one argmax call (each row's the same as its own)
            greedy = [s.argmax_only for s in ready]
            argmaxes = logits.argmax(dim=-1).tolist() if any(greedy) else None
            for j, s in enumerate(ready):
                out.append((s, s.pick(logits[j], argmaxes[j] if greedy[j] else None)))
                if s.forks:
                    forks = s.start_forks(logits[j])
                    out += forks
                    self.running += [f for f, _ in forks if not f.finished]
            grammar_s += sum(m.seconds for m in matchers) - advanced
        self.grammar_s += grammar_s
        elapsed = time.perf_counter() - start
        for s, was_decoding in zip(stepping, decoded, strict=True):
            s.stats["decode_s" if was_decoding else "prefill_s"] += elapsed
        self.running = [s for s in self.running if not s.finished]
        return out

    @staticmethod
    def _start_masks(ready: list[Generation]) -> Future | None:
        """The masks of the constrained sequences among `ready`, in one call on a background thread."""
        constrained = [s for s in ready if s.matcher is not None]
        if not constrained:
            return None
        return start_masks([s.matcher for s in constrained], constrained[0].request.grammar.mask_vocab)

    @staticmethod
    def _masked(logits: torch.Tensor, ready: list[Generation], pending: Future) -> torch.Tensor:
        """logits [S', V] with the tokens each constrained sequence's grammar forbids at -inf."""
        masks = pending.result()
        constrained = [j for j, s in enumerate(ready) if s.matcher is not None]
        if len(constrained) == len(ready):
            return apply_masks(logits, masks)
        rows = torch.tensor(constrained, device=logits.device)
        logits[rows] += mask_bias(masks, logits.shape[1], logits.device)
        return logits
