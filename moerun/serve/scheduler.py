"""The server's scheduler: one thread owns the model and a moerun.batching.Batch and steps it while
any request runs (continuous batching). Requests arrive from the HTTP side through `submit`; at most
`parallel` sequences run at once (a request of `n` choices is n of them; one larger than `parallel`
runs alone), the rest wait in order (up to `queue_size`, beyond which `submit` refuses). Before each
step the waiting join as slots free and the cancelled leave; after it each request's released
tokens go to its sink, a callable the HTTP side gave (it must not block: it hands the event to the
event loop). A request's sink gets ("tokens", (choice index, [Token, ...])) events, then one
("done", [stats of each choice]) or ("error", message).

Prompt prefixes are reused across requests: the caches of the last `parallel` finished requests are
kept with the ids they hold, and a new request whose prompt begins with one of them copies those
positions instead of computing them (a conversation's next turn repeats its earlier ones).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moerun.batching import Batch, Generation, Request, end_ids
from moerun.text import grammar

if TYPE_CHECKING:
    from moerun.decoder.kv_cache import KVCache
    from moerun.decoder.model import Decoder

Sink = Callable[[tuple[str, object]], None]
SHUTTING_DOWN = "The server is shutting down."  # the error every unfinished request gets at `stop`


class QueueFull(RuntimeError):
    """More requests waiting than the server takes (or the server is shutting down)."""


@dataclass(eq=False)
class Job:
    """One request on its way through the scheduler."""

    request: Request
    sink: Sink
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    generation: Generation | None = None
    first_token_s: float | None = None  # seconds from submission to the first released token


@dataclass
class Counters:
    """What /metrics reports."""

    requests: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_s: float = 0.0
    grammar_s: float = 0.0  # of step_s, the grammars' part (moerun.batching.Batch.grammar_s)
    # the last few steps' (new tokens, seconds), for a current rate
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))

    def rate(self) -> float:
        tokens, seconds = sum(t for t, _ in self.recent), sum(s for _, s in self.recent)
        return tokens / seconds if seconds else 0.0


class Scheduler:
    def __init__(
        self, model: Decoder, parallel: int = 4, queue_size: int = 64, keep_prefixes: int | None = None
    ):
        self.model, self.parallel, self.queue_size = model, parallel, queue_size
        self.batch = Batch(model)
        self.counters = Counters()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._prefixes: collections.deque[tuple[KVCache, list[int]]] = collections.deque(
            maxlen=parallel if keep_prefixes is None else keep_prefixes
        )
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="moerun-scheduler", daemon=True)
        self._thread.start()
        # the grammar engine's view of the vocabulary (1-4 s at 150k ids), before a request needs it
        vocabulary = (model.tokenizer, model.config.vocab_size, end_ids(model))
        threading.Thread(target=grammar.prepare, args=vocabulary, name="moerun-grammar", daemon=True).start()

    # --- the HTTP side ---

    def submit(self, request: Request, sink: Sink) -> Job:
        """Queue `request`; raises QueueFull when `queue_size` requests already wait."""
        job = Job(request, sink)
        with self._wake:
            if self._stopping:
                raise QueueFull(SHUTTING_DOWN)
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this server queues.")
            self._waiting.append(job)
            self.counters.requests += 1
            self._wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone: the job leaves before the next step (its slot freed)."""
        with self._wake:
            job.cancelled = True
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def running_sequences(self) -> int:
        return sum(job.request.n for job in self._running)

    def stop(self) -> None:
        """End every request, running or waiting, with the error SHUTTING_DOWN after the step under
        way, and take no more; returns at once."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=30)

    # --- the scheduler thread ---

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
                self._admit()
            if self._running:
                self._step()
        for job in [*self._running, *self._waiting]:
            job.sink(("error", SHUTTING_DOWN))

    def _admit(self) -> None:
        """(Holding the lock.) Drop the cancelled; start waiting jobs while there are free slots."""
        for job in [j for j in self._running if j.cancelled]:
            self._leave(job)
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self.counters.cancelled += 1
        while self._waiting and (
            not self._running or self.running_sequences + self._waiting[0].request.n <= self.parallel
        ):
            job = self._waiting.popleft()
            try:
                job.generation = self.batch.add(job.request, self._best_prefix(job.request.prompt))
            except Exception as e:  # a cache the device cannot hold, ...
                self.counters.failed += 1
                job.sink(("error", str(e)))
                continue
            self.counters.prompt_tokens += len(job.request.prompt)
            self.counters.reused_tokens += job.generation.stats["reused_tokens"]
            if _finished(job):  # nothing to generate (a zero budget)
                self._finish(job)
            else:
                self._running.append(job)

    def _best_prefix(self, prompt: tuple[int, ...]) -> tuple[KVCache, list[int]] | None:
        best, best_n = None, 0
        for cache, ids in self._prefixes:
            n = 0
            limit = min(len(ids), cache.length, len(prompt) - 1)
            while n < limit and ids[n] == prompt[n]:
                n += 1
            if n > best_n:
                best, best_n = (cache, ids), n
        return best

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            released = self.batch.step()
        except Exception as e:  # the model failed: every running request gets the error, the server stays
            message = f"The model failed on this step: {type(e).__name__}: {e}"
            with self._wake:
                for job in list(self._running):
                    self.batch.cancel(job.generation)
                    self._running.remove(job)
                    self.counters.failed += 1
                    job.sink(("error", message))
            return
        seconds = time.perf_counter() - start
        # counted before the tokens go out: a client that has its reply finds them in the metrics
        c, new = self.counters, len(released)
        c.steps, c.step_s, c.generated_tokens = c.steps + 1, c.step_s + seconds, c.generated_tokens + new
        c.grammar_s = self.batch.grammar_s
        c.recent.append((new, seconds))
        by_generation = {id(choice): job for job in self._running for choice in job.generation.choices}
        for generation, tokens in released:
            job = by_generation[id(generation)]
            if tokens and not job.cancelled:
                if job.first_token_s is None:
                    job.first_token_s = time.perf_counter() - job.submitted
                job.sink(("tokens", (generation.index, tokens)))
        with self._wake:
            for job in [j for j in self._running if _finished(j)]:
                self._running.remove(job)
                self._finish(job)

    def _leave(self, job: Job) -> None:
        self.batch.cancel(job.generation)
        self._running.remove(job)
        self.counters.cancelled += 1

    def _finish(self, job: Job) -> None:
        generation = job.generation
        self._prefixes.append((generation.cache, generation.seen))
        stats = [dict(choice.stats, first_token_s=job.first_token_s) for choice in generation.choices]
        errors = [s["error"] for s in stats if "error" in s]  # a grammar that broke down
        if errors:
            self.counters.failed += 1
        else:
            self.counters.finished += 1
        if not job.cancelled:
            job.sink(("error", errors[0]) if errors else ("done", stats))


def _finished(job: Job) -> bool:
    return all(choice.finished for choice in job.generation.choices)
