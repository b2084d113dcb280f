"""`moerun bench --model FILE --memory-limit-gb N [--peer llama.cpp]`: each engine alone under the
same memory limit, side by side.

Each engine runs in a process of its own (moerun.benchmarks.engine_run) inside a child memory cgroup
of N GiB (moerun.benchmarks.cgroup), one after the other; before each, the file's cached pages are
dropped, as a cgroup is charged only for the pages it brings in. moerun runs as it chooses (or with
the expert-store options given); llama.cpp at its defaults (weights repacked into anonymous memory)
and with `--no-repack` (weights used from its map of the file). Every run gets the same prompt and
then the same decode tokens, chosen in advance at random (varied tokens: every step's routing is new),
the first WARMUP_STEPS of them untimed.

Reported per run: load time, time to the first logits, prefill and decode tok/s, the expert store's
hit rate over the timed steps (moerun, where it streams), bytes read from storage per token
(/proc/PID/io read_bytes, page faults of a map included) and that rate against the disk's sequential
read measured once at the start, the peaks of resident anonymous and file-backed memory (sampled from
/proc/PID/status) and the cgroup's own peak; a run the OOM killer or the time limit ends says where.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.cgroup import MemoryCgroup
from moerun.benchmarks.pagecache import drop_page_cache, sequential_read
from moerun.benchmarks.procfs import RssSampler

WARMUP_STEPS = 2
REPACK = {"both": (True, False), "on": (True,), "off": (False,)}  # --peer-repack -> llama.cpp's runs


def contenders(peer: str | None, peer_repack: str, moerun_options: dict) -> list[tuple[str, dict]]:
    """(label, the engine's part of the run spec) of every run, moerun's first."""
    runs = [("moerun", {"engine": "moerun", "options": moerun_options})]
    if peer is not None:
        for repack in REPACK[peer_repack]:
            runs.append((peer if repack else f"{peer} --no-repack", {"engine": peer, "repack": repack}))
    return runs


def run_memory_limit_bench(
    settings: BenchSettings,
    path: str | Path,
    memory_limit_gb: float,
    prefill_tokens: int = 256,
    peer: str | None = None,
    peer_repack: str = "both",
    moerun_options: dict | None = None,
    timeout_s: float = 3600.0,
) -> dict:
    """Run every contender under a `memory_limit_gb` GiB cgroup (see the module docstring); raises
    CgroupError (one sentence) where the machine gives no child memory cgroup."""
    from moerun.checkpoint.describe import describe

    path, log = Path(path), settings.log
    limit = int(memory_limit_gb * 2**30)
    probe = MemoryCgroup.create(limit, f"moerun-bench-{os.getpid()}")  # refuses before any work
    probe.remove()
    log(f"measuring the disk's sequential read of {path}")
    drop_page_cache(path)
    disk = sequential_read(path)
    vocab = describe(path)["vocab"]
    gen = torch.Generator().manual_seed(0)
    steps = WARMUP_STEPS + settings.decode_steps
    base = {
        "path": str(path),
        "threads": torch.get_num_threads(),
        "dtype": settings.dtype,
        "backend": settings.backend,
        "prompt": torch.randint(0, vocab, (prefill_tokens,), generator=gen).tolist(),
        "tokens": torch.randint(0, vocab, (steps,), generator=gen).tolist(),
    }
    load_before = os.getloadavg()[0]
    runs = []
    for index, (label, engine) in enumerate(contenders(peer, peer_repack, moerun_options or {})):
        log(f"{label}: under {memory_limit_gb:g} GiB, after dropping the file's cached pages")
        run = _run(label, base | engine, limit, f"moerun-bench-{os.getpid()}-{index}", timeout_s, log)
        rate = run.get("read_bytes_per_s")
        run["read_vs_disk"] = rate / disk.bytes_per_s if rate is not None else None
        runs.append(run)
    file_bytes = path.stat().st_size
    return {
        "model": str(path),
        "file_bytes": file_bytes,
        "memory_limit_bytes": limit,
        "cgroup": f"v{probe.version} under {probe.path.parent}",
        "disk": asdict(disk),
        "threads": base["threads"],
        "cpus": os.cpu_count(),
        "load_average": [load_before, os.getloadavg()[0]],
        "dtype": settings.dtype,
        "prompt_tokens": prefill_tokens,
        "decode_steps": settings.decode_steps,
        "warmup_steps": WARMUP_STEPS,
        "runs": runs,
    }


def _run(label: str, spec: dict, limit: int, name: str, timeout_s: float, log) -> dict:
    """One run in a fresh cgroup `name`: its figures (`_figures`), status and memory peaks."""
    drop_page_cache(Path(spec["path"]))
    cgroup = MemoryCgroup.create(limit, name)
    argv = [sys.executable, "-m", "moerun.benchmarks.engine_run", json.dumps(spec)]
    events: list[dict] = []
    env = dict(os.environ)  # this moerun, wherever it was imported from
    package_root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    try:
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(
                cgroup.command(argv), stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
            sampler = RssSampler(child.pid).start()
            reader = threading.Thread(target=_read_events, args=(child.stdout, events, label, log))
            reader.start()
            try:
                child.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                timed_out = True
            reader.join()
            peaks = sampler.stop()
            err.seek(0)
            stderr = err.read()
        ooms, peak = cgroup.oom_kills(), cgroup.peak_bytes()
    finally:
        cgroup.remove()
    # where the experts live when no expert store streams them
    memory = "resident" if spec["engine"] == "moerun" else "page cache" if not spec["repack"] else "repacked"
    r = {"label": label, "memory": memory, **_figures(events)}
    r["status"] = _status(events, child.returncode, timed_out, timeout_s, ooms)
    r["ok"] = r["status"] == "ok"
    r |= {
        "peak_rss_anon": peaks["RssAnon"],
        "peak_rss_file": peaks["RssFile"],
        "peak_rss_shmem": peaks["RssShmem"],
        "peak_rss": peaks["VmRSS"],
        "cgroup_peak_bytes": peak,
        "oom_kills": ooms,
    }
    if not r["ok"]:
        r["stderr_tail"] = stderr[-2000:]
    log(f"{label}: {r['status']}")
    return r


def _read_events(stream, events: list[dict], label: str, log) -> None:
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # anything else an engine prints
        if isinstance(event, dict) and "event" in event:
            events.append(event)
            if event["event"] in ("loaded", "prefill"):
                log(f"{label}: {event['event']} in {event['seconds']:.1f} s")


def _phase(kinds: set[str]) -> str:
    return "loading" if "loaded" not in kinds else "prefilling" if "prefill" not in kinds else "decoding"


def _status(events: list[dict], returncode: int, timed_out: bool, timeout_s: float, ooms: int | None) -> str:
    kinds = {e["event"] for e in events}
    if "done" in kinds and returncode == 0:
        return "ok"
    phase = _phase(kinds)
    if timed_out:
        return f"stopped at the time limit ({timeout_s:.0f} s) while {phase}"
    if ooms or returncode == -9:
        return f"killed by the OOM killer while {phase}" if ooms else f"killed (SIGKILL) while {phase}"
    if returncode < 0:
        return f"killed by signal {-returncode} while {phase}"
    return f"failed while {phase} (exit status {returncode})"


def _figures(events: list[dict]) -> dict:
    """Rates, reads and the expert store's hit rate from a run's events, as far as it got."""
    by_kind = {e["event"]: e for e in events if e["event"] != "step"}
    steps = [e for e in events if e["event"] == "step"]
    f: dict = {"load_s": None, "first_logits_s": None, "prefill_tok_s": None, "decode_steps": 0}
    if "loaded" in by_kind:
        loaded = by_kind["loaded"]
        f["load_s"] = loaded["seconds"]
        f["load_read_bytes"] = loaded["read_bytes"] - by_kind["start"]["read_bytes"]
    if "prefill" in by_kind:
        prefill = by_kind["prefill"]
        f["first_logits_s"] = f["load_s"] + prefill["seconds"]
        f["prefill_tok_s"] = prefill["tokens"] / prefill["seconds"]
        f["prefill_read_bytes"] = prefill["read_bytes"] - by_kind["loaded"]["read_bytes"]
    timed = steps[WARMUP_STEPS:]
    if not timed:
        return f
    before = steps[WARMUP_STEPS - 1] if WARMUP_STEPS else by_kind["prefill"]
    seconds = sum(e["seconds"] for e in timed)
    read = timed[-1]["read_bytes"] - before["read_bytes"]
    f |= {
        "decode_steps": len(timed),
        "decode_tok_s": len(timed) / seconds,
        "median_step_s": statistics.median(e["seconds"] for e in timed),
        "read_bytes_per_token": read / len(timed),
        "read_bytes_per_s": read / seconds,
    }
    if (store := timed[-1].get("store")) is not None:
        hits = store["hits"] - before["store"]["hits"]
        misses = store["misses"] - before["store"]["misses"]
        f["store"] = {"slots": store["slots"], "cache_bytes": store["cache_bytes"]}
        f["hit_rate"] = hits / (hits + misses) if hits + misses else None
        # what the store copied in, from the page cache or the disk (read_bytes: from the disk alone)
        f["store_bytes_per_token"] = (store["bytes_read"] - before["store"]["bytes_read"]) / len(timed)
    return f


def format_memory_limit_table(r: dict) -> str:
    gb, gib, mib = 1e9, 2**30, 2**20
    disk = r["disk"]
    lines = [
        f"moerun bench --model {r['model']} --memory-limit-gb {r['memory_limit_bytes'] / gib:g}  "
        f"(cgroup {r['cgroup']}; the file is {r['file_bytes'] / gb:.2f} GB, "
        f"{r['file_bytes'] / r['memory_limit_bytes']:.2f}x the limit)",
        f"  disk sequential read {disk['bytes_per_s'] / gb:.2f} GB/s ({disk['method']}, "
        f"{disk['nbytes'] / mib:.0f} MiB); a {r['prompt_tokens']}-token prompt, then {r['decode_steps']} "
        f"decode steps of varied tokens after {r['warmup_steps']} untimed; {r['threads']} threads, "
        f"{r['dtype']}; 1-min load average {r['load_average'][0]:.1f} before, "
        f"{r['load_average'][1]:.1f} after",
        f"  {'run':<22}{'load s':>8}{'1st logits s':>14}{'prefill tok/s':>15}{'decode tok/s':>14}"
        f"{'hit rate':>12}{'read/token':>12}{'read GB/s (of disk)':>21}",
    ]

    def cell(value, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return "-" if value is None else format(value / scale, fmt) + unit

    for run in r["runs"]:
        hit = cell(run.get("hit_rate"), ".0%") if "store" in run else run["memory"]
        read = cell(run.get("read_bytes_per_s"), ".2f", gb)
        if run.get("read_vs_disk") is not None:
            read += f" ({run['read_vs_disk']:.0%})"
        lines.append(
            f"  {run['label']:<22}{cell(run['load_s'], '.1f'):>8}{cell(run['first_logits_s'], '.1f'):>14}"
            f"{cell(run['prefill_tok_s'], '.1f'):>15}{cell(run.get('decode_tok_s'), '.2f'):>14}{hit:>12}"
            f"{cell(run.get('read_bytes_per_token'), '.0f', mib, ' MiB'):>12}{read:>21}"
        )
    lines.append(f"  {'run':<22}{'peak anon':>12}{'peak file':>12}{'cgroup peak':>13}  status")
    for run in r["runs"]:
        status = run["status"] if run["ok"] else f"{run['status']} ({run['decode_steps']} steps timed)"
        lines.append(
            f"  {run['label']:<22}{cell(run['peak_rss_anon'], '.2f', gib, ' GiB'):>12}"
            f"{cell(run['peak_rss_file'], '.2f', gib, ' GiB'):>12}"
            f"{cell(run['cgroup_peak_bytes'], '.2f', gib, ' GiB'):>13}  {status}"
        )
    ours = r["runs"][0].get("decode_tok_s")
    peers = [run for run in r["runs"][1:] if run.get("decode_tok_s")]
    if ours and peers:
        best = max(peers, key=lambda run: run["decode_tok_s"])
        lines.append(
            f"  decode: moerun {ours / best['decode_tok_s']:.2f}x {best['label']} (the peer's best run here)"
        )
    return "\n".join(lines)
