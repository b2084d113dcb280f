"""What memory this process may use for a model, as the system states it.

On a CPU: the memory cgroup's limit where the process runs under one (cgroup v2 `memory.max`, or v1
`memory.limit_in_bytes`, of the process's own group and every group above it, from /proc/self/cgroup),
less what the group already uses that the kernel cannot just drop (its cached file pages not recently
used can go); never more than /proc/meminfo's MemAvailable. On CUDA: the device's free memory.
`Room` is the answer, with what it came from, for the one line that tells the user.

Every file is read under `root` (a parameter, so tests hand in a directory of fake files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NO_LIMIT = 2**60  # a cgroup v1 limit this large (the kernel writes ~2**63) means none


@dataclass(frozen=True)
class Room:
    """`bytes` the model may still take; `source` says where that figure came from; `held`: what the
    process held already, where an overall budget (`memory_gb`) counts it."""

    bytes: int
    source: str
    held: int = 0


def memory_room(device: torch.device, memory_gb: float | None = None, root: Path = Path("/")) -> Room | None:
    """The memory a model loaded now on `device` may take: `memory_gb` (an overall budget for the
    process) less what the process holds already, else what the system allows; None where nothing
    says (a CUDA device torch cannot query, an OS without /proc)."""
    if device.type == "cuda":
        if memory_gb is not None:
            held = torch.cuda.memory_reserved(device) if torch.cuda.is_available() else 0
            return Room(int(memory_gb * 2**30) - held, f"memory_gb={memory_gb:g} on {device}", held)
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return Room(int(free), f"free memory of {device}")
    if memory_gb is not None:
        held = resident_bytes(root) or 0
        source = f"memory_gb={memory_gb:g}, less the {held / 2**30:.2f} GB this process holds"
        return Room(int(memory_gb * 2**30) - held, source, held)
    available = mem_available(root)
    limit = cgroup_room(root)
    if limit is not None and (available is None or limit[0] < available):
        return Room(*limit)
    if available is None:
        return None
    return Room(available, "MemAvailable")


def mem_available(root: Path = Path("/")) -> int | None:
    """/proc/meminfo's MemAvailable in bytes (None where the file or the line is missing)."""
    fields = _fields(root / "proc" / "meminfo")
    return fields["MemAvailable"] * 1024 if "MemAvailable" in fields else None


def resident_bytes(root: Path = Path("/")) -> int | None:
    """This process's resident memory (VmRSS of /proc/self/status) in bytes."""
    fields = _fields(root / "proc" / "self" / "status")
    return fields["VmRSS"] * 1024 if "VmRSS" in fields else None


def cgroup_room(root: Path = Path("/")) -> tuple[int, str] | None:
    """(bytes the process's memory cgroups still allow, which limit) for the tightest of the group
    this process is in and the groups above it; None where no group has a limit."""
    groups = _cgroup_dirs(root)
    best: tuple[int, str] | None = None
    for directory, version in groups:
        found = _group_room(directory, version)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _cgroup_dirs(root: Path) -> list[tuple[Path, int]]:
    """The memory cgroup directories of this process, its own first then each one above, with the
    cgroup version: v1's memory hierarchy where there is one, else the v2 hierarchy."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    if v1 is not None:
        return _ancestors(root / "sys" / "fs" / "cgroup" / "memory", v1, 1)
    if v2 is not None:
        return _ancestors(root / "sys" / "fs" / "cgroup", v2, 2)
    return []


def _ancestors(mount: Path, path: str, version: int) -> list[tuple[Path, int]]:
    """`mount`/`path` and each directory above it up to `mount` that exists (inside a container the
    process's path may not be there: the container's group is mounted at `mount` itself)."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [(d, version) for d in dirs if d.is_dir()]


def _group_room(directory: Path, version: int) -> tuple[int, str] | None:
    """(limit - usage that cannot just be dropped, which limit) of one cgroup; None without a limit."""
    limit_file, usage_file, inactive = (
        ("memory.max", "memory.current", "inactive_file")
        if version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    limit = _number(directory / limit_file)
    if limit is None or limit >= NO_LIMIT:
        return None
    usage = _number(directory / usage_file) or 0
    dropped = _fields(directory / "memory.stat", sep=" ").get(inactive, 0)
    name = f"{directory / limit_file} = {limit / 2**30:.2f} GB"
    return limit - max(usage - dropped, 0), f"the cgroup limit ({name})"


def _number(path: Path) -> int | None:
    """The integer a cgroup file holds; None for "max" or a missing file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _fields(path: Path, sep: str = ":") -> dict[str, int]:
    """A "name<sep> number [unit]" file as name -> number (lines that do not parse skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(sep)
        words = rest.split()
        if words and words[0].isdigit():
            out[name.strip()] = int(words[0])
    return out
