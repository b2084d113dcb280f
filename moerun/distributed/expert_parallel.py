"""Expert parallelism: which experts a rank owns, and the exchange of a MoE step's rows.

Placement: the E experts of every MoE layer are cut into W contiguous shares, the first E % W ranks
taking one more (`ExpertShard`). A rank loads only its share from the checkpoint.

A step: every rank holds every token (the dense part is replicated, and routing is computed
identically everywhere), computes the weighted rows [T*k, H] of the assignments routed to its own
experts, leaving the others zero, and one all-reduce (sum) gives every rank every row: each row is
one rank's value plus zeros, so exactly the value one process computes. Every rank then sums each
token's rows in plan order, the single process's combine, so logits equal one process's.

The all-reduce of T*k*H fp32 values was chosen over all-to-all dispatch for its exactness and its
simplicity at decode sizes (a few tokens a step, where the exchange is latency-bound either way); an
all-to-all would send each token's hidden state only to the ranks it needs, which pays at prefill.

A collective that fails or times out (a rank died or hangs) raises ExpertParallelError naming the
layer and the timeout, never a silent wait.
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


@dataclass
class ExchangeStats:
    """Per rank: the exchanges so far, their bytes and milliseconds, and the last step's."""

    calls: int = 0
    bytes: int = 0
    ms: float = 0.0
    last: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"exchanges": self.calls, "bytes": self.bytes, "ms": round(self.ms, 3), "last": self.last}


class ExpertParallel:
    """This process's place in the expert-parallel group: rank, world size, timeout, the exchange."""

    def __init__(self, group=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not dist.is_available() or not dist.is_initialized():
            raise ExpertParallelError(
                "Expert parallelism needs torch.distributed initialised: start under torchrun, or call "
                "moerun.distributed.ExpertParallel.from_env()."
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.stats = ExchangeStats()

    @classmethod
    def from_env(cls, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu") -> ExpertParallel:
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
        return cls(timeout_s=timeout_s)

    def shard(self, num_experts: int) -> ExpertShard:
        return ExpertShard(self.rank, self.world, num_experts)

    def placement(self, num_experts: int) -> str:
        s = self.shard(num_experts)
        return f"rank {self.rank} of {self.world}: experts {s.start}-{s.stop - 1} of {num_experts}"

    def exchange(self, rows: torch.Tensor, layer: str) -> None:
        """Every rank's rows (its own experts' values, zeros elsewhere) summed in place on every rank."""
        start = time.perf_counter()
        try:
            dist.all_reduce(rows, group=self.group)
        except Exception as e:  # gloo/NCCL: a peer closed the connection, or the timeout passed
            raise ExpertParallelError(
                f"{layer}: rank {self.rank}'s exchange of expert rows with the other {self.world - 1} "
                f"rank(s) failed (a rank died, or hung past the {self.timeout_s:.0f} s timeout): "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        ms = 1e3 * (time.perf_counter() - start)
        nbytes = rows.numel() * rows.element_size()
        self.stats.calls += 1
        self.stats.bytes += nbytes
        self.stats.ms += ms
        self.stats.last = {"layer": layer, "bytes": nbytes, "ms": round(ms, 3)}

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
