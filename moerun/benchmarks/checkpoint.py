"""`moerun bench --model PATH`: a checkpoint moerun loads (a GGUF file or a Hugging Face directory),
and with `--peer llama.cpp` the same GGUF file run by llama.cpp in this process.

Everyone gets the same token ids, a seeded random sequence. Decode: after a 32-token prompt, N greedy
steps, each timed alone (its forward, the last position's logits and their argmax): the median
step and the total. moerun picks the greedy tokens; the peer is fed the same ones, so both compute
the same positions and their logits are compared there. Prefill: a `prefill_tokens`-token prompt
into an empty cache, logits of its last position only (what generation needs, and all llama.cpp
computes). The contenders take turns repetition by repetition (A B A B), so drift in a shared
machine's speed hits them alike. Bytes per token: `moerun.benchmarks.weight_bytes`; the roofline: a copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.layer import copy_bandwidth
from moerun.benchmarks.weight_bytes import gguf_decode_bytes, model_decode_bytes
from moerun.checkpoint.load import load
from moerun.model import MoEModel
from moerun.moe.backends import resolve_backend
from moerun.quant.formats import COMPUTE_DTYPES

PROMPT_TOKENS = 32  # the decode runs' prompt


class MoerunContender:
    """A loaded model driven as generation drives it: `prefill(ids)` into a fresh cache and
    `step(token)`, each returning the last position's logits, fp32 [vocab]."""

    name = "moerun"

    def __init__(self, model: MoEModel, capacity: int):
        self.model = model
        self.cache = model.new_cache(1, capacity)  # allocated once, outside every timing

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.cache.length = 0  # positions past the length are never read: the buffers are reused
        x, chunk = torch.tensor([ids]), self.model.prefill_chunk
        for s in range(0, len(ids), chunk):
            hidden = self.model.forward(x[:, s : s + chunk], self.cache)
        return self.model.hidden_logits(hidden[0, -1])

    def step(self, token: int) -> torch.Tensor:
        hidden = self.model.forward(torch.tensor([[token]]), self.cache)
        return self.model.hidden_logits(hidden[0, -1])


def _decode(contender, prompt: list[int], tokens: list[int]) -> tuple[list[float], torch.Tensor]:
    """Seconds of each step feeding `tokens` after `prompt`, and the logits [1 + steps, V] of the
    prompt's last position and of every step."""
    logits, seconds = [contender.prefill(prompt)], []
    for token in tokens:
        start = time.perf_counter()
        step = contender.step(token)
        int(step.argmax())  # a greedy pick is part of a decode step
        seconds.append(time.perf_counter() - start)
        logits.append(step)
    return seconds, torch.stack(logits)


def _prefill(contender, ids: list[int]) -> float:
    start = time.perf_counter()
    int(contender.prefill(ids).argmax())
    return time.perf_counter() - start


def greedy_tokens(contender, prompt: list[int], steps: int) -> list[int]:
    """The `steps` tokens greedy decoding picks after `prompt`."""
    tokens = [int(contender.prefill(prompt).argmax())]
    while len(tokens) < steps:
        tokens.append(int(contender.step(tokens[-1]).argmax()))
    return tokens


