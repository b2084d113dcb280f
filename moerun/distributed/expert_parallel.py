"""Expert parallelism: which experts a rank owns, and the exchange of a MoE step's rows.

Placement: the E experts of every MoE layer are cut into W contiguous shares, the first E % W ranks
taking one more (`ExpertShard`). A rank loads only its share from the checkpoint.

A step: every rank holds every token (the dense part is replicated, and routing is computed
identically everywhere), so nothing needs dispatching: each rank computes the weighted rows of the
assignments routed to its own experts. A step's rows [T*k, H] are in plan order, grouped by expert
ascending, and a rank's experts are contiguous, so its rows are one contiguous span of them. The
exchange brings every rank every other rank's span (`exchange`); every rank then sums each token's
rows in plan order, the single process's combine, so logits equal one process's.

Two collectives do the exchange (`COLLECTIVES`): "all_to_all" (default), one all_to_all_single with
uneven splits in which each rank sends its span to every other: (W-1)/W of the rows received, no
zeros; "all_reduce", a sum of the whole [T*k, H] buffer, zero outside each rank's span (exact: each
row is one value plus zeros), a ring sending ~2(W-1)/W of it. The collective alone, 2 gloo ranks
over loopback, one thread each, H=2048, top-8 (docs/PERFORMANCE.md): at 1-8 tokens a step (decode)
the all-to-all takes 0.34-0.58 ms against the all-reduce's 0.54-0.79 ms, at 128 tokens 4.9-6.3 ms
against 6.6-6.8 ms, at 512 tokens 35-60 ms against 28 ms (gloo's all-to-all sends pair by pair, and
the span is copied once per rank). Decode sizes decide, and on a network the all-to-all sends half
the bytes: it is the default; `moerun bench --model --expert-parallel` measures both in one run.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moerun.settings import TORCHRUN_KEYS, settings

DEFAULT_TIMEOUT_S = 60.0


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ExpertParallelError(RuntimeError):
    """The ranks could not agree, or one stopped answering."""


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world` owns experts [start, stop) of `num_experts`."""

    rank: int
    world: int
    num_experts: int

    @property
    def start(self) -> int:
        base, extra = divmod(self.num_experts, self.world)
        return self.rank * base + min(self.rank, extra)

    @property
    def stop(self) -> int:
        base, extra = divmod(self.num_experts, self.world)
        return self.start + base + (1 if self.rank < extra else 0)

    @property
    def owned(self) -> list[int]:
        return list(range(self.start, self.stop))


COLLECTIVES = ("all_to_all", "all_reduce")


@dataclass
class StepFigures:
    """One forward pass on this rank, summed over its MoE layers: the bytes it sent in exchanges,
    the exchanges' milliseconds, and its own experts' milliseconds."""

    tokens: int = 0
    exchanges: int = 0
    sent_bytes: int = 0
    exchange_ms: float = 0.0
    expert_ms: float = 0.0

    def add(self, other: StepFigures) -> None:
        self.tokens += other.tokens
        self.exchanges += other.exchanges
        self.sent_bytes += other.sent_bytes
        self.exchange_ms += other.exchange_ms
        self.expert_ms += other.expert_ms

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "exchanges": self.exchanges,
            "sent_bytes": self.sent_bytes,
            "exchange_ms": round(self.exchange_ms, 3),
            "expert_ms": round(self.expert_ms, 3),
        }


@dataclass
class ExchangeStats:
    """Per rank: every step so far summed (`total`), the last step, and the steps counted."""

    steps: int = 0
    total: StepFigures = field(default_factory=StepFigures)
    last: StepFigures = field(default_factory=StepFigures)

    def begin_step(self, tokens: int) -> None:
        self.total.add(self.last)
        self.steps += 1
        self.last = StepFigures(tokens=tokens)

    def summed(self) -> StepFigures:
        out = StepFigures()
        out.add(self.total)
        out.add(self.last)
        return out

    def as_dict(self) -> dict:
        return {"steps": self.steps, **self.summed().as_dict(), "last_step": self.last.as_dict()}


