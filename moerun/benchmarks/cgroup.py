"""A child memory cgroup for a benchmark's subprocess: a memory limit smaller than the machine's.

cgroup v2 (`memory.max` in a child of this process's group, with the memory controller enabled for
the group's children) or v1 (`memory.limit_in_bytes` in a child of this process's group in the
memory hierarchy). A subprocess joins it as it starts (`command`), before it allocates anything.
A cgroup is charged only for the pages its processes bring in: a file's pages already in the page
cache are not charged, so a benchmark drops the file's cached pages before each run
(moerun.benchmarks.pagecache), or the limit is not what it seems.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")


class CgroupError(OSError):
    """No child memory cgroup here, said in one sentence."""


@dataclass(frozen=True)
class Mount:
    """A cgroup file system: where it is mounted, the group path its root is, its version."""

    point: Path
    root: str
    version: int


def cgroup_mounts(mountinfo: str) -> dict[int, Mount]:
    """version -> the mount of the v1 memory hierarchy (1) and of the v2 hierarchy (2), from the
    text of /proc/self/mountinfo."""
    mounts = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            mounts.setdefault(2, Mount(Path(fields[4]), fields[3], 2))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.setdefault(1, Mount(Path(fields[4]), fields[3], 1))
    return mounts


def own_groups(proc_cgroup: str) -> dict[int, str]:
    """version -> this process's group path: in the v1 memory hierarchy (1) and in v2 (2), from the
    text of /proc/self/cgroup."""
    groups = {}
    for line in proc_cgroup.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":
            groups[2] = path
        elif "memory" in controllers.split(","):
            groups[1] = path
    return groups


def _group_dir(mount: Mount, group: str) -> Path:
    """The directory of `group` (a path from /proc/self/cgroup) under `mount`."""
    relative = group if mount.root == "/" else group.removeprefix(mount.root)
    return mount.point / relative.lstrip("/")


def _error(err: OSError) -> str:
    return err.strerror or str(err)


@dataclass(frozen=True)
class MemoryCgroup:
    """A child memory cgroup made by `create`; `command` (a command run in it) or `join` (the calling
    process into it), `peak_bytes`, `oom_kills`, `remove` (once its processes have exited)."""

    path: Path
    version: int
    limit_bytes: int

    @classmethod
    def create(
        cls, limit_bytes: int, name: str, proc_cgroup: Path | None = None, mountinfo: Path | None = None
    ) -> MemoryCgroup:
        """A child `name` of this process's group limited to `limit_bytes`, v2 where its memory
        controller can be enabled for the group's children, else v1; CgroupError (one sentence) where
        neither. `proc_cgroup`, `mountinfo`: other files than PROC_CGROUP and MOUNTINFO to read."""
        try:
            mounts = cgroup_mounts((mountinfo or MOUNTINFO).read_text())
            groups = own_groups((proc_cgroup or PROC_CGROUP).read_text())
        except OSError as err:
            reason = f"{err.filename} cannot be read ({_error(err)})"
            raise CgroupError(f"this machine gives no child memory cgroup: {reason}.") from None
        reasons = []
        for version in (2, 1):
            if version not in mounts or version not in groups:
                reasons.append(
                    "no cgroup v2 hierarchy is mounted"
                    if version == 2
                    else "no cgroup v1 memory hierarchy is mounted"
                )
                continue
            parent = _group_dir(mounts[version], groups[version])
            try:
                return cls._make(parent / name, version, limit_bytes)
            except CgroupError as err:
                reasons.append(str(err))
        raise CgroupError(f"this machine gives no child memory cgroup: {'; '.join(reasons)}.")

    @classmethod
    def _make(cls, path: Path, version: int, limit_bytes: int) -> MemoryCgroup:
        limit_file = path / ("memory.max" if version == 2 else "memory.limit_in_bytes")
        where = f"cgroup v{version} under {path.parent}"
        if version == 2:  # the memory controller, where the group has it, enabled for its children
            try:
                available = (path.parent / "cgroup.controllers").read_text().split()
                enabled = path.parent / "cgroup.subtree_control"
                if "memory" in available and "memory" not in enabled.read_text().split():
                    enabled.write_text("+memory")
            except OSError as err:
                reason = f"the memory controller cannot be enabled ({_error(err)})"
                raise CgroupError(f"{where}: {reason}") from None
            if "memory" not in available:
                raise CgroupError(f"{where}: the memory controller is not available there")
        try:
            path.mkdir()
        except OSError as err:
            raise CgroupError(f"{where}: a child cannot be made ({_error(err)})") from None
        if not limit_file.exists():
            path.rmdir()
            raise CgroupError(f"{where}: {path.parent} is not a memory cgroup (no {limit_file.name})")
        try:
            limit_file.write_text(str(limit_bytes))
            # no swap beyond the limit (absent without swap accounting: nothing to stop then)
            swap = path / ("memory.swap.max" if version == 2 else "memory.memsw.limit_in_bytes")
            if swap.exists():
                with contextlib.suppress(OSError):
                    swap.write_text("0" if version == 2 else str(limit_bytes))
            limit = limit_file.read_text().strip()
        except OSError as err:
            path.rmdir()
            raise CgroupError(f"{where}: {limit_file.name} cannot be written ({_error(err)})") from None
        return cls(path, version, int(limit) if limit.isdigit() else limit_bytes)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as a command that first moves its own process into the cgroup, then runs `argv` in
        it (the same process: `exec`), so everything it allocates is charged to the cgroup."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def join(self) -> None:
        """Move the calling process into the cgroup (a subprocess's preexec_fn: before it allocates)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The most memory (anonymous and page cache) charged at once, where the kernel says."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """Processes the OOM killer killed in the cgroup, where the kernel counts them."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return None
        counts = dict(line.split() for line in lines if len(line.split()) == 2)
        return int(counts["oom_kill"]) if "oom_kill" in counts else None

    def remove(self) -> None:
        """Remove the (empty) cgroup: its processes' exit can take the kernel a moment to see."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