def run_checkpoint_bench(
    settings: BenchSettings,
    path: str | Path,
    prefill_tokens: int = 256,
    peer: str | None = None,
    expert_parallel: bool = False,
    memory_gb: float | None = None,
) -> dict | None:
    """Load `path` and measure it (see the module docstring; the device: cpu unless `settings` name
    one); `peer`: "llama.cpp" or None. `expert_parallel` (under torchrun): rank 0 measures the model
    with its experts spread over the ranks (the peer runs on rank 0 alone) and returns the figures;
    the other ranks serve their experts until it is done and return None. `memory_gb`: moerun.load's."""
    from moerun.benchmarks.llama_cpp import LlamaCppPeer

    dtype, device, backend, log = settings.dtype, settings.device or "cpu", settings.backend, settings.log
    decode_steps, repeats = settings.decode_steps, settings.repeats

    if peer is not None:
        check_peer_run(peer, device, path)
    path = Path(path)
    log(f"loading {path} ({dtype}, {device})")
    start = time.perf_counter()
    model = load(
        path,
        dtype=COMPUTE_DTYPES[dtype],
        device=device,
        backend=backend,
        expert_parallel=expert_parallel,
        memory_gb=memory_gb,
    )
    load_s = time.perf_counter() - start
    ep = model.expert_parallel
    if ep is not None and not ep.leads:
        model.serve_experts()
        return None
    config = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (max(prefill_tokens, PROMPT_TOKENS),), generator=gen).tolist()
    capacity = max(prefill_tokens, PROMPT_TOKENS + decode_steps + 1)
    contenders = [MoerunContender(model, capacity)]
    if peer is not None:
        log(f"loading {path} in llama.cpp ({torch.get_num_threads()} threads)")
        contenders.append(LlamaCppPeer(path, n_ctx=capacity))
    load_before = os.getloadavg()[0]
    try:
        with torch.inference_mode():
            log("measuring copy bandwidth")
            copy = copy_bandwidth(device)
            m = _measure(contenders, ids, prefill_tokens, decode_steps, repeats, log)
    finally:
        for c in contenders[1:]:
            c.close()
        model.close()  # expert parallelism: the other ranks' serve_experts returns
    bytes_per_token = model_decode_bytes(model)
    file_bytes = gguf_decode_bytes(path) if path.suffix == ".gguf" else None
    r = {
        "model": str(path),
        "checkpoint": "gguf" if file_bytes is not None else "hf",
        **_model_figures(config),
        "dtype": dtype,
        "device": device,
        "backend": resolve_backend(backend, torch.device(device)),
        "threads": torch.get_num_threads(),
        # other work on the machine: llama.cpp's spinning thread barriers suffer most from it
        "load_average": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "load_s": load_s,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_steps": decode_steps,
        "prefill_tokens": prefill_tokens,
        "repeats": repeats,
        "copy_bytes_per_s": copy,
        "bytes_per_token": bytes_per_token,
        "file_bytes_per_token": file_bytes,
        **_figures("", m, "moerun", prefill_tokens),
        "peer": None,
        "peer_note": None if peer else "no --peer",
        "expert_parallel": None,
    }
    if ep is not None:  # rank 0's placement and its figures summed over every measured step
        r["expert_parallel"] = {"placement": ep.placement(config.moe.num_experts), **ep.stats.as_dict()}
    r["decode_bytes_per_s"] = bytes_per_token * r["decode_tok_s"]
    r["decode_copy_fraction"] = r["decode_bytes_per_s"] / copy
    if peer is not None:
        r.update(_peer_figures(r, m, contenders[1], file_bytes, prefill_tokens))
    return r


def _model_figures(config) -> dict:
    """What the checkpoint holds: its type, layers, experts, top-k and vocabulary."""
    return {
        "model_type": config.model_type,
        "layers": config.num_layers,
        "experts": config.moe.num_experts,
        "top_k": config.moe.top_k,
        "vocab": config.vocab_size,
    }


def check_peer_run(peer: str, device: str, path: str | Path) -> None:
    """Refuse, in one sentence, a peer other than llama.cpp, a device other than the CPU, or a file
    llama.cpp cannot run (moerun.benchmarks.llama_cpp.check_peer)."""
    from moerun.benchmarks.llama_cpp import NAME, PeerError, check_peer

    if peer != NAME:
        raise PeerError(f"--peer takes {NAME}, not {peer!r}.")
    if device != "cpu":
        raise PeerError("--peer llama.cpp compares CPU runs: leave --device out (or give cpu).")
    check_peer(path)


def _peer_figures(r: dict, m: dict, peer, file_bytes: int, prefill_tokens: int) -> dict:
    """The peer's figures beside moerun's (`r`): its rates, bytes, the ratios and how far apart the
    two's logits lie, from the measurements `m`."""
    p = _figures("peer_", m, peer.name, prefill_tokens)
    p["peer"] = peer.version
    p["peer_bytes_per_token"] = file_bytes
    p["peer_decode_bytes_per_s"] = file_bytes * p["peer_decode_tok_s"]
    p["peer_decode_copy_fraction"] = p["peer_decode_bytes_per_s"] / r["copy_bytes_per_s"]
    p["decode_vs_peer"] = r["decode_tok_s"] / p["peer_decode_tok_s"]
    p["prefill_vs_peer"] = r["prefill_tok_s"] / p["peer_prefill_tok_s"]
    return p | compare_logits(m["logits"]["moerun"], m["logits"][peer.name])


