"""Expert parallelism on torch.distributed (gloo, on loopback): 2 and 3 processes, each holding only
its share of every MoE layer's experts, rank 0 running the model and the others serving their
experts to it, against one process on the same checkpoint: the same logits bit for bit in fp32, on
the torch backend and the native kernels alike (each rank's rows are the single process's terms and
the combine its ordered sum), greedy tokens identical, for olmoe, qwen3_moe, gpt_oss, MXFP4 and a
q4_k GGUF file, experts not divisible by the ranks; and a rank that dies mid-generation stops the
others with an error naming the layer, within the timeout."""

import datetime
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from gguf_from_hf import write_gguf
from hf_models import VOCAB, make_model, save_gpt_oss_mxfp4, save_model

import moerun
from moerun.distributed import ExpertParallel, ExpertParallelError, ExpertShard
from moerun.quant.formats import QTensor
from moerun.quant.halves import GateUpHalves

IDS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
PROMPT = IDS[0, :6].tolist()
TIMEOUT_S = 20


def _rank(
    rank: int,
    world: int,
    init: str,
    path: str,
    out: str,
    die: tuple[int, int] | None,
    backend: str,
    collective: str,
    options: dict,
) -> None:
    """One rank: join the group, load its share; rank 0 computes logits and a greedy generation,
    the others serve their experts to it; each saves what it saw. `die` (rank, token): that rank
    dies when rank 0 has generated that many tokens (rank 0 itself; another rank at the step
    after: the prompt's step and the logits' first)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    result = {}
    try:
        ep = ExpertParallel(timeout_s=TIMEOUT_S, collective=collective)
        model = moerun.load(path, dtype=torch.float32, backend=backend, expert_parallel=ep, **options)
        result["held"] = [int(m.experts.gate_up.shape[0]) for m in model.mlps if hasattr(m, "experts")]
        result["first"] = _expert(next(m for m in model.mlps if hasattr(m, "experts")).experts.gate_up, 0)
        if model.expert_cache is not None:  # streamed: note every expert the rank's store reads
            store, result["read"] = model.expert_cache.store, set()
            read_into = store.read_into
            store.read_into = lambda key, dests: result["read"].add(key[1]) or read_into(key, dests)
        if rank == 0:
            result["logits"] = model.logits(IDS)
            tokens = []
            for i, token in enumerate(model.generate(PROMPT, 8)):
                if die == (0, i):
                    os._exit(3)  # rank 0 dies mid-generation
                tokens.append(token.id)
            result["tokens"] = tokens
            model.close()  # the others' serve_experts returns
        else:
            if die is not None and die[0] == rank:
                _die_in_step(ep, die[1] + 2)  # the logits' pass, the prompt's, then one a token
            model.serve_experts()
        result["stats"] = {**model.stats()["expert_parallel"], "offload": model.stats().get("offload")}
    except ExpertParallelError as e:
        result["error"] = str(e)
        result["error_at"] = time.monotonic()
        if rank == 0:  # the group is unusable: the next step says so at once, waiting for nothing
            try:
                model.logits(IDS)
            except ExpertParallelError as again:
                result["again"] = str(again)
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    if "error" not in result:
        dist.destroy_process_group()


def _expert(t, e: int) -> torch.Tensor:
    """Expert e of a stacked expert tensor [E, ...] (a QTensor's: its bytes)."""
    if isinstance(t, GateUpHalves):  # gate and up as the file stores them: expert e's, joined
        joined = t.expert(e)
        return joined.data if isinstance(joined, QTensor) else joined
    return t.data[e] if isinstance(t, QTensor) else t[e]


def _die_in_step(ep: ExpertParallel, step: int) -> None:
    """This rank dies once it has received rank 0's `step`-th step (counting from 1): rank 0 is then
    in that step's first MoE layer."""
    next_step = ep.next_step

    def dying():
        announced = next_step()
        if ep.stats.steps >= step:
            os._exit(3)
        return announced

    ep.next_step = dying


def _run(
    path,
    world: int,
    tmp_path,
    die: tuple[int, int] | None = None,
    backend: str = "auto",
    collective: str = "all_to_all",
    options: dict | None = None,
) -> list[dict]:
    init, out = tmp_path / f"init-{world}-{time.monotonic_ns()}", tmp_path / f"out-{world}"
    out.mkdir(exist_ok=True)
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(
            target=_rank,
            args=(r, world, str(init), str(path), str(out), die, backend, collective, options or {}),
        )
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120 + TIMEOUT_S)
        assert not p.is_alive(), "a rank hung"
    return [
        torch.load(out / f"{r}.pt", weights_only=False) if (out / f"{r}.pt").exists() else None
        for r in range(world)
    ]


