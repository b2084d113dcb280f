"""Placement chosen when no expert cache is given: the rule on plain byte counts (and its inverse, the
least memory that runs a model), and `load` on a machine with less memory than the model (by a
patched figure, or an overall budget `memory_gb`), which then streams with no other flag and says so
in one line: logits and generated ids bitwise those of the resident model, every expert read by the
store's O_DIRECT or pread readers on their own threads (prefetch's too), never on the thread that
computes. A budget below the least one gets one sentence saying what that is, and the figure it
gives is enough."""

import importlib
import re
import threading

import pytest
import torch
from hf_models import VOCAB, make_model, save_model

import moerun
from moerun.checkpoint.fit import hf_bytes, kv_reserve_bytes, workspace_bytes
from moerun.checkpoint.load import hf_model_config
from moerun.loader import SafetensorsCheckpoint
from moerun.loader import reads as reads_module
from moerun.offload import CacheBudgetError
from moerun.offload import memory as memory_module
from moerun.offload.budget import MARGIN_BYTES, MARGIN_FRACTION, auto_budget
from moerun.offload.memory import Room, resident_bytes

GB = 2**30
MB = 2**20
fit_module = importlib.import_module("moerun.checkpoint.fit")


def test_a_model_that_fits_stays_resident():
    fit = auto_budget(free_bytes=80 * GB, dense_bytes=10 * GB, expert_bytes=60 * GB, kv_bytes=2 * GB)
    assert fit.budget_bytes is None and not fit.streamed
    assert fit.margin_bytes == 4 * GB  # 5% of the free memory, above the 1 GB floor
    assert "every expert resident" in fit.describe()


def test_a_model_too_big_gets_what_is_left_after_dense_kv_and_margin():
    fit = auto_budget(free_bytes=24 * GB, dense_bytes=5 * GB, expert_bytes=60 * GB, kv_bytes=GB)
    assert fit.margin_bytes == int(0.05 * 24 * GB)
    assert fit.budget_bytes == 24 * GB - 5 * GB - GB - fit.margin_bytes
    text = fit.describe()
    assert "65.00 GB" in text and "may use 24.00 GB" in text and "expert_cache_gb=16.8 " in text
    assert "\n" not in text


def test_the_margin_is_at_least_the_floor():
    fit = auto_budget(free_bytes=8 * GB, dense_bytes=2 * GB, expert_bytes=30 * GB, kv_bytes=GB)
    assert fit.margin_bytes == MARGIN_BYTES == GB
    assert fit.budget_bytes == 4 * GB