def _measure(
    contenders: list, ids: list[int], prefill_tokens: int, decode_steps: int, repeats: int, log
) -> dict:
    """Every contender's decode steps and prefills, taking turns: {"steps", "totals", "prefill",
    "logits"}, each a dict by contender name (seconds of every step, of every run's steps, of every
    prefill; the logits [1 + steps, V] of a decode run)."""
    prompt = ids[:PROMPT_TOKENS]
    log(f"greedy tokens: {decode_steps} after a {PROMPT_TOKENS}-token prompt (also the warm-up)")
    tokens = greedy_tokens(contenders[0], prompt, decode_steps)
    for c in contenders[1:]:
        greedy_tokens(c, prompt, 2)  # the peers' warm-up
    m = {key: {c.name: [] for c in contenders} for key in ("steps", "totals", "prefill")}
    m["logits"] = {}
    log(f"decode: {decode_steps} steps x{repeats}, contenders taking turns")
    for _ in range(repeats):
        for c in contenders:
            seconds, m["logits"][c.name] = _decode(c, prompt, tokens)
            m["steps"][c.name] += seconds
            m["totals"][c.name].append(sum(seconds))
    log(f"prefill: a {prefill_tokens}-token prompt x{repeats}, contenders taking turns")
    for _ in range(repeats):
        for c in contenders:
            m["prefill"][c.name].append(_prefill(c, ids[:prefill_tokens]))
    return m


def _figures(prefix: str, m: dict, name: str, prefill_tokens: int) -> dict:
    step, prefill_s = statistics.median(m["steps"][name]), statistics.median(m["prefill"][name])
    return {
        f"{prefix}decode_tok_s": 1 / step,
        f"{prefix}decode_step_s": step,
        f"{prefix}decode_total_s": statistics.median(m["totals"][name]),
        f"{prefix}prefill_tok_s": prefill_tokens / prefill_s,
        f"{prefix}prefill_s": prefill_s,
    }


def compare_logits(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    """Two [positions, V] logits of the same positions: max |ours - theirs| / max |theirs|, and the
    fraction of positions whose top-1 token agrees."""
    return {
        "compared_positions": ours.shape[0],
        "logits_max_rel_diff": ((ours - theirs).abs().max() / theirs.abs().max()).item(),
        "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }


def format_checkpoint_table(r: dict) -> str:
    gb, mib = 1e9, 2**20
    peer = r["peer"] is not None
    lines = [
        f"moerun bench --model {r['model']}  ({r['model_type']}, {r['layers']} layers, "
        f"{r['experts']} experts top-{r['top_k']})  dtype={r['dtype']}  device={r['device']}  "
        f"threads={r['threads']}",
        f"  copy bandwidth (read+write)   {r['copy_bytes_per_s'] / gb:8.1f} GB/s",
    ]

    def row(what: str, key: str, unit: str = "tok/s", scale: float = 1.0) -> str:
        text = f"  {what:<28} moerun {r[key] / scale:9.1f} {unit}"
        if peer:
            ratio = r[key] / r["peer_" + key]
            text += f"   llama.cpp {r['peer_' + key] / scale:9.1f} {unit}   (moerun/llama.cpp {ratio:.2f}x)"
        return text

    lines.append(row(f"decode ({r['decode_steps']} steps, median)", "decode_tok_s"))
    lines.append(row(f"prefill T={r['prefill_tokens']}", "prefill_tok_s"))
    lines.append(row("decode weight reads", "decode_bytes_per_s", "GB/s", gb))
    stored = r["file_bytes_per_token"]
    lines.append(
        f"  weights read per token: moerun {r['bytes_per_token'] / mib:.1f} MiB as it holds them"
        + (f", {stored / mib:.1f} MiB as the file stores them" if stored else "")
        + f"; moerun at {100 * r['decode_copy_fraction']:.0f}% of copy bandwidth"
        + (f", llama.cpp at {100 * r['peer_decode_copy_fraction']:.0f}%" if peer else "")
    )
    lines.append(
        f"  1-min load average {r['load_average'][0]:.1f} before, {r['load_average'][1]:.1f} after "
        f"({r['cpus']} CPUs, {r['threads']} threads here): other work on the machine slows llama.cpp's "
        "spinning thread barriers most"
    )
    if ep := r.get("expert_parallel"):
        lines.append(
            f"  expert parallel: {ep['placement']}; over {ep['steps']} steps rank 0 sent "
            f"{ep['sent_bytes'] / mib:.1f} MiB of layer inputs and received "
            f"{ep['received_bytes'] / mib:.1f} MiB of rows in {ep['exchange_ms']:.0f} ms, "
            f"beside {ep['expert_ms']:.0f} ms on its own experts"
        )
    if peer:
        lines.append(
            f"  logits over {r['compared_positions']} positions: max |moerun - llama.cpp| / max |llama.cpp| "
            f"{r['logits_max_rel_diff']:.1e}; same top-1 token at {100 * r['top1_agreement']:.0f}%"
        )
    else:
        lines.append(f"  no peer ({r['peer_note']}): --peer llama.cpp on a .gguf file runs llama.cpp too")
    return "\n".join(lines)
