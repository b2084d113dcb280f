"""Expert parallelism's promises that need a rank to misbehave or be measured (gloo, on loopback):
a rank that hangs mid-generation (stopped, not dead: its sockets stay open) stops the others within
the timeout with an error naming it and the layer; and a rank's resident memory is its share of the
experts (plus the dense part on rank 0, which alone computes it), against the checkpoint's own
tensor sizes, well below one process's."""

import datetime
import gc
import math
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from gguf_from_hf import write_gguf
from hf_models import make_model, save_model
from safetensors import safe_open

import moerun
from moerun.cli.common import summary
from moerun.distributed import ExpertParallel, ExpertParallelError, ExpertShard
from moerun.distributed.heartbeat import LISTEN_S

PROMPT = [5, 17, 3, 42, 8, 11]
TIMEOUT_S = 10
MIB = 2**20


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS: resident now, VmHWM: the peak since reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rank(
    rank: int,
    world: int,
    init: str,
    path: str,
    out: str,
    hang_at: int | None,
    warm: str | None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """One process: join the group (world > 1), load, generate, save what it saw. `hang_at`: the last
    rank stops itself (SIGSTOP) in rank 0's step `hang_at`, and stays stopped until the test kills it.
    `warm`: a tiny checkpoint loaded and dropped first, so that the modules a load imports and the
    allocator's first arenas are in place before the measured load begins."""
    torch.set_num_threads(1)
    ep = None
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )  # fmt: skip
        ep = ExpertParallel()  # its default timeout_s (60): the group's (TIMEOUT_S) is the one that counts
    result = {}
    try:
        if warm is not None:
            moerun.load(warm, dtype=torch.float32, backend="torch")  # dropped at once
            gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM restarts from the resident size now: the load's own peak
        model = moerun.load(path, dtype=dtype, backend="torch", expert_parallel=ep)
        result["grown"] = _status("VmRSS") - before
        result["peak"] = _status("VmHWM") - before
        if rank == 0:
            list(model.generate(PROMPT, 6))
            model.close()  # the other ranks' serve_experts returns
        else:
            if hang_at is not None and rank == world - 1:
                _hang_in_step(ep, hang_at, out)
            model.serve_experts()
        result["rss"] = _status("VmRSS")
        result["stats"] = model.stats().get("expert_parallel")
    except ExpertParallelError as e:
        result["error"], result["error_at"] = str(e), time.monotonic()
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    if world > 1 and "error" not in result:
        dist.destroy_process_group()


def _hang_in_step(ep: ExpertParallel, step: int, out: str) -> None:
    """This rank stops itself (SIGSTOP) once it has received rank 0's `step`-th step: rank 0 is then
    in that step's first MoE layer, waiting for this rank's rows."""
    next_step = ep.next_step

    def hanging():
        announced = next_step()
        if ep.stats.steps >= step:
            torch.save(time.monotonic(), os.path.join(out, "stopped.pt"))
            os.kill(os.getpid(), signal.SIGSTOP)
        return announced

    ep.next_step = hanging


def _run(
    path, world: int, out, hang_at: int | None = None, warm=None, dtype=torch.float32
) -> list[dict | None]:
    """The ranks, spawned; a rank still alive after the others end (the hung one) is killed."""
    out.mkdir()
    init = out / "init"
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(
            target=_rank, args=(r, world, str(init), str(path), str(out), hang_at, warm and str(warm), dtype)
        )
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    try:
        for p in ranks[: world - 1 if hang_at is not None else world]:
            p.join(timeout=120 + TIMEOUT_S)
            assert not p.is_alive(), f"rank {ranks.index(p)} did not stop"
        if hang_at is not None:
            assert _state(ranks[-1].pid) == "T"  # hung, not dead: stopped with its sockets open
    finally:
        for p in ranks:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL without resuming
                p.join()
    return [torch.load(out / f"{r}.pt") if (out / f"{r}.pt").exists() else None for r in range(world)]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_rank_that_hangs_stops_the_others_within_the_timeout(tmp_path):
    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    results = _run(path, 2, tmp_path / "out", hang_at=4)
    assert results[1] is None  # stopped before saving, then killed
    error = results[0]["error"]
    assert "layers." in error and "rank 1 stopped answering" in error, error
    assert f"wait up to {TIMEOUT_S} s" in error, error
    waited = results[0]["error_at"] - torch.load(tmp_path / "out" / "stopped.pt")
    # gloo's collectives honour the group's timeout: no sooner (the peer's sockets are open, so
    # nothing fails early); then the survivor listens LISTEN_S for the others' heartbeats
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + LISTEN_S + 5, waited


