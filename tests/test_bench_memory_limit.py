"""`moerun bench --memory-limit-gb`: the child memory cgroup (its one-sentence refusals on a machine that
gives none, simulated; the limit holding on this machine where it gives one), the /proc readings on
this test process itself, the sequential disk read, the figures made from a run's events, and one
small run of the whole benchmark on a tiny model."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moerun.benchmarks import cgroup as cgroup_module
from moerun.benchmarks import memory_limit
from moerun.benchmarks.cgroup import CgroupError, MemoryCgroup, cgroup_mounts, own_groups
from moerun.benchmarks.pagecache import drop_page_cache, sequential_read
from moerun.benchmarks.procfs import RssSampler, read_io, read_status
from moerun.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_peer_gguf import write_f16_gguf  # noqa: E402
from test_bench_peer import TINY  # noqa: E402

MiB = 2**20


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and "\n" not in message and ". " not in message, message


def _fake_cgroup_files(tmp_path: Path, mounted: bool = True) -> tuple[Path, Path]:
    """/proc/self/cgroup and /proc/self/mountinfo of a machine whose v1 memory hierarchy (if
    `mounted`) is the directory tmp_path/memory, this process in its group /bench."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    lines = ["22 1 0:20 / / rw,relatime - ext4 /dev/vda rw"]
    if mounted:
        lines.append(f"30 22 0:26 / {tmp_path / 'memory'} rw,relatime - cgroup cgroup rw,memory")
    mountinfo.write_text("\n".join(lines) + "\n")
    proc_cgroup.write_text("4:memory:/bench\n1:cpu:/\n0::/\n")
    return proc_cgroup, mountinfo


