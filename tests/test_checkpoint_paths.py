"""Resolving a checkpoint: local paths as they are, hub ids only from a Hugging Face cache laid out as
huggingface_hub lays it out (built here in tmp_path), and never a download."""

import os
from pathlib import Path

import pytest

from moerun.loader import CheckpointError, hub_cache_dir, resolve_checkpoint
from moerun.settings import settings


@pytest.fixture(autouse=True)
def fresh_settings():
    """The environment is read once per process: re-read it around each test that changes it."""
    settings.cache_clear()
    yield
    settings.cache_clear()


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty hub cache that $HF_HUB_CACHE points at."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def add_snapshot(cache, repo_id: str, commit: str, ref: str | None = None):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(ref)
    return snapshot


def test_local_paths_are_returned_as_they_are(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    assert resolve_checkpoint(file) == file
    assert resolve_checkpoint(str(tmp_path)) == tmp_path


def test_a_local_path_wins_over_the_cache(hub, tmp_path, monkeypatch):
    add_snapshot(hub, "org/name", COMMIT, ref=COMMIT)
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("org/name").resolve() == (tmp_path / "org" / "name").resolve()


def test_a_hub_id_resolves_to_the_snapshot_refs_main_names(hub):
    add_snapshot(hub, "org/other", "f" * 40, ref="f" * 40)
    old = add_snapshot(hub, "org/name", "a" * 40)
    main = add_snapshot(hub, "org/name", COMMIT, ref=COMMIT + "\n")
    os.utime(old, (2e9, 2e9))  # newer than main's snapshot, yet refs/main decides
    assert resolve_checkpoint("org/name") == main


def test_without_refs_main_the_newest_snapshot_is_taken(hub):
    only = add_snapshot(hub, "org/name", COMMIT)
    assert resolve_checkpoint("org/name") == only
    newer = add_snapshot(hub, "org/name", "b" * 40, ref="c" * 40)  # refs/main names no snapshot
    os.utime(only, (1e9, 1e9))
    os.utime(newer, (2e9, 2e9))
    assert resolve_checkpoint("org/name") == newer


def test_an_absent_hub_id_is_never_downloaded(hub):
    (hub / "models--org--empty" / "snapshots").mkdir(parents=True)
    for repo_id in ["org/absent", "org/empty"]:
        with pytest.raises(CheckpointError, match="moerun never downloads") as e:
            resolve_checkpoint(repo_id)
        message = str(e.value)
        assert message.startswith(f"{repo_id}: no such file or directory")
        assert str(hub / ("models--" + repo_id.replace("/", "--"))) in message


@pytest.mark.parametrize("missing", ["/no/such/model.gguf", "./relative/path/x", "no-slash", "a/b/c"])
def test_a_missing_path_that_is_not_a_hub_id(hub, missing):
    with pytest.raises(CheckpointError, match="no such file or directory") as e:
        resolve_checkpoint(missing)
    assert str(e.value) == f"{missing}: no such file or directory."


def test_the_cache_directory_follows_huggingface_hub_rules():
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}).as_posix() == "/x/huggingface/hub"
    assert hub_cache_dir({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}).as_posix() == "/h/hub"
    assert hub_cache_dir({"HUGGINGFACE_HUB_CACHE": "/old", "HF_HOME": "/h"}).as_posix() == "/old"
    assert hub_cache_dir({"HF_HUB_CACHE": "/c", "HUGGINGFACE_HUB_CACHE": "/old"}).as_posix() == "/c"


def test_hf_home_is_used_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snapshot = add_snapshot(tmp_path / "hub", "org/name", COMMIT, ref=COMMIT)
    assert resolve_checkpoint("org/name") == snapshot
    with pytest.raises(CheckpointError, match="never downloads"):  # an explicit environ wins
        resolve_checkpoint("org/name", environ={"HF_HUB_CACHE": str(tmp_path / "elsewhere")})