def _one_process(path, backend: str):
    """(model, logits of IDS, greedy tokens after PROMPT) in one process, one thread as a rank runs
    (a GEMM's bits may depend on its threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = moerun.load(path, dtype=torch.float32, backend=backend)
        return alone, alone.logits(IDS), [t.id for t in alone.generate(PROMPT, 8)]
    finally:
        torch.set_num_threads(threads)


def _check_rank(rank: int, r: dict, logits: torch.Tensor, tokens: list[int], backend: str) -> None:
    """Rank 0's logits equal to one process's, bit for bit, and the same greedy tokens; every rank
    without an error, its steps and exchanges counted."""
    assert "error" not in r, r.get("error")
    assert r["stats"]["steps"] > 0 and r["stats"]["exchanges"] > 0
    if rank == 0:
        rel = ((r["logits"] - logits).abs().max() / logits.abs().max()).item()
        assert torch.equal(r["logits"], logits), (backend, rel)
        assert r["tokens"] == tokens


CHECKPOINTS = {
    "olmoe": lambda d: save_model(make_model("olmoe"), d / "olmoe"),
    "qwen3_moe": lambda d: save_model(make_model("qwen3_moe"), d / "qwen3"),
    "gpt_oss": lambda d: save_model(make_model("gpt_oss"), d / "gpt_oss"),
    "olmoe-gguf-q4_k": lambda d: _gguf(d / "olmoe.gguf"),
    "gpt_oss-mxfp4": lambda d: save_gpt_oss_mxfp4(
        make_model("gpt_oss", hidden_size=64, intermediate_size=32), d / "mxfp4"
    ),
}


def _gguf(path):
    model = make_model("olmoe", hidden_size=256, intermediate_size=256, num_experts=5, num_hidden_layers=2)
    write_gguf(model, path, "q4_k")
    return path


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))


# Equal bits, by construction (given the same threads per GEMM): on the torch backend one process
# computes a step's rows and sums them in plan order as the ranks do; on the native kernels one
# process sums each token's terms w * y in one decode-table call, from 0 in plan order, and each rank
# computes its rows as terms of that call (an assignment a slot), which rank 0 sums in that order.


@pytest.mark.parametrize(
    "world, backend, collective",
    [
        (2, "torch", "all_to_all"),
        (3, "torch", "all_to_all"),
        (3, "torch", "reduce"),
        (2, "auto", "all_to_all"),
        pytest.param(3, "auto", "all_to_all", marks=pytest.mark.slow),
    ],
)
def test_ranks_give_one_process_s_logits_and_tokens(checkpoint, world, backend, collective, tmp_path):
    alone, logits, tokens = _one_process(checkpoint, backend)
    experts = alone.config.moe.num_experts
    results = _run(checkpoint, world, tmp_path, backend=backend, collective=collective)
    for rank, r in enumerate(results):
        _check_rank(rank, r, logits, tokens, backend)
        share = ExpertShard(rank, world, experts)
        assert set(r["held"]) == {share.stop - share.start}  # its share of every MoE layer, no more
        assert r["stats"]["steps"] == results[0]["stats"]["steps"]  # it served every pass of rank 0's
    # rank 0 sent every layer's inputs [T, H + 2k] fp32 to each other rank, and received their rows
    moe = next(m for m in alone.mlps if hasattr(m, "experts"))
    inputs = results[0]["stats"]["tokens"] * (moe.spec.hidden + 2 * moe.spec.top_k) * 4
    assert results[0]["stats"]["sent_bytes"] == (world - 1) * sum(alone.config.moe_layers) * inputs
    assert results[0]["stats"]["received_bytes"] == sum(r["stats"]["sent_bytes"] for r in results[1:])
    # the ranks' shares hold every expert once: their sizes add up, and (torch's tensors, comparable
    # as they are) a rank's first expert is one process's expert at its share's start
    assert sum(r["held"][0] for r in results) == experts
    if backend == "torch":
        for rank, r in enumerate(results):
            start = ExpertShard(rank, world, experts).start
            assert torch.equal(r["first"], _expert(moe.experts.gate_up, start))


@pytest.mark.parametrize("name, backend", [("olmoe", "torch"), ("olmoe-gguf-q4_k", "auto")])
def test_each_rank_streams_its_own_experts_through_its_cache(name, backend, tmp_path):
    """expert_cache_gb under expert parallelism: each rank's own experts through its own cache (too
    small for all of them, each prefetching its own of the next layer's predicted experts), the
    logits and tokens of one process with every expert resident, and no rank reading another's
    experts from the file."""
    path = CHECKPOINTS[name](tmp_path)
    alone, logits, tokens = _one_process(path, backend)
    moe = next(m for m in alone.mlps if hasattr(m, "experts"))
    slots = moe.spec.top_k + 1  # of every layer's, fewer than a rank holds
    budget_gb = slots * moe.experts.bytes_per_expert() * sum(alone.config.moe_layers) / 2**30
    options = {"expert_cache_gb": budget_gb, "prefetch_k": 2}
    world, experts = 2, moe.spec.num_experts
    results = _run(path, world, tmp_path, backend=backend, options=options)
    for rank, r in enumerate(results):
        _check_rank(rank, r, logits, tokens, backend)
        share = ExpertShard(rank, world, experts)
        assert r["read"] and r["read"] <= set(share.owned), (rank, r["read"])
        assert r["stats"]["offload"]["total"]["misses"] > 0
        # each rank prefetches its own experts, from rank 0's prediction (the next layer's router)
        assert r["stats"]["offload"]["total"]["prefetch_issued"] > 0, rank


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_that_dies_stops_the_others_with_a_clear_error(dead, tmp_path):
    """A rank that dies mid-generation (another rank, or rank 0 which runs the model): the other
    stops with an error naming it and the layer or step it was in, soon (its connection closed)."""
    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    start = time.monotonic()
    results = _run(path, 2, tmp_path, die=(dead, 3))
    assert results[dead] is None  # it died before saving anything
    error = results[1 - dead]["error"]
    assert f"rank {dead} stopped answering" in error and f"rank {1 - dead} of 2 could not" in error, error
    if dead == 1:
        assert "layers." in error, error  # rank 0 was in a MoE layer of the step
        assert results[0]["again"] == f"the expert-parallel group failed in an earlier step: {error}"
    assert results[1 - dead]["error_at"] - start <= 120 + TIMEOUT_S


def _mismatched_rank(rank: int, init: str, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        moerun.load(paths[rank], dtype=torch.float32, expert_parallel=ExpertParallel(timeout_s=TIMEOUT_S))
        error = None
    except ExpertParallelError as e:
        error = str(e)
    torch.save(error, os.path.join(out, f"mismatch-{rank}.pt"))
    dist.destroy_process_group()


def test_ranks_that_load_different_checkpoints_are_refused_at_start(tmp_path):
    """Two ranks given two checkpoints of different configs: both refuse before any step, naming
    the rank that differs."""
    paths = [
        str(save_model(make_model("olmoe"), tmp_path / "a")),
        str(save_model(make_model("olmoe", num_experts=6), tmp_path / "b")),
    ]
    context = multiprocessing.get_context("spawn")
    init = tmp_path / "init-mismatch"
    ranks = [
        context.Process(target=_mismatched_rank, args=(r, str(init), paths, str(tmp_path))) for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
        assert p.exitcode == 0
    for r in range(2):
        error = torch.load(tmp_path / f"mismatch-{r}.pt")
        assert error is not None and "rank 1's checkpoint config and options differs from rank 0's" in error


def _idle_rank(rank: int, init: str, path: str, out: str) -> None:
    """Rank 0 computes logits, sits idle for 3 times the idle timeout, computes them again."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    ep = ExpertParallel(timeout_s=TIMEOUT_S, idle_timeout_s=IDLE_S)
    model = moerun.load(path, dtype=torch.float32, backend="torch", expert_parallel=ep)
    result = {}
    try:
        if rank == 0:
            result["before"] = model.logits(IDS)
            time.sleep(3 * IDLE_S)
            result["after"] = model.logits(IDS)
            model.close()
        else:
            model.serve_experts()
        result["steps"] = ep.stats.steps
    except ExpertParallelError as e:
        result["error"] = str(e)
    torch.save(result, os.path.join(out, f"idle-{rank}.pt"))
    dist.destroy_process_group()