# experts ~144 MiB of a ~147 MiB fp32 checkpoint, so a share of them shows against the dense part
BIG_OLMOE = dict(hidden_size=256, intermediate_size=512, num_experts=32, num_hidden_layers=3)
SLACK_MB = 24  # the interpreter's allocations while loading, and one tensor copied in flight


@pytest.fixture(scope="module")
def big_olmoe(tmp_path_factory):
    model = make_model("olmoe", **BIG_OLMOE)
    root = tmp_path_factory.mktemp("big")
    return {
        "fused": save_model(model, root / "fused", original_format=False),
        "per-expert": save_model(model, root / "per-expert"),
        "gguf": _gguf(model, root / "merged.gguf"),
        "gguf-per-expert": _gguf(model, root / "per-expert.gguf", per_expert=True),
        "warm": save_model(make_model("olmoe"), root / "warm"),
    }


def _gguf(model, path, per_expert: bool = False):
    write_gguf(model, path, "f32", per_expert=per_expert)
    return path


def _file_bytes(path) -> tuple[int, int]:
    """(dense, expert) bytes of a checkpoint, from its own tensor shapes (a GGUF file: those of the
    HF checkpoint it was written from, the same fp32 tensors)."""
    if path.suffix == ".gguf":
        path = path.parent / "fused"
    dense = experts = 0
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle, not iterable)
            nbytes = 4 * math.prod(f.get_slice(name).get_shape())  # fp32
            if ".experts." in name:
                experts += nbytes
            else:
                dense += nbytes
    return dense, experts


@pytest.mark.parametrize(
    "layout, dtype",
    [
        ("fused", torch.float32),
        ("per-expert", torch.float32),
        ("fused", torch.bfloat16),
        ("gguf", torch.float32),
        ("gguf-per-expert", torch.float32),
    ],
)
def test_a_rank_holds_only_its_share_of_the_experts(big_olmoe, layout, dtype, tmp_path):
    """Per-expert tensors: only the share's are stacked; fp32 loaded as bf16: only the share's are
    converted; GGUF gate and up experts: only the share's are joined."""
    path = big_olmoe[layout]
    dense, experts = _file_bytes(path)
    assert experts > 40 * dense
    if dtype == torch.bfloat16:  # the experts converted (the dense part: within the slack)
        experts //= 2
    (alone,) = _run(path, 1, tmp_path / "alone", warm=big_olmoe["warm"], dtype=dtype)
    ranks = _run(path, 2, tmp_path / "ranks", warm=big_olmoe["warm"], dtype=dtype)
    # a GGUF file's tensors that need no copy (down experts, fp32 dense) stay views of its map, not
    # resident until read: there the figures are bounds
    mapped = layout.startswith("gguf")
    assert mapped or abs(alone["grown"] - (dense + experts)) <= SLACK_MB * MIB, alone["grown"] / MIB
    for rank, r in enumerate(ranks):
        share = ExpertShard(rank, 2, BIG_OLMOE["num_experts"])
        # rank 0 holds the dense part; the others, which never compute it, only their experts
        expected = (dense if rank == 0 else 0) + experts * (share.stop - share.start) // BIG_OLMOE[
            "num_experts"
        ]
        figures = f"rank {rank}: grew {r['grown'] / MIB:.1f} MiB (peak {r['peak'] / MIB:.1f}), "
        figures += f"expected {expected / MIB:.1f}; one process grew {alone['grown'] / MIB:.1f}"
        assert mapped or r["grown"] - expected >= -4 * MIB, figures
        assert r["grown"] - expected <= SLACK_MB * MIB, figures
        assert r["peak"] - expected <= SLACK_MB * MIB, figures
        assert r["grown"] < 0.6 * alone["grown"] and r["peak"] < 0.6 * alone["peak"], figures
        assert abs(r["stats"]["rss_mb"] * MIB - r["rss"]) <= 4 * MIB  # the stat is this process's
    assert f"{ranks[0]['stats']['rss_mb']:.0f} MiB resident" in summary(
        {"expert_parallel": ranks[0]["stats"]}
    )