def test_the_proc_files_are_read_as_the_kernel_writes_them():
    mounts = cgroup_mounts(
        "35 25 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "36 25 0:31 /inner /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "37 25 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    )
    assert (mounts[1].point, mounts[1].root) == (Path("/sys/fs/cgroup/memory"), "/")
    assert (mounts[2].point, mounts[2].root) == (Path("/sys/fs/cgroup/unified"), "/inner")
    assert own_groups("4:memory:/a/b\n2:cpu,cpuacct:/c\n0::/d\n") == {1: "/a/b", 2: "/d"}


def test_no_memory_hierarchy_is_one_sentence(tmp_path):
    proc_cgroup, mountinfo = _fake_cgroup_files(tmp_path, mounted=False)
    with pytest.raises(CgroupError) as err:
        MemoryCgroup.create(MiB << 10, "run", proc_cgroup, mountinfo)
    message = str(err.value)
    _one_sentence(message)
    assert "no child memory cgroup" in message and "v1 memory hierarchy" in message and "v2" in message


def test_an_unwritable_group_is_one_sentence_naming_it(tmp_path):
    proc_cgroup, mountinfo = _fake_cgroup_files(tmp_path)
    with pytest.raises(CgroupError) as err:  # the group's directory is missing: no child can be made
        MemoryCgroup.create(MiB << 10, "run", proc_cgroup, mountinfo)
    _one_sentence(str(err.value))
    assert f"{tmp_path / 'memory' / 'bench'}" in str(err.value) and "cannot be made" in str(err.value)
    (tmp_path / "memory" / "bench").mkdir(parents=True)  # a plain directory: no limit file appears
    with pytest.raises(CgroupError) as err:
        MemoryCgroup.create(MiB << 10, "run", proc_cgroup, mountinfo)
    _one_sentence(str(err.value))
    assert "is not a memory cgroup (no memory.limit_in_bytes)" in str(err.value)
    assert list((tmp_path / "memory" / "bench").iterdir()) == []  # the child it made is gone again


def test_the_bench_refuses_in_one_sentence_before_loading(tmp_path, capsys, monkeypatch):
    proc_cgroup, mountinfo = _fake_cgroup_files(tmp_path, mounted=False)
    monkeypatch.setattr(cgroup_module, "PROC_CGROUP", proc_cgroup)
    monkeypatch.setattr(cgroup_module, "MOUNTINFO", mountinfo)
    monkeypatch.setattr(memory_limit, "sequential_read", lambda path: pytest.fail("it measured first"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    assert main(["bench", "--model", str(model), "--memory-limit-gb", "1"]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("moerun bench: this machine gives no child memory cgroup: ")
    _one_sentence(message)


def _cgroup_or_skip(limit: int, name: str) -> MemoryCgroup:
    try:
        return MemoryCgroup.create(limit, f"moerun-test-{os.getpid()}-{name}")
    except CgroupError as err:
        pytest.skip(str(err))


def test_the_limit_holds_for_a_process_started_in_it():
    group = _cgroup_or_skip(128 * MiB, "limit")
    try:
        fits = subprocess.run(group.command([sys.executable, "-c", "a = b'x' * (32 << 20)"]))
        too_big = subprocess.run(group.command([sys.executable, "-c", "a = b'x' * (512 << 20)"]))
        peak, kills = group.peak_bytes(), group.oom_kills()
    finally:
        group.remove()
    assert fits.returncode == 0 and too_big.returncode == -9  # SIGKILL, from the OOM killer
    assert kills is None or kills >= 1
    assert peak is None or 32 * MiB <= peak <= 128 * MiB
    assert not group.path.exists()


def test_status_fields_add_up_and_the_sampler_sees_an_allocation():
    status = read_status()
    assert status["RssAnon"] + status["RssFile"] + status["RssShmem"] == status["VmRSS"]  # the kernel's sum
    assert status["VmHWM"] >= status["VmRSS"] > 0
    sampler = RssSampler(os.getpid(), interval=0.01).start()
    before = read_status()["RssAnon"]
    block = np.ones(64 * MiB, dtype=np.uint8)  # touched: resident anonymous memory
    time.sleep(0.2)
    peaks = sampler.stop()
    del block
    assert peaks["RssAnon"] >= before + 60 * MiB and sampler.samples >= 2


def test_read_bytes_count_a_cold_read_and_the_disk_read_reads_the_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * MiB + 1000))
    os.sync()
    drop_page_cache(path)
    before = read_io()
    assert len(path.read_bytes()) == 8 * MiB + 1000
    after = read_io()
    assert after["rchar"] - before["rchar"] >= 8 * MiB + 1000
    if after["read_bytes"] == before["read_bytes"]:
        pytest.skip(f"{tmp_path} is not on a block device (tmpfs?): nothing is read from storage")
    assert after["read_bytes"] - before["read_bytes"] >= 8 * MiB
    disk = sequential_read(path, chunk=MiB)
    assert disk.nbytes == 8 * MiB and disk.bytes_per_s > 0  # whole pages: the last 1000 bytes left out
    assert disk.method in ("O_DIRECT", "after POSIX_FADV_DONTNEED")


def test_figures_from_a_runs_events():
    def store(hits, misses, read):
        return {"slots": 4, "cache_bytes": 400, "hits": hits, "misses": misses, "bytes_read": read}

    events = [
        {"event": "start", "read_bytes": 100},
        {"event": "loaded", "seconds": 2.0, "read_bytes": 1100, "store": store(0, 0, 0)},
        {"event": "prefill", "seconds": 0.5, "tokens": 10, "read_bytes": 1600, "store": store(5, 5, 50)},
        {"event": "step", "seconds": 9.0, "read_bytes": 2600, "store": store(6, 8, 80)},  # warm-up
        {"event": "step", "seconds": 9.0, "read_bytes": 3600, "store": store(7, 9, 90)},  # warm-up
        {"event": "step", "seconds": 0.25, "read_bytes": 3700, "store": store(10, 10, 100)},
        {"event": "step", "seconds": 0.75, "read_bytes": 3900, "store": store(12, 14, 140)},
    ]
    assert memory_limit.WARMUP_STEPS == 2
    f = memory_limit._figures(events)
    assert (f["load_s"], f["first_logits_s"], f["prefill_tok_s"]) == (2.0, 2.5, 20.0)
    assert (f["load_read_bytes"], f["prefill_read_bytes"]) == (1000, 500)
    assert (f["decode_steps"], f["decode_tok_s"], f["read_bytes_per_token"]) == (2, 2.0, 150.0)
    assert f["read_bytes_per_s"] == 300.0 and f["median_step_s"] == 0.5
    assert f["hit_rate"] == 5 / 10 and f["store_bytes_per_token"] == 25.0
    killed = memory_limit._status(events[:4], -9, False, 60, 1)
    assert killed == "killed by the OOM killer while decoding"
    assert memory_limit._status(events[:2], -9, False, 60, 0) == "killed (SIGKILL) while prefilling"
    assert memory_limit._status(events, 0, False, 60, 0) == "failed while decoding (exit status 0)"
    assert memory_limit._status([*events, {"event": "done"}], 0, False, 60, 0) == "ok"


@pytest.mark.parametrize("peer", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["alone", "peer"])
def test_a_small_run_under_a_limit(tmp_path, capsys, peer):
    _cgroup_or_skip(64 * MiB, "probe").remove()
    if peer:
        pytest.importorskip("llama_cpp")
    path = write_f16_gguf(tmp_path / "tiny.gguf", TINY)
    argv = ["bench", "--model", str(path), "--memory-limit-gb", "1", "--json", "--threads", "1"]
    argv += ["--decode-steps", "3", "--prefill-tokens", "8", "--expert-cache-gb", "0.0002"]
    argv += ["--peer", "llama.cpp", "--peer-repack", "off"] if peer else []
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["memory_limit_bytes"] == 2**30 and r["decode_steps"] == 3
    assert r["disk"]["nbytes"] == path.stat().st_size // 4096 * 4096
    assert [run["label"] for run in r["runs"]] == ["moerun"] + (["llama.cpp --no-repack"] if peer else [])
    for run in r["runs"]:
        assert run["ok"], run
        assert run["decode_steps"] == 3 and run["decode_tok_s"] > 0
        assert run["peak_rss_anon"] > 0 and run["cgroup_peak_bytes"] <= 2**30
        assert run["read_bytes_per_token"] >= 0
    ours = r["runs"][0]
    assert ours["store"]["slots"] > 0 and 0 <= ours["hit_rate"] <= 1
