"""The checkpoint fuzz (fuzz_checkpoints.py) as tests: every mutated seed (one or two mutations;
fp32 or bf16, resident or streamed: `mix`), through `moerun.load(...).logits(...)` and `moerun
inspect` in a child with a timeout and a memory limit, either runs or fails with one clear
CheckpointError naming its file. Any raw exception, vague error, hang, allocation past the limit,
crash, NaN from finite weights or write beside the inputs fails here, with the cases listed
(rebuild one with `make_case(seeds, seed, index, dir, mix=True)`)."""

import os
import signal
import time

import pytest
from fuzz_checkpoints import BAD, MEMORY_LIMIT, Worker, _fork_case, _outcome_of, build_seeds, fuzz, summarise

import moerun
from moerun.errors import ConfigError
from moerun.moe.layer import StateDictError


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return build_seeds(tmp_path_factory.mktemp("fuzz-seeds"))


def _failures(records: list[dict]) -> str:
    lines = []
    for r in [r for r in records if r["outcome"] in BAD][:12]:
        steps = [f"{s}: {r[s]['where']}: {r[s]['message'][:150]}" for s in ("load", "inspect") if s in r]
        lines.append(f"case {r['index']} ({r['seed']}, {r['mutation']}) -> {r['outcome']}: {steps}")
    return "\n".join(lines)


def _check(records: list[dict]) -> None:
    summary = summarise(records)
    counts = summary["counts"]
    assert not any(counts[o] for o in BAD), f"{counts}\n{_failures(records)}"
    # the mutations bite: most cases are refused, some still run
    assert counts["clear"] >= len(records) // 4 and counts["ok"] >= len(records) // 20, counts


def test_fuzzed_checkpoints_fail_clearly_or_run(seeds):
    _check(fuzz(seeds, cases=300, seed=0, workers=2, mix=True))


@pytest.mark.slow
def test_fuzzed_checkpoints_fail_clearly_or_run_many(seeds):
    _check(fuzz(seeds, cases=3000, seed=1, workers=2, mix=True))


def test_the_unmutated_seeds_run(seeds):
    """The classifier's 'ok': each seed as built loads, computes finite logits and is inspected."""
    worker = Worker([str(p) for p in seeds.values()])
    try:
        for name, path in seeds.items():
            result = worker.run(str(path), timeout=60)
            assert result["outcome"] == "ok", (name, result)
            assert result["load"]["warnings"] == [], name  # their tokenizers are readable
    finally:
        worker.close()


def test_the_classifier(tmp_path):
    """Each outcome the fuzz fails on is one it can see: errors by type and message, and a child
    that sleeps, allocates past the limit or dies."""
    names = [str(tmp_path), "config.json"]
    clear = ConfigError(f"{tmp_path / 'config.json'}: num_hidden_layers is 0; it must be ...")
    assert _outcome_of(clear, names)[0] == "clear"
    assert _outcome_of(ConfigError("num_hidden_layers is 0."), names)[0] == "vague"  # no file
    assert _outcome_of(ConfigError(f"{tmp_path}: " + "x" * 600), names)[0] == "vague"  # too long
    assert _outcome_of(StateDictError(f"{tmp_path}: missing a tensor."), names)[0] == "clear"
    assert _outcome_of(moerun.RouterError(f"{tmp_path}: NaN."), names)[0] == "vague"  # not ours
    assert _outcome_of(KeyError("hidden_size"), names)[0] == "raw"
    assert _outcome_of(MemoryError(), names)[0] == "oom"

    def sleep(path):
        time.sleep(30)

    def allocate(path):
        try:
            bytearray(MEMORY_LIMIT + (1 << 30))
        except MemoryError:
            return {"outcome": "refused"}
        return {"outcome": "allocated"}

    def die(path):
        os.kill(os.getpid(), signal.SIGSEGV)

    assert _fork_case(str(tmp_path), 1.0, sleep)["outcome"] == "hang"
    assert _fork_case(str(tmp_path), 20.0, allocate)["outcome"] == "refused"
    died = _fork_case(str(tmp_path), 20.0, die)
    assert (died["outcome"], died["signal"]) == ("crash", signal.SIGSEGV)
