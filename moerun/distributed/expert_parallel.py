"""Expert parallelism: which experts a rank owns, and how a step's work moves between the ranks.

Placement: the E experts of every MoE layer are cut into W contiguous shares, the first E % W ranks
taking one more (`ExpertShard`). A rank loads only its share from the checkpoint.

Rank 0 leads: it runs the model (the dense part, routing, the combine, sampling: whatever command
or server drives it), and the other ranks serve their experts to it (`Decoder.serve_experts`), so
any driver runs expert-parallel, a server whose requests reach rank 0 alone included. A forward
pass on rank 0 announces itself on a control group (`begin_step`: its tokens, activation dtype and
collective); then at each MoE layer rank 0 sends the layer's normed hidden states with their
routing (expert ids and weights, [T, H + 2k] fp32, exact for bf16 and fp32 activations) to every
rank (`share_inputs`), each rank computes the weighted rows of the assignments routed to its own
experts, and the rows come back to rank 0 (`exchange`), which sums each token's rows in plan order,
the single process's combine, so its logits equal one process's. A step's rows [T*k, H] are in
plan order, grouped by expert ascending, and a rank's experts are contiguous, so its rows are one
contiguous span; rank 0's span comes first, so the others' spans fill the tail of its buffer.

Two collectives bring the rows back (`COLLECTIVES`): "all_to_all" (default), one all_to_all_single
with uneven splits in which every other rank sends its span to rank 0 (no zeros); "reduce", a sum
into rank 0 of the whole [T*k, H] buffer, zero outside each rank's span (exact: each row is one
value plus zeros). docs/PERFORMANCE.md has both measured; `moerun bench --model --expert-parallel`
measures both in one run.

A step that fails partway on rank 0 (its own error: a bad value, Ctrl-C in chat, a request's error
in a server) leaves the others inside it; rank 0 completes the layer whose inputs they hold (it
takes their rows and drops them) and calls off the rest of the step with one message, so they wait
for the next step and the group goes on serving (`step`). A failed collective (a rank gone) leaves
the group unusable: the next step says so at once.

Waiting: a step's collectives wait as long as the group's timeout (`from_env` sets up the group with
`timeout_s`), and an error says how long that was. Between steps the other ranks wait on the
control group for rank 0's next header, up to `idle_timeout_s`; a server may sit idle far longer,
so while no step is announced rank 0 sends a "still here" header every quarter of that. A
collective that fails names the ranks that stopped answering (moerun.distributed.heartbeat).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moerun.distributed.heartbeat import Heartbeat
from moerun.quant.formats import QTensor
from moerun.quant.halves import GateUpHalves
from moerun.settings import TORCHRUN_KEYS, settings

DEFAULT_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 2 * 3600.0  # the other ranks' wait for rank 0's next header (a step, or "still here")
# a step header on the control group: [kind, tokens, collective, activation dtype, predicts]
_STEP, _FINISH, _KEEPALIVE = 1, 0, 2
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _default_store():
    """The key-value store the default group was set up with (None where torch keeps it hidden)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


class ExpertParallelError(RuntimeError):
    """The ranks could not agree, or one stopped answering."""


class CollectiveError(ExpertParallelError):
    """A collective failed: a rank died, hung, or left the step; the group is unusable."""


@contextlib.contextmanager
def _held_interrupts():
    """Ctrl-C held back until the block ends, then raised: a collective and the note of it (what
    the other ranks now expect) happen both or neither. gloo's waits cannot be interrupted anyway;
    Python raises KeyboardInterrupt in the main thread only, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending and callable(previous):
            previous(signal.SIGINT, pending[0])
        elif pending and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


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

    @property
    def size(self) -> int:
        return self.stop - self.start

    def cut(self, tensors: Mapping[str, object]) -> dict[str, object]:
        """`tensors` (canonical names, a model's or one MoE layer's) with every expert tensor
        [E, ...] cut to this share's experts [start, stop): views (or storage-free stand-ins'
        views), nothing read or copied. Expert tensors already cut to the share are kept as they are."""
        experts = (k for k in tensors if k.rpartition("moe.")[2].startswith("experts."))
        return {**tensors, **{k: self.cut_one(tensors[k]) for k in experts}}

    def cut_one(self, t):
        """One expert tensor or QTensor [E, ...] -> its rows [start, stop) (a view); anything else
        (already cut, or not E experts, for the checks to report) as it is."""
        if len(t.shape) == 0 or t.shape[0] != self.num_experts or self.size == self.num_experts:
            return t
        if isinstance(t, GateUpHalves):
            return t.experts(self.start, self.stop)
        if isinstance(t, QTensor):
            return QTensor(t.format, (self.size, *t.shape[1:]), t.data[self.start : self.stop])
        return t[self.start : self.stop]


COLLECTIVES = ("all_to_all", "reduce")


@dataclass
class StepFigures:
    """One forward pass on this rank, summed over its MoE layers: the bytes it sent (rank 0: the
    layers' inputs to every other rank; the others: their rows) and received (rank 0: the other
    ranks' rows), the milliseconds of those collectives, and of its own experts."""

    tokens: int = 0
    exchanges: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    exchange_ms: float = 0.0
    expert_ms: float = 0.0

    def add(self, other: StepFigures) -> None:
        self.tokens += other.tokens
        self.exchanges += other.exchanges
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.exchange_ms += other.exchange_ms
        self.expert_ms += other.expert_ms

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "exchanges": self.exchanges,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "exchange_ms": round(self.exchange_ms, 3),
            "expert_ms": round(self.expert_ms, 3),
        }