IDLE_S = 2.0


def test_the_other_ranks_outlast_an_idle_rank_0(tmp_path):
    """A server may sit idle longer than the other ranks wait for a step: rank 0 says it is still
    there (a keep-alive header every quarter of the idle timeout), so they are still serving when
    its next step comes."""
    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    context = multiprocessing.get_context("spawn")
    init = tmp_path / "init-idle"
    ranks = [
        context.Process(target=_idle_rank, args=(r, str(init), str(path), str(tmp_path))) for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
        assert p.exitcode == 0
    first, second = (torch.load(tmp_path / f"idle-{r}.pt") for r in range(2))
    assert "error" not in first and "error" not in second, (first.get("error"), second.get("error"))
    assert torch.equal(first["before"], first["after"]) and second["steps"] == first["steps"] > 0


def test_shares_cover_the_experts_when_they_do_not_divide():
    for experts, world in [(8, 3), (5, 2), (64, 7), (3, 3)]:
        shares = [ExpertShard(r, world, experts) for r in range(world)]
        assert [s.start for s in shares][0] == 0 and shares[-1].stop == experts
        assert all(a.stop == b.start for a, b in zip(shares, shares[1:], strict=False))
        sizes = [s.stop - s.start for s in shares]
        assert max(sizes) - min(sizes) <= 1


def test_without_a_group_it_says_how_to_start(monkeypatch):
    from moerun.settings import settings

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    settings.cache_clear()
    try:
        with pytest.raises(ExpertParallelError, match="torchrun"):
            ExpertParallel.from_env()
    finally:
        settings.cache_clear()


def test_torchrun_runs_moerun_generate_expert_parallel(tmp_path):
    """`torchrun --nproc-per-node 2 -m moerun generate ...` as a user starts it: rank 0 prints the
    tokens one process generates, and the summary says where the experts are."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    args = [
        "generate",
        "-m",
        str(path),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "-n",
        "6",
        "--dtype",
        "fp32",
    ]
    alone = subprocess.run([sys.executable, "-m", "moerun", *args, "--json"], capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m", "moerun", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    record = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=300, env=env)
    assert record.returncode == 0, record.stderr[-2000:]
    lines = [line for line in record.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["ids"] == json.loads(alone.stdout)["ids"]
    assert "expert parallel: rank 0 of 2" in run.stderr and run.stderr.count("loaded ") == 1


def test_torchrun_runs_the_checkpoint_bench_expert_parallel(tmp_path):
    """`torchrun --nproc-per-node 2 -m moerun bench --model PATH`: rank 0 measures the checkpoint with
    its experts spread over both ranks and alone prints the figures, the exchanges among them."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m", "moerun", "bench"]
    command += ["--model", str(path), "--dtype", "fp32", "--prefill-tokens", "24", "--decode-steps", "4"]
    command += ["--repeats", "1", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    r = json.loads(lines[0])
    ep = r["expert_parallel"]
    assert ep["placement"] == "rank 0 of 2: experts 0-3 of 8"
    assert ep["steps"] > 0 and ep["sent_bytes"] > 0 and ep["received_bytes"] > 0 and r["decode_tok_s"] > 0
    # the weights a token reads are the model's, wherever its experts are: one process's count
    from moerun.benchmarks.weight_bytes import model_decode_bytes

    assert r["bytes_per_token"] == model_decode_bytes(moerun.load(path, dtype=torch.float32))


def _bench_rank(rank: int, world: int, init: str, out: str) -> None:
    from hf_models import TINY_OLMOE

    from moerun.benchmarks import BenchSettings
    from moerun.benchmarks.expert_parallel import format_expert_parallel_table, run_expert_parallel_bench

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    settings = BenchSettings(dtype="fp32", decode_steps=3, repeats=1)
    r = run_expert_parallel_bench(settings, layers=2, prompt_tokens=8, shape=TINY_OLMOE)
    if rank == 0:
        r["table"] = format_expert_parallel_table(r)
    torch.save(r, os.path.join(out, f"bench-{rank}.pt"))
    dist.destroy_process_group()


def test_the_expert_parallel_bench_runs_both_sides(tmp_path):
    context = multiprocessing.get_context("spawn")
    init = tmp_path / "init-bench"
    ranks = [context.Process(target=_bench_rank, args=(r, 2, str(init), str(tmp_path))) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
        assert p.exitcode == 0
    first, second = (torch.load(tmp_path / f"bench-{r}.pt", weights_only=False) for r in range(2))
    assert first["placement"] == "rank 0 of 2: experts 0-3 of 8" and second["placement"].startswith("rank 1")
    assert first["single_decode_tok_s"] > 0 and "collectives" not in second
    assert second["served"]["steps"] == first["steps"]  # rank 1 served every pass rank 0 ran
    from hf_models import TINY_OLMOE

    # a decode step of one token: rank 0 sends each of the 2 layers' inputs [1, H + 2k] fp32 to rank 1
    # and receives rank 1's rows of it, at most top_k of H fp32 a layer
    inputs = 2 * (TINY_OLMOE["hidden_size"] + 2 * TINY_OLMOE["num_experts_per_tok"]) * 4
    every_row = 2 * TINY_OLMOE["num_experts_per_tok"] * TINY_OLMOE["hidden_size"] * 4
    for collective in ("all_to_all", "reduce"):
        figures = first["collectives"][collective]
        assert figures["decode_tok_s"] > 0 and figures["prefill_tok_s"] > 0
        assert figures["decode_step"]["sent_bytes"] == inputs
        assert 0 < figures["decode_step"]["received_bytes"] <= every_row or collective == "reduce"
        for phase in ("prefill_step", "decode_step"):
            assert figures[phase]["exchange_ms"] > 0
        assert collective in first["table"]
    assert "one process" in first["table"]


def _with_tokenizer(path):
    """A tiny OLMoE checkpoint with a trained byte-level tokenizer."""
    from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

    tok = byte_level_tokenizer("qwen2")
    save_hf_dir(tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|im_end|>")
    save_model(make_model("olmoe", vocab_size=tok.get_vocab_size()), path)
    return path


def test_torchrun_scores_perplexity_expert_parallel(tmp_path):
    """`torchrun --nproc-per-node 2 -m moerun perplexity ...`: rank 0 alone prints, the perplexity
    one process computes (torch backend, fp32, one thread a process: the same bits)."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    path = _with_tokenizer(tmp_path / "scored")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    args = ["perplexity", "-m", str(path), "--file", str(text), "--ctx-size", "64", "--dtype", "fp32"]
    args += ["--backend", "torch", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    alone = subprocess.run([sys.executable, "-m", "moerun", *args], capture_output=True, text=True, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m", "moerun", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    ours, theirs = json.loads(lines[0]), json.loads(alone.stdout)
    # llama.cpp's chunks of 64 score their second halves: more than one chunk's 31 tokens
    assert ours["perplexity"] == theirs["perplexity"] and ours["tokens"] == theirs["tokens"] > 31


def test_torchrun_serves_expert_parallel(tmp_path):
    """`torchrun --nproc-per-node 2 -m moerun serve ...` as a user starts it: rank 0 answers the
    OpenAI API (the other rank serving its experts), 4 concurrent greedy completions each give the
    text one process generates alone, and Ctrl-C (SIGINT to torchrun) ends every rank."""
    import concurrent.futures
    import contextlib
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    openai = pytest.importorskip("openai")
    path = _with_tokenizer(tmp_path / "served")
    prompts = ["hello there", "the cat", "a b c d", "moerun"]
    alone = moerun.load(path, dtype=torch.float32)
    expected = ["".join(t.text for t in alone.generate(p, 8)) for p in prompts]

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    master, port = ports
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(master), "-m", "moerun", "serve"]
    command += ["-m", str(path), "--port", str(port), "--dtype", "fp32", "--alias", "tiny", "--parallel", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, status = time.monotonic() + 180, None
        while time.monotonic() < deadline and status != 200 and process.poll() is None:
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            time.sleep(0.2)
        assert status == 200
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        )

        def complete(prompt: str) -> str:
            return (
                client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == expected
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    assert "expert parallel, rank 0 of 2: experts 0-3 of 8" in err, err[-2000:]
    # each rank stopped on its own Ctrl-C (torchrun passes it on, then prints its own traceback)
    assert err.count("moerun serve: interrupted.") == 2, err[-3000:]
    frames = [line for line in err.splitlines() if line.strip().startswith("File ")]
    package = str(Path(moerun.__file__).parent) + os.sep
    assert not [f for f in frames if package in f], err[-3000:]  # torchrun's own frames, none of moerun's


class _Rank1Of2:
    """What moerun.load asks of an expert-parallel group, as rank 1 of 2 (no group: the loader alone)."""

    rank, world, leads = 1, 2, False

    def shard(self, num_experts: int) -> ExpertShard:
        return ExpertShard(1, 2, num_experts)

    def check_same(self, what: str, text: str) -> None:
        pass


def _deepseek(directory, gguf: bool):
    """DeepSeek-V3 (MLA, a dense first layer, shared experts): HF, or GGUF with q8_0 experts (its
    kv_b split in two, the dense MLP's and shared experts' gate and up apart: the loader joins them)."""
    from test_deepseek_gguf import deepseek

    model = deepseek("v3-q-lora-interleaved", moe_intermediate_size=32)
    if not gguf:
        return save_model(model, directory / "deepseek")
    write_gguf(model, directory / "deepseek.gguf", "q8_0")
    return directory / "deepseek.gguf"


LOADED = {
    "deepseek_v3": lambda d: _deepseek(d, gguf=False),
    "deepseek_v3-gguf": lambda d: _deepseek(d, gguf=True),
    "qwen2_moe": lambda d: save_model(make_model("qwen2_moe"), d / "qwen2"),
    "gpt_oss-mxfp4": CHECKPOINTS["gpt_oss-mxfp4"],
    "olmoe-gguf-q4_k": CHECKPOINTS["olmoe-gguf-q4_k"],
}


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("name", list(LOADED))
def test_a_rank_other_than_0_reads_nothing_but_its_experts(name, streamed, tmp_path, monkeypatch):
    """Every rank but 0 never computes the dense part, the routers or the shared experts: the loader
    gives it storage-free stand-ins of them (nothing read, converted or copied, whatever it makes of
    them: fused, joined, dequantised), resident or streamed, and real tensors of its own experts
    only (streamed: the expert store reads them when a step needs them)."""
    import moerun.checkpoint.load as load

    monkeypatch.setattr(load, "MoEModel", lambda config, tensors, *rest: (config, tensors))
    monkeypatch.setattr(load, "populate_in_background", lambda views: None)
    monkeypatch.setattr(load, "_routed_expert_views", lambda model: [])
    options = {"expert_cache_gb": 1.0} if streamed else {}
    config, tensors = moerun.load(
        LOADED[name](tmp_path), dtype=torch.float32, expert_parallel=_Rank1Of2(), **options
    )
    share = ExpertShard(1, 2, config.moe.num_experts)
    experts = {k for k in tensors if ".moe.experts." in k}
    assert experts and len(tensors) > len(experts)
    for key, t in tensors.items():
        data = t.gate if isinstance(t, GateUpHalves) else t
        data = data.data if isinstance(data, QTensor) else data
        if key in experts:  # streamed: the model gets stand-ins, the expert store the file's bytes
            assert streamed or (not data.is_meta and t.shape[0] == share.size), (key, t.shape)
        else:
            assert data.is_meta, key


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_deepseek_runs_expert_parallel(backend, tmp_path):
    """DeepSeek-V3 from GGUF (MLA, a dense first layer, shared experts, q8_0), 2 ranks: one
    process's logits and greedy tokens, the other rank holding stand-ins of all but its experts."""
    path = _deepseek(tmp_path, gguf=True)
    _, logits, tokens = _one_process(path, backend)
    for rank, r in enumerate(_run(path, 2, tmp_path, backend=backend)):
        _check_rank(rank, r, logits, tokens, backend)


def _subgroup_rank(rank: int, init: str, path: str, out: str) -> None:
    """3 processes; processes 1 and 2 form the expert-parallel group (process 1 its rank 0), process
    0 stays out of it (another part of a larger job)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=3,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    group = dist.new_group([1, 2], use_local_synchronization=True) if rank else None
    result = {}
    if rank:
        ep = ExpertParallel(group=group, timeout_s=TIMEOUT_S)
        model = moerun.load(path, dtype=torch.float32, backend="torch", expert_parallel=ep)
        if ep.leads:
            result["logits"] = model.logits(IDS)
            result["tokens"] = [t.id for t in model.generate(PROMPT, 8)]
            model.close()
        else:
            model.serve_experts()
        result["stats"] = model.stats()["expert_parallel"]
    torch.save(result, os.path.join(out, f"subgroup-{rank}.pt"))
    dist.destroy_process_group()


def test_a_group_within_a_larger_job_runs_expert_parallel(tmp_path):
    """ExpertParallel(group=...) over processes 1 and 2 of 3 (process 0 elsewhere, never joining it):
    process 1 leads with one process's logits and tokens, process 2 serves half the experts."""
    path = save_model(make_model("olmoe"), tmp_path / "olmoe")
    _, logits, tokens = _one_process(path, "torch")
    context = multiprocessing.get_context("spawn")
    init = tmp_path / "init-subgroup"
    ranks = [
        context.Process(target=_subgroup_rank, args=(r, str(init), str(path), str(tmp_path)))
        for r in range(3)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120 + TIMEOUT_S)
        assert p.exitcode == 0
    _, lead, other = (torch.load(tmp_path / f"subgroup-{r}.pt") for r in range(3))
    assert torch.equal(lead["logits"], logits) and lead["tokens"] == tokens
    assert (lead["stats"]["rank"], other["stats"]["rank"], other["stats"]["world"]) == (0, 1, 2)
    assert other["stats"]["placement"] == "rank 1 of 2: experts 4-7 of 8"
    assert other["stats"]["steps"] == lead["stats"]["steps"] > 0
