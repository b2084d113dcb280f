"""moerun.offload.memory on fake /proc and /sys trees: the cgroup v1 and v2 limits of the process's
own group and the groups above it, less what cannot just be dropped, MemAvailable, VmRSS, and the
choice between them."""

from pathlib import Path

import pytest
import torch

from moerun.offload.memory import cgroup_room, mem_available, memory_room, resident_bytes

GB = 2**30
MEMINFO = "MemTotal:       24731408 kB\nMemFree:         7035752 kB\nMemAvailable:   {} kB\nCached: 1 kB\n"


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1(root: Path, limit: int, usage: int, inactive: int, group="process_api/abc") -> None:
    """A cgroup v1 memory hierarchy with the process in `group` (and the line systemd writes)."""
    _write(root, "proc/self/cgroup", f"9:name=systemd:/\n4:memory:/{group}\n1:cpu:/\n0::/\n")
    d = f"sys/fs/cgroup/memory/{group}"
    _write(root, f"{d}/memory.limit_in_bytes", f"{limit}\n")
    _write(root, f"{d}/memory.usage_in_bytes", f"{usage}\n")
    _write(root, f"{d}/memory.stat", f"cache 5\nrss 7\ninactive_file 1\ntotal_inactive_file {inactive}\n")
    _write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")


def test_cgroup_v1_limit_less_what_cannot_be_dropped(tmp_path):
    _v1(tmp_path, limit=6 * GB, usage=2 * GB, inactive=GB // 2)
    room, source = cgroup_room(tmp_path)
    assert room == 6 * GB - (2 * GB - GB // 2)
    assert "memory.limit_in_bytes = 6.00 GB" in source


def test_cgroup_v1_without_a_limit_gives_way_to_mem_available(tmp_path):
    _v1(tmp_path, limit=9223372036854771712, usage=GB, inactive=0)
    _write(tmp_path, "proc/meminfo", MEMINFO.format(24119028))
    assert cgroup_room(tmp_path) is None
    assert mem_available(tmp_path) == 24119028 * 1024
    assert memory_room(torch.device("cpu"), root=tmp_path).bytes == 24119028 * 1024
    assert memory_room(torch.device("cpu"), root=tmp_path).source == "MemAvailable"


def test_the_tighter_of_the_cgroup_and_mem_available_wins(tmp_path):
    _v1(tmp_path, limit=8 * GB, usage=GB, inactive=0)
    _write(tmp_path, "proc/meminfo", MEMINFO.format(3 * 2**20))  # 3 GB available: less than the group allows
    room = memory_room(torch.device("cpu"), root=tmp_path)
    assert (room.bytes, room.source) == (3 * GB, "MemAvailable")
    _write(tmp_path, "proc/meminfo", MEMINFO.format(20 * 2**20))
    room = memory_room(torch.device("cpu"), root=tmp_path)
    assert room.bytes == 7 * GB and "cgroup" in room.source


def test_cgroup_v2_limit_of_a_group_above_the_process(tmp_path):
    """memory.max "max" in the process's own group; its parent's limit binds."""
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/job/leaf\n")
    base = "sys/fs/cgroup/user.slice"
    _write(tmp_path, f"{base}/job/leaf/memory.max", "max\n")
    _write(tmp_path, f"{base}/job/leaf/memory.current", f"{GB}\n")
    _write(tmp_path, f"{base}/job/leaf/memory.stat", "anon 1\ninactive_file 0\n")
    _write(tmp_path, f"{base}/job/memory.max", f"{4 * GB}\n")
    _write(tmp_path, f"{base}/job/memory.current", f"{3 * GB}\n")
    _write(tmp_path, f"{base}/job/memory.stat", f"anon 1\nactive_file 5\ninactive_file {GB}\n")
    room, source = cgroup_room(tmp_path)
    assert room == 4 * GB - (3 * GB - GB)
    assert "job/memory.max" in source


def test_inside_a_container_the_group_is_mounted_at_the_root(tmp_path):
    """/proc/self/cgroup names the host's path, which is not there: the mount's own files are read."""
    _write(tmp_path, "proc/self/cgroup", "0::/docker/0123abc\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", f"{2 * GB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{GB // 4}\n")
    assert cgroup_room(tmp_path)[0] == 2 * GB - GB // 4


def test_no_cgroup_files_and_no_meminfo_say_nothing(tmp_path):
    assert cgroup_room(tmp_path) is None and mem_available(tmp_path) is None
    assert memory_room(torch.device("cpu"), root=tmp_path) is None


def test_memory_gb_is_an_overall_budget_less_what_the_process_holds(tmp_path):
    _write(tmp_path, "proc/self/status", "Name:\tpython\nVmHWM:\t  900000 kB\nVmRSS:\t  524288 kB\n")
    _v1(tmp_path, limit=GB, usage=GB, inactive=0)  # an override: the cgroup is not asked
    room = memory_room(torch.device("cpu"), memory_gb=6, root=tmp_path)
    assert resident_bytes(tmp_path) == GB // 2
    assert (room.bytes, room.held) == (6 * GB - GB // 2, GB // 2)
    assert room.source.startswith("memory_gb=6")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_this_process_figures_are_read():
    """On this machine: VmRSS grows by the 64 MiB we map and write, MemAvailable positive."""
    import mmap

    before = resident_bytes()
    held = mmap.mmap(-1, 64 * 2**20)  # fresh pages (the heap may hold freed ones already resident)
    held.write(b"\1" * (64 * 2**20))  # written, so resident
    assert resident_bytes() - before >= 60 * 2**20
    assert mem_available() > 0
    held.close()