@dataclass
class ExchangeStats:
    """Per rank: every step so far summed (`total`), the last step, and the steps counted."""

    steps: int = 0
    abandoned: int = 0  # steps rank 0 called off partway (an error there)
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
        return {
            "steps": self.steps,
            "abandoned": self.abandoned,
            **self.summed().as_dict(),
            "last_step": self.last.as_dict(),
        }


class ExpertParallel:
    """This process's place in the expert-parallel group: rank, world size, timeout, the messages of
    a step. Rank 0 leads (`leads`); see the module's docstring. `group`: a torch.distributed group
    (a part of a larger job, its members alone constructing this; ranks are the group's); default:
    every process."""

    def __init__(
        self,
        group=None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        collective: str = "all_to_all",
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ):
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
        # the group's processes (global ranks), its rank 0 among them
        if self.rank < 0:
            raise ExpertParallelError(f"process {dist.get_rank()} is not in the group it was given.")
        members = range(self.world) if group is None else dist.get_process_group_ranks(group)
        self.members = sorted(members, key=lambda r: r if group is None else dist.get_group_rank(group, r))
        self.leader = self.members[0]
        # step headers wait as long as a server may sit idle; gloo also for NCCL groups (a few ints).
        # A group within a larger job: its members alone set up theirs
        self.idle_timeout_s = idle_timeout_s
        idle = datetime.timedelta(seconds=idle_timeout_s)
        if group is None:
            self.control = dist.new_group(backend="gloo", timeout=idle)
        else:
            self.control = dist.new_group(self.members, idle, "gloo", use_local_synchronization=True)
        self.heartbeat = Heartbeat(_default_store(), dist.get_rank(), self.members)
        self.finished = False
        # rank 0's headers: from the model's thread (steps) and the keep-alive thread, one at a time
        self._header_lock, self._announced = threading.Lock(), time.monotonic()
        self._stop = threading.Event()
        # rank 0: the model's step shape (bind), and where the current step stands, so that a step
        # failing partway can be completed for the others (step); why the group is unusable, if it is
        self._layers, self._width, self._num_experts, self._device = 0, 0, 0, torch.device("cpu")
        self._tokens, self._layers_left, self._open = 0, 0, None
        self._predicts, self._prediction = False, None  # the next MoE layer's expert mass, to send
        self.broken: str | None = None
        if self.leads:
            threading.Thread(target=self._keep_alive, name="moerun-keepalive", daemon=True).start()

    @property
    def leads(self) -> bool:
        """Whether this is rank 0, which runs the model; the others serve their experts to it."""
        return self.rank == 0

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
            if backend == "nccl":  # each process on its machine's GPU LOCAL_RANK, as torchrun means
                torch.cuda.set_device(settings().local_rank)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            # a group left to the interpreter's exit can abort it ("terminate called without an
            # active exception" from gloo's threads): the group joined here is left here
            atexit.register(_leave_group)
        ep = cls(timeout_s=timeout_s, collective=collective)
        atexit.register(ep.finish)  # runs before _leave_group (atexit runs last registered first)
        return ep

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

    def bind(self, moe_layers: int, hidden: int, top_k: int, num_experts: int, device) -> None:
        """The model this group runs (one model a group): its MoE layers' count and shape, its device."""
        if self._layers:
            raise ExpertParallelError(
                "this expert-parallel group already runs a model: make a new ExpertParallel for another."
            )
        self._layers, self._width, self._num_experts = moe_layers, hidden + 2 * top_k, num_experts
        self._device = torch.device(device)

    def _rows(self, tokens: int, predicted: bool) -> int:
        """Rows of a MoE layer's inputs message [rows, H + 2k]: a row per token, then (`predicted`)
        the next MoE layer's expert mass [E], in as many rows as it fills."""
        return tokens + (-(-self._num_experts // self._width) if predicted else 0)

    # rank 0's side of a step

    @contextlib.contextmanager
    def step(self, tokens: int, dtype: torch.dtype, predicts: bool = False):
        """Rank 0: a forward pass (`begin_step`) around the block that runs it. Should the block
        raise partway (its own error), the other ranks are still inside the step: the layer whose
        inputs they hold is completed (their rows taken and dropped) and the rest of the step is
        called off, so they wait for the next one. Should a collective fail (a rank gone), the group
        is unusable, and the next step says so at once (on gloo; NCCL may instead end the process
        from its watchdog, as its collectives fail asynchronously)."""
        try:
            self.begin_step(tokens, dtype, predicts)
            yield
        except CollectiveError as e:
            self.broken = str(e)
            raise
        except BaseException:
            self._abandon()
            raise
        if self._layers_left or self._open is not None:  # the model skipped a MoE layer: a bug
            self._abandon()
            raise ExpertParallelError(f"rank 0 ran a step without {self._layers_left} of its MoE layers.")

    def _abandon(self) -> None:
        """Rank 0: complete the layer whose inputs the others hold (their rows received, dropped),
        then call off the step's other layers (inputs whose first id is -1). A collective failing
        here leaves the group unusable (`broken`), the error that ended the step going on."""
        sent = self._open is not None or self._layers_left > 0
        try:
            with _held_interrupts():  # all of it, or the others are left halfway
                self._call_off()
            self.stats.abandoned += sent
        except CollectiveError as e:
            self.broken = str(e)
        except BaseException as e:
            self.broken = f"calling off a step that failed on rank 0 failed too ({e!r})"
            raise
        finally:
            self._open, self._layers_left, self._prediction = None, 0, None

    def _call_off(self) -> None:
        """The open layer's rows taken (and dropped), then the marker for the layers left."""
        if self._open is not None:
            ids, layer = self._open
            counts = torch.bincount(ids.reshape(-1).cpu(), minlength=self._num_experts)
            offsets = [0, *counts.cumsum(0).tolist()]
            rows = torch.zeros((ids.numel(), self._width - 2 * ids.shape[1]), device=ids.device)
            self.exchange(rows, self.spans(offsets, self._num_experts), layer)
        if self._layers_left:
            rows = self._rows(self._tokens, self._predicts and self._layers_left > 1)
            called_off = torch.full((rows, self._width), -1.0, device=self._device)
            what = "call off the rest of the step"
            self._collective(what, dist.broadcast, called_off, self.leader, group=self.group)

    def begin_step(self, tokens: int, dtype: torch.dtype, predicts: bool = False) -> None:
        """Rank 0: a forward pass of `tokens` tokens with activations in `dtype` starts; the other
        ranks are told (they serve each of its MoE layers). The figures that follow are its own.
        `predicts`: each MoE layer's inputs but the last carry the next one's expert mass (`predict`),
        for the others to prefetch their experts from it."""
        if not self.leads:
            raise ExpertParallelError(
                f"rank {self.rank} serves its experts to rank 0, which runs the model: call "
                "model.serve_experts() on every rank but 0."
            )
        if self.finished:
            raise ExpertParallelError(
                "rank 0 already released the other ranks (finish): load the model again."
            )
        if self.broken is not None:
            raise ExpertParallelError(f"the expert-parallel group failed in an earlier step: {self.broken}")
        if not self._layers:
            raise ExpertParallelError(
                "no model is bound to this expert-parallel group (the model binds it at construction)."
            )
        with _held_interrupts():  # announced and noted, or neither
            header = (_STEP, tokens, COLLECTIVES.index(self.collective), _DTYPES.index(dtype), int(predicts))
            self._announce(*header)
            self.stats.begin_step(tokens)
            self._tokens, self._layers_left, self._open = tokens, self._layers, None
            self._predicts, self._prediction = predicts, None

    def predict(self, mass: torch.Tensor) -> None:
        """Rank 0, in a step that `predicts`: the next MoE layer's expert mass [E] (its router's
        probabilities summed over the tokens), sent with the current layer's inputs."""
        self._prediction = mass

    def _announce(self, *header: int) -> None:
        with self._header_lock:
            if header[0] == _KEEPALIVE and self.finished:  # the others left after the last header
                return
            self._collective(
                "announce a step", dist.broadcast, torch.tensor(header), self.leader, group=self.control
            )
            self._announced = time.monotonic()

    def _keep_alive(self) -> None:
        """Rank 0: a "still here" header whenever a quarter of the idle timeout passed without one."""
        period = self.idle_timeout_s / 4
        while not self._stop.wait(min(period, max(0.0, self._announced + period - time.monotonic()))):
            if time.monotonic() - self._announced >= period:
                try:
                    self._announce(_KEEPALIVE, 0, 0, 0, 0)
                except ExpertParallelError:  # the others are gone: the next step says so
                    return

    def share_inputs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: str) -> None:
        """Rank 0: a MoE layer's normed hidden states x [T, H] and routing (ids, weights [T, k]) to
        every other rank."""
        start = time.perf_counter()
        packed = torch.cat([x.float(), ids.float(), weights.float()], dim=1)  # [T, H+2k]
        if self._predicts and self._layers_left > 1:  # the next MoE layer's expert mass, in rows
            if self._prediction is None:
                raise ExpertParallelError(f"{layer}: rank 0 announced predictions and made none.")
            rows = self._rows(0, True)
            mass = packed.new_zeros(rows * self._width)
            mass[: self._num_experts] = self._prediction.float()
            packed, self._prediction = torch.cat([packed, mass.view(rows, self._width)]), None
        packed = packed.contiguous()
        with _held_interrupts():  # sent and noted, or neither
            what = f"{layer}: send the layer's inputs"
            self._collective(what, dist.broadcast, packed, self.leader, group=self.group)
            self._layers_left, self._open = self._layers_left - 1, (ids, layer)
        step = self.stats.last
        step.sent_bytes += (self.world - 1) * packed.numel() * packed.element_size()
        step.exchange_ms += 1e3 * (time.perf_counter() - start)

    def finish(self) -> None:
        """Once: stop this rank's heartbeat and keep-alive threads (a thread still calling into the
        store while the interpreter exits can abort the process); rank 0 also releases the other
        ranks (their serve_experts returns) while the group is there."""
        if self.finished:
            return
        self.finished = True
        self._stop.set()
        self.heartbeat.stop()
        if self.leads and self.broken is None and dist.is_initialized():  # broken: nobody to release
            with contextlib.suppress(ExpertParallelError):  # the others are gone already: nothing to release
                self._announce(_FINISH, 0, 0, 0, 0)

    # the other ranks' side

    def next_step(self) -> tuple[int, torch.dtype, bool] | None:
        """Another rank: wait for rank 0's next forward pass -> (its tokens, its activation dtype,
        whether its MoE layers' inputs carry the next layer's expert mass), or None once rank 0 is
        finished."""
        header = torch.empty(5, dtype=torch.int64)
        kind = _KEEPALIVE
        while kind == _KEEPALIVE:
            what = "wait for rank 0's next step"
            self._collective(what, dist.broadcast, header, self.leader, group=self.control)
            kind, tokens, collective, dtype, predicts = header.tolist()
        if kind == _FINISH:
            self.finished = True
            self.heartbeat.stop()
            return None
        self.collective = COLLECTIVES[collective]
        self.stats.begin_step(tokens)
        return tokens, _DTYPES[dtype], bool(predicts)

    def receive_inputs(
        self,
        tokens: int,
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
        layer: str,
        device=None,
        predicted: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Another rank: a MoE layer's inputs from rank 0 -> x [T, H] in `dtype`, ids int64 and
        weights fp32 [T, k], on `device` (the layer's: NCCL moves CUDA tensors), and (`predicted`)
        the next MoE layer's expert mass [E], else None; None where rank 0 called off the rest of
        the step (an error there)."""
        start = time.perf_counter()
        rows = self._rows(tokens, predicted)
        packed = torch.empty((rows, hidden + 2 * top_k), dtype=torch.float32, device=device)
        what = f"{layer}: receive the layer's inputs"
        self._collective(what, dist.broadcast, packed, self.leader, group=self.group)
        self.stats.last.exchange_ms += 1e3 * (time.perf_counter() - start)
        if packed[0, hidden].item() < 0:
            self.stats.abandoned += 1
            return None
        mass = packed[tokens:].reshape(-1)[: self._num_experts] if predicted else None
        x, ids, weights = packed[:tokens].split([hidden, top_k, top_k], dim=1)
        return x.to(dtype).contiguous(), ids.long(), weights.contiguous(), mass

    # both sides

    def record_experts(self, ms: float) -> None:
        """This rank's own experts took `ms` milliseconds in the current step."""
        self.stats.last.expert_ms += ms

    def exchange(self, rows: torch.Tensor, spans: list[tuple[int, int]], layer: str) -> None:
        """rows [T*k, H] hold this rank's span (`spans[rank]`) of a step's rows; afterwards rank 0's
        hold every rank's (the rows outside a rank's span may hold anything before)."""
        start = time.perf_counter()
        first, stop = spans[self.rank]
        row_bytes = rows.shape[1] * rows.element_size()
        others = rows.shape[0] - (spans[0][1] - spans[0][0])  # rows rank 0 receives
        nothing = rows.new_empty((0, rows.shape[1]))
        what = f"{layer}: bring the expert rows to rank 0"
        with _held_interrupts():  # brought and noted, or neither
            if self.collective == "all_to_all":  # rank 0's span first: the others' fill rows[stop0:]
                counts = [b - a for a, b in spans]
                if self.leads:
                    outputs, inputs = [0, *counts[1:]], [0] * self.world
                    self._collective(
                        what,
                        dist.all_to_all_single,
                        rows[counts[0] :],
                        nothing,
                        outputs,
                        inputs,
                        group=self.group,
                    )
                else:
                    outputs, inputs = (
                        [0] * self.world,
                        [counts[self.rank] if r == 0 else 0 for r in range(self.world)],
                    )
                    self._collective(
                        what,
                        dist.all_to_all_single,
                        nothing,
                        rows[first:stop],
                        outputs,
                        inputs,
                        group=self.group,
                    )
                sent = 0 if self.leads else (stop - first) * row_bytes
                received = others * row_bytes if self.leads else 0
                self._open = None
            else:  # the sum of each row's one value and the other ranks' zeros
                rows[:first].zero_()
                rows[stop:].zero_()
                self._collective(what, dist.reduce, rows, self.leader, group=self.group)
                whole = rows.numel() * rows.element_size()  # every rank sends its whole buffer
                sent, received = (0, (self.world - 1) * whole) if self.leads else (whole, 0)
                self._open = None
        step = self.stats.last
        step.exchanges += 1
        step.sent_bytes += sent
        step.received_bytes += received
        step.exchange_ms += 1e3 * (time.perf_counter() - start)

    def _collective(self, what: str, collective, *args, **kwargs) -> None:
        """collective(*args, **kwargs); a failure becomes one ExpertParallelError saying what this
        rank could not do and naming the ranks that stopped answering."""
        try:
            collective(*args, **kwargs)
        except Exception as e:  # gloo/NCCL: a peer closed the connection, or the timeout passed
            raise CollectiveError(self._failure(what, e, kwargs.get("group"))) from None

    def _wait_s(self, group) -> float:
        """How long `group`'s collectives wait: the timeout it was set up with (torch keeps it in
        its backend's options), else ours."""
        if group is self.control:
            return self.idle_timeout_s
        try:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            return pg._get_backend(self._device).options._timeout.total_seconds()
        except Exception:
            return self.timeout_s

    def _failure(self, what: str, error: Exception, group=None) -> str:
        silent = self.heartbeat.silent()
        if silent:  # as the group's ranks
            silent = [self.members.index(r) for r in silent]
            named = ", ".join(map(str, silent))
            who = f"rank{'s' if len(silent) > 1 else ''} {named} stopped answering (died, or hung)"
        elif silent == []:
            who = "every rank still answers, but one left the step (an error on it: see its output)"
        else:
            who = "a rank died, or hung"
        return (
            f"rank {self.rank} of {self.world} could not {what}: {who}; collectives wait up to "
            f"{self._wait_s(group):.0f} s ({str(error).splitlines()[0][:160]})"
        )

    def check_same(self, what: str, text: str) -> None:
        """Refuse to start unless every rank has the same `text` (a checkpoint's config, the options):
        their digests are gathered and compared; the first rank that differs is named."""
        # NCCL gathers CUDA tensors only (on this process's GPU)
        on = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else "cpu"
        )
        digest = torch.tensor(list(hashlib.sha256(text.encode()).digest()[:8]), dtype=torch.int64, device=on)
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
