"""Where a checkpoint is: a local path, or a Hugging Face hub id found in the local hub cache.

moerun never downloads: a hub id (`org/name`) resolves only to a snapshot already in the cache
(located as huggingface_hub does, see moerun.settings), laid out as
`models--org--name/refs/main` (a commit hash) and `models--org--name/snapshots/<hash>/...`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from moerun.errors import CheckpointError
from moerun.settings import Settings, settings

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory (moerun.settings has the rules); `environ` defaults to
    the process environment as read once by moerun.settings."""
    return settings().hf_hub_cache if environ is None else Settings.from_env(environ).hf_hub_cache


def resolve_checkpoint(path_or_id: str | os.PathLike, environ: Mapping[str, str] | None = None) -> Path:
    """An existing file or directory as is; else a hub id's snapshot directory in the local cache.
    `environ` defaults to os.environ."""
    path = Path(path_or_id)
    if path.exists():
        return path
    text = os.fspath(path_or_id)
    if not HUB_ID.fullmatch(text):
        raise CheckpointError(f"{text}: no such file or directory.")
    cache = hub_cache_dir(environ)
    repo = cache / ("models--" + text.replace("/", "--"))
    snapshot = _snapshot(repo)
    if snapshot is None:
        raise CheckpointError(
            f"{text}: no such file or directory, and no snapshot of the hub model {text!r} in the local "
            f"Hugging Face cache (looked in {repo}); moerun never downloads, so fetch it first "
            f"(e.g. `hf download {text}`) or pass a local path."
        )
    return snapshot


def _snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main names; failing that, the only or most recently modified snapshot."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots_dir = repo / "snapshots"
    snapshots = [p for p in snapshots_dir.iterdir() if p.is_dir()] if snapshots_dir.is_dir() else []
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)