def _two_ranks(target, name: str, path, tmp_path, *args) -> list[dict]:
    """target(rank, init, path, out, *args) as ranks 0 and 1, spawned and waited for (each must end
    cleanly) -> what each saved as `{name}-{rank}.pt`."""
    context = multiprocessing.get_context("spawn")
    init = tmp_path / f"init-{name}"
    ranks = [
        context.Process(target=target, args=(r, str(init), str(path), str(tmp_path), *args)) for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120 + 4 * TIMEOUT_S)
        assert p.exitcode == 0
    return [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)]


class _Injected(Exception):
    """An error of rank 0's own, partway through a step (not the group's)."""


def _fail_once(obj, method: str, error: BaseException, when=lambda *args: True) -> None:
    """obj.method raises `error` at its first call for which when(*args) holds, then is obj's own again."""
    original = getattr(obj, method)

    def failing(*args, **kwargs):
        if not when(*args):
            return original(*args, **kwargs)
        del obj.__dict__[method]
        raise error

    setattr(obj, method, failing)


def _failing_rank(
    rank: int, init: str, path: str, out: str, backend: str, collective: str, options: dict
) -> None:
    """Rank 0 computes logits and a greedy generation, then fails four steps partway through (its
    own errors at each place a step can be in: before any MoE layer's inputs are sent, between a
    layer's inputs sent and its rows brought back (Ctrl-C), between two layers, in a decode step),
    then computes them again; the other rank serves throughout."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    ep = ExpertParallel(timeout_s=TIMEOUT_S, collective=collective)
    model = moerun.load(path, dtype=torch.float32, backend=backend, expert_parallel=ep, **options)
    result = {"raised": []}
    try:
        if rank == 0:
            first, second, *_ = (m for m in model.mlps if hasattr(m, "experts"))
            result["before"] = model.logits(IDS), [t.id for t in model.generate(PROMPT, 6)]
            failures = [
                (first, "forward", _Injected("before any layer")),
                (second, "_parallel_rows", KeyboardInterrupt()),
                (second, "forward", _Injected("between layers")),
            ]
            for layer, method, error in failures:
                _fail_once(layer, method, error)
                try:
                    model.logits(IDS)
                except (_Injected, KeyboardInterrupt) as e:
                    result["raised"].append(type(e).__name__)
            tokens = model.generate(PROMPT, 6)
            next(tokens)  # the prompt's step done: the next ones decode one token
            _fail_once(first, "_parallel_rows", _Injected("decode"), when=lambda x, *rest: x.shape[0] == 1)
            try:
                list(tokens)
            except _Injected as e:
                result["raised"].append(type(e).__name__)
            result["after"] = model.logits(IDS), [t.id for t in model.generate(PROMPT, 6)]
            model.close()
        else:
            model.serve_experts()
        result["stats"] = model.stats()["expert_parallel"]
    except ExpertParallelError as e:
        result["error"] = str(e)
    torch.save(result, os.path.join(out, f"failing-{rank}.pt"))
    dist.destroy_process_group()


IDS = torch.tensor([PROMPT, PROMPT[::-1]])


STREAMED = {"expert_cache_gb": 1.0, "prefetch_k": 2}  # each layer's inputs carry the next's prediction


@pytest.mark.parametrize(
    "backend, collective, options",
    [
        ("torch", "all_to_all", {}),
        ("cpu", "all_to_all", {}),
        ("torch", "reduce", {}),
        ("torch", "all_to_all", STREAMED),
    ],
    ids=["torch", "cpu", "reduce", "streamed"],
)
def test_a_step_failing_partway_on_rank_0_leaves_the_group_serving(backend, collective, options, tmp_path):
    """Rank 0's own error partway through a step (a bad value, Ctrl-C in chat, a request's error
    in a server) reaches its caller as it was raised, and the other ranks, left inside the step,
    are released from it: the next steps give the logits and tokens they gave before, bit for bit,
    and the other rank counts each step called off."""
    path = save_model(make_model("olmoe", num_experts=5), tmp_path / "olmoe")
    lead, other = _two_ranks(_failing_rank, "failing", path, tmp_path, backend, collective, options)
    assert "error" not in lead and "error" not in other, (lead.get("error"), other.get("error"))
    assert lead["raised"] == ["_Injected", "KeyboardInterrupt", "_Injected", "_Injected"]
    assert torch.equal(lead["before"][0], lead["after"][0]) and lead["before"][1] == lead["after"][1]
    assert lead["stats"]["abandoned"] == other["stats"]["abandoned"] == 4
    assert lead["stats"]["steps"] == other["stats"]["steps"]


def _interrupted_rank(rank: int, init: str, path: str, out: str, collective: str, control: bool) -> None:
    """Rank 0 computes logits; then a real Ctrl-C (SIGINT to itself) arrives while its first
    `collective` of a step (on the control group: the step's header) is under way; then it computes
    the logits again. The other rank serves throughout."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    ep = ExpertParallel(timeout_s=TIMEOUT_S)
    model = moerun.load(path, dtype=torch.float32, backend="torch", expert_parallel=ep)
    result = {}
    try:
        if rank == 0:
            result["before"] = model.logits(IDS)
            original, armed = getattr(dist, collective), [True]

            def interrupted(*args, **kwargs):
                done = original(*args, **kwargs)
                if armed[0] and (kwargs.get("group") is ep.control) == control:
                    armed[0] = False
                    os.kill(os.getpid(), signal.SIGINT)  # pending: Python raises it at its next check
                return done

            setattr(dist, collective, interrupted)
            try:
                model.logits(IDS)
            except KeyboardInterrupt:
                result["interrupted"] = True
            setattr(dist, collective, original)
            result["after"] = model.logits(IDS)
            model.close()
        else:
            model.serve_experts()
    except ExpertParallelError as e:
        result["error"] = str(e)
    torch.save(result, os.path.join(out, f"interrupted-{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "collective, control",
    [("broadcast", True), ("broadcast", False), ("all_to_all_single", False)],
    ids=["header", "inputs", "rows"],
)
def test_ctrl_c_during_a_collective_leaves_the_group_serving(collective, control, tmp_path):
    """Ctrl-C lands while rank 0 waits in a collective (gloo's waits cannot be interrupted: Python
    raises it once the collective is done): the collective and rank 0's note of it stand together,
    the interrupt reaches the caller, the other rank is released from the step, and the next step
    gives the same logits."""
    path = save_model(make_model("olmoe", num_experts=5), tmp_path / "olmoe")
    lead, other = _two_ranks(_interrupted_rank, "interrupted", path, tmp_path, collective, control)
    assert "error" not in lead and "error" not in other, (lead.get("error"), other.get("error"))
    assert lead["interrupted"] and torch.equal(lead["before"], lead["after"])