class ExpertParallel:
    """This process's place in the expert-parallel group: rank, world size, timeout, the exchange."""

    def __init__(self, group=None, timeout_s: float = DEFAULT_TIMEOUT_S, collective: str = "all_to_all"):
        if not dist.is_available() or not dist.is_initialized():
            raise ExpertParallelError(
                "Expert parallelism needs torch.distributed initialised: start under torchrun, or call "
                "moerun.distributed.ExpertParallel.from_env()."
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if collective not in COLLECTIVES:
            raise ValueError(f"Unknown exchange collective {collective!r}; known: {', '.join(COLLECTIVES)}.")
        self.timeout_s = timeout_s
        self.collective = collective
        self.stats = ExchangeStats()

    @classmethod
    def from_env(
        cls, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu", collective: str = "all_to_all"
    ) -> ExpertParallel:
        """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), unless this
        process already has one: gloo on CPU, NCCL on CUDA."""
        if not dist.is_initialized():
            missing = [k for k in TORCHRUN_KEYS if k not in settings().torchrun_keys]
            if missing:
                raise ExpertParallelError(
                    f"Expert parallelism needs torchrun's environment ({', '.join(missing)} not set): "
                    "start with `torchrun --nproc-per-node W -m moerun ...`."
                )
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            # a group left to the interpreter's exit can abort it ("terminate called without an
            # active exception" from gloo's threads): the group joined here is left here
            atexit.register(_leave_group)
        return cls(timeout_s=timeout_s, collective=collective)

    def shard(self, num_experts: int) -> ExpertShard:
        return ExpertShard(self.rank, self.world, num_experts)

    def placement(self, num_experts: int) -> str:
        s = self.shard(num_experts)
        return f"rank {self.rank} of {self.world}: experts {s.start}-{s.stop - 1} of {num_experts}"

    def spans(self, offsets: list[int], num_experts: int) -> list[tuple[int, int]]:
        """Each rank's rows [start, stop) of a step's plan, from the plan's expert offsets [E+1]."""
        return [
            (offsets[s.start], offsets[s.stop])
            for s in (ExpertShard(r, self.world, num_experts) for r in range(self.world))
        ]

    def begin_step(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens starts: the figures that follow are its own."""
        self.stats.begin_step(tokens)

    def record_experts(self, ms: float) -> None:
        """This rank's own experts took `ms` milliseconds in the current step."""
        self.stats.last.expert_ms += ms

    def exchange(self, rows: torch.Tensor, spans: list[tuple[int, int]], layer: str) -> None:
        """rows [T*k, H] hold this rank's span (`spans[rank]`) of a step's rows; afterwards they hold
        every rank's, on every rank (the rows outside its span may hold anything before)."""
        start = time.perf_counter()
        mine = spans[self.rank][1] - spans[self.rank][0]
        row_bytes = rows.shape[1] * rows.element_size()
        try:
            if self.collective == "all_to_all":
                counts = [stop - first for first, stop in spans]
                first, stop = spans[self.rank]
                outgoing = rows[first:stop].repeat(self.world, 1)  # the span, once for every rank
                dist.all_to_all_single(rows, outgoing, counts, [mine] * self.world, group=self.group)
                sent = (self.world - 1) * mine * row_bytes
            else:  # the sum of each row's one value and the other ranks' zeros
                first, stop = spans[self.rank]
                rows[:first].zero_()
                rows[stop:].zero_()
                dist.all_reduce(rows, group=self.group)
                sent = 2 * (self.world - 1) * rows.numel() * rows.element_size() // self.world  # a ring's
        except Exception as e:  # gloo/NCCL: a peer closed the connection, or the timeout passed
            raise ExpertParallelError(
                f"{layer}: rank {self.rank}'s exchange of expert rows with the other {self.world - 1} "
                f"rank(s) failed (a rank died, or hung past the {self.timeout_s:.0f} s timeout): "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        step = self.stats.last
        step.exchanges += 1
        step.sent_bytes += sent
        step.exchange_ms += 1e3 * (time.perf_counter() - start)

    def check_same(self, what: str, text: str) -> None:
        """Refuse to start unless every rank has the same `text` (a checkpoint's config, the options):
        their digests are gathered and compared; the first rank that differs is named."""
        digest = torch.tensor(list(hashlib.sha256(text.encode()).digest()[:8]), dtype=torch.int64)
        gathered = [torch.empty_like(digest) for _ in range(self.world)]
        try:
            dist.all_gather(gathered, digest, group=self.group)
        except Exception as e:
            raise ExpertParallelError(f"the ranks could not compare their {what}: {e}") from None
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                raise ExpertParallelError(
                    f"rank {rank}'s {what} differs from rank 0's: every rank must load the same "
                    "checkpoint with the same options."
                )