def test_on_a_cpu_the_margin_is_the_working_memory_and_a_twentieth():
    """An 18.5 GB model under a 6 GB limit: 1 GB dense, 0.4 GB KV, 0.8 GB working memory."""
    kv, work = 400 * MB, 800 * MB
    fit = auto_budget(6 * GB, GB, 17 * GB + GB // 2, kv, workspace_bytes=work, floor=0)
    assert fit.margin_bytes == work + int(0.05 * 6 * GB)
    assert fit.budget_bytes == 6 * GB - GB - kv - fit.margin_bytes


def test_no_room_at_all_gives_a_zero_budget_for_the_cache_to_refuse():
    fit = auto_budget(free_bytes=4 * GB, dense_bytes=5 * GB, expert_bytes=30 * GB, kv_bytes=GB)
    assert fit.budget_bytes == 0


@pytest.mark.parametrize("floor", [0, MARGIN_BYTES], ids=["cpu", "cuda"])
@pytest.mark.parametrize("cache", [MB, 3 * GB])
def test_the_least_memory_stated_is_the_least_that_leaves_the_cache(floor, cache):
    """minimum_free inverts the rule: that much leaves a cache of `cache` bytes; a MB less does not."""
    shape = dict(
        dense_bytes=GB, expert_bytes=40 * GB, kv_bytes=GB // 3, workspace_bytes=700 * MB, floor=floor
    )
    least = auto_budget(GB, **shape).minimum_free(cache)
    assert auto_budget(least, **shape).budget_bytes >= cache
    assert auto_budget(least - MB, **shape).budget_bytes < cache
    expected = max(GB + GB // 3 + cache + floor, (GB + GB // 3 + 700 * MB + cache) / (1 - MARGIN_FRACTION))
    assert abs(least - expected) <= 2


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return save_model(make_model("olmoe"), tmp_path_factory.mktemp("olmoe") / "olmoe")


def _least_for(path, dtype, expert_share: float) -> int:
    """The memory (besides what the process holds) that leaves a cache of `expert_share` of the experts."""
    dense, experts = hf_bytes(SafetensorsCheckpoint(path), dtype)
    config = hf_model_config(path)
    fit = auto_budget(0, dense, experts, kv_reserve_bytes(config, dtype), workspace_bytes(config), floor=0)
    return fit.minimum_free(int(expert_share * experts))


@pytest.fixture(scope="module")
def resident(olmoe):
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    model = moerun.load(olmoe, dtype=torch.float32)
    out = ids, model.logits(ids), [t.id for t in model.generate(ids[0].tolist(), max_new_tokens=6)]
    model.close()
    return out


def _streamed_run(model, ids, monkeypatch) -> tuple[torch.Tensor, list[int], set[str]]:
    """Logits and greedy ids of `model`, and the names of the threads that read the file."""
    threads, real = set(), reads_module.os.preadv

    def preadv(fd, buffers, offset):
        threads.add(threading.current_thread().name)
        return real(fd, buffers, offset)

    monkeypatch.setattr(reads_module.os, "preadv", preadv)
    logits = model.logits(ids)
    generated = [t.id for t in model.generate(ids[0].tolist(), max_new_tokens=6)]
    return logits, generated, threads


def _check_streamed(model, line: str, threads: set[str]) -> None:
    assert "streaming experts with expert_cache_gb=" in line and line.count("\n") == 0
    budget = float(line.split("expert_cache_gb=")[1].split()[0]) * GB
    cache = model.expert_cache
    assert cache.nbytes <= budget * 1.001
    all_experts = model.config.moe.num_experts * sum(model.config.moe_layers)
    assert 0 < cache.num_slots < all_experts
    reads = cache.store.read_counts()
    assert reads["direct"] + reads["pread"] > 0
    assert reads["direct_bytes"] + reads["pread_bytes"] >= cache.stats.bytes_read > 0
    assert cache.stats.prefetch_issued > 0  # chosen streaming prefetches the model's top-k
    assert threads and all(name.startswith("moerun-expert-") for name in threads), threads


def test_with_no_flags_a_machine_too_small_streams_and_says_so(olmoe, resident, monkeypatch, capsys):
    ids, want_logits, want_ids = resident
    room = Room(_least_for(olmoe, torch.float32, 0.5), "MemAvailable")
    monkeypatch.setattr(fit_module, "memory_room", lambda device, memory_gb: room)
    capsys.readouterr()
    model = moerun.load(olmoe, dtype=torch.float32)
    line = capsys.readouterr().err.strip()
    assert "(MemAvailable)" in line
    logits, generated, threads = _streamed_run(model, ids, monkeypatch)
    _check_streamed(model, line, threads)
    assert torch.equal(logits, want_logits) and generated == want_ids
    model.close()


def test_memory_gb_smaller_than_the_model_streams_with_the_same_logits(olmoe, resident, monkeypatch, capsys):
    ids, want_logits, want_ids = resident
    # what the process holds, read once: the budget's margin (half this tiny model's experts, a few
    # hundred kB) is within what a collection of an earlier test's objects frees meanwhile
    held = resident_bytes()
    monkeypatch.setattr(memory_module, "resident_bytes", lambda root=None: held)
    memory_gb = (held + _least_for(olmoe, torch.float32, 0.5)) / GB
    capsys.readouterr()
    model = moerun.load(olmoe, dtype=torch.float32, memory_gb=memory_gb)
    line = capsys.readouterr().err.strip()
    assert f"memory_gb={memory_gb:g}" in line
    logits, generated, threads = _streamed_run(model, ids, monkeypatch)
    _check_streamed(model, line, threads)
    assert torch.equal(logits, want_logits) and generated == want_ids
    model.close()


def test_a_model_that_fits_stays_resident_and_says_so(olmoe, monkeypatch, capsys):
    room = Room(_least_for(olmoe, torch.float32, 1.5), "MemAvailable")
    monkeypatch.setattr(fit_module, "memory_room", lambda device, memory_gb: room)
    capsys.readouterr()
    model = moerun.load(olmoe, dtype=torch.float32)
    assert model.expert_cache is None
    line = capsys.readouterr().err.strip()
    assert "every expert resident" in line and line.count("\n") == 0


def test_a_budget_below_the_least_gives_one_sentence_with_a_figure_that_works(olmoe, capsys):
    with pytest.raises(CacheBudgetError) as info:
        moerun.load(olmoe, dtype=torch.float32, memory_gb=0.01)
    text = str(info.value)
    assert text.count(". ") == 0 and text.endswith(" or more.")
    assert "cannot run in the" in text and "one token's experts of a layer" in text
    least = float(re.search(r"give memory_gb=([\d.]+) or more", text).group(1))
    model = moerun.load(olmoe, dtype=torch.float32, memory_gb=least)  # the figure given is enough
    assert model.logits(torch.arange(4)[None]).isfinite().all()
    model.close()


def test_memory_gb_and_expert_cache_gb_together_are_refused(olmoe):
    with pytest.raises(ValueError, match="memory_gb or expert_cache_gb, not both"):
        moerun.load(olmoe, memory_gb=4, expert_cache_gb=1)
