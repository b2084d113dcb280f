"""`moerun bench --serve`: the HTTP server under concurrent streams, on the generated OLMoE-shaped
model (moerun.benchmarks.model's weights; prompts as token ids). For each number of concurrent clients C,
C threads of a client process (apart from the server's, as real clients are) each stream
`requests_per_client` completions (`stream: true`, greedy, `new_tokens` each) from a server with
`--parallel` = max(C); measured: aggregate tok/s (every client's tokens over the phase's wall time),
time to first token (median and worst), the scaling over C = 1, and the scheduler's own rate (tokens
over its seconds in model steps) with the share of the wall time it stepped. The peer is moerun's
own single stream in the same run.

With a `response_format` (`moerun bench --serve --json-schema FILE`) each number of clients runs
twice, free and then every request under that format, and the constrained rows give the grammar's
share of the step time (moerun.batching.Batch.grammar_s: starting the masks, waiting for them after
the forward pass, applying them, advancing the matchers). The generated model then gets a made-up
byte-level vocabulary of its width (moerun.benchmarks.vocabulary), as the grammar engine's cost
depends on the vocabulary."""

from __future__ import annotations

import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import Sequence

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.model import generated_run, logged_pair


def _stream_one(
    http, url: str, prompt: list[int], new_tokens: int, response_format: dict | None = None
) -> tuple[float, float, int]:
    """One streamed completion -> (seconds to the first token, seconds in all, tokens)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if response_format is not None:
        body["response_format"] = response_format
    start = time.perf_counter()
    first, tokens = None, 0
    with http.stream("POST", url + "/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {response.read()[:200]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start, tokens


def _clients(
    url: str, prompts, c: int, requests_per_client: int, new_tokens: int, response_format, queue
) -> None:
    """(In a child process.) `c` threads, each streaming `requests_per_client` completions; puts
    (wall seconds, [(ttft, seconds, tokens)], [errors]) on `queue`."""
    import httpx

    results: list[tuple[float, float, int]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            with httpx.Client(timeout=600) as http:
                for r in range(requests_per_client):
                    prompt = prompts[(i * requests_per_client + r) % len(prompts)]
                    out = _stream_one(http, url, prompt, new_tokens, response_format)
                    with lock:
                        results.append(out)
        except Exception as e:  # reported, not raised in a thread
            with lock:
                errors.append(str(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put((time.perf_counter() - start, results, errors))


def run_serve_bench(
    settings: BenchSettings,
    layers: int = 2,
    clients: Sequence[int] = (1, 4, 8),
    prompt_tokens: int = 32,
    requests_per_client: int = 2,
    shape: dict | None = None,
    response_format: dict | None = None,
) -> dict:
    """Each number of clients: `requests_per_client` streamed requests of `settings.decode_steps`
    new tokens each; with `response_format`, then the same under it."""
    import httpx

    from moerun.serve.server import start

    dtype, new_tokens, log = settings.dtype, settings.decode_steps, settings.log
    peer, model, device, backend = logged_pair(layers, settings, shape)
    vocab = peer.config.vocab_size
    del peer
    formats = [None]
    if response_format is not None:
        from moerun.benchmarks.vocabulary import synthetic_tokenizer
        from moerun.text import grammar

        grammar.engine()  # installed, or its sentence before anything runs
        log(f"a made-up byte-level vocabulary of {vocab} ids for the grammar engine")
        model.tokenizer = synthetic_tokenizer(vocab)
        formats.append(response_format)
    model.warm_up()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(64)]
    server = start(model, model_name="bench", parallel=max(clients), queue_size=max(64, max(clients)))
    rows = []
    try:
        with httpx.Client(timeout=600) as http:
            _stream_one(http, server.url, prompts[0][:4], 2)  # warm-up through the whole stack
        context = multiprocessing.get_context("spawn")
        if response_format is not None:  # the engine's view of the vocabulary and a first compile
            with httpx.Client(timeout=600) as http:
                _stream_one(http, server.url, prompts[0][:4], 2, response_format)
        for c, fmt in [(c, fmt) for c in clients for fmt in formats]:
            under = " under the response format" if fmt is not None else ""
            asked = f"{requests_per_client} streamed requests of {new_tokens} tokens{under}"
            log(f"{c} concurrent clients x {asked}")
            # the clients run in another process, as real ones do: not in the server's interpreter
            queue = context.Queue()
            child = context.Process(
                target=_clients, args=(server.url, prompts, c, requests_per_client, new_tokens, fmt, queue)
            )
            counters = server.state.scheduler.counters
            before = (counters.generated_tokens, counters.step_s, counters.grammar_s)
            child.start()
            wall, results, errors = queue.get(timeout=1800)
            child.join()
            stepped = counters.generated_tokens - before[0], counters.step_s - before[1]
            if errors:
                raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
            ttft = [r[0] for r in results]
            rows.append(
                {
                    "clients": c,
                    "constrained": fmt is not None,
                    # of the seconds in model steps, the grammars' (masks waited for and applied,
                    # matchers advanced)
                    "grammar_share": (counters.grammar_s - before[2]) / stepped[1] if stepped[1] else 0.0,
                    "requests": len(results),
                    "tokens": sum(r[2] for r in results),
                    "tok_s": sum(r[2] for r in results) / wall,
                    "per_stream_tok_s": statistics.median(r[2] / r[1] for r in results),
                    "ttft_median_s": statistics.median(ttft),
                    "ttft_max_s": max(ttft),
                    # the scheduler's own figures: tokens over the seconds in model steps (prefill
                    # included), and the share of the wall time the model stepped (the rest: HTTP,
                    # clients, waiting for requests)
                    "step_tok_s": stepped[0] / stepped[1] if stepped[1] else 0.0,
                    "busy": stepped[1] / wall,
                }
            )
    finally:
        server.close()
    for row in rows:
        row["scaling"] = row["tok_s"] / rows[0]["tok_s"]
    head = generated_run(layers, dtype, device, backend, prompt_tokens, new_tokens)
    return {**head, "response_format": response_format, "rows": rows}


def format_serve_table(r: dict) -> str:
    lines = [
        f"moerun bench --serve  {r['model']}  dtype={r['dtype']}  device={r['device']}  "
        f"backend={r['backend']}  threads={r['threads']}  ({r['prompt_tokens']}-token prompts, "
        f"{r['new_tokens']} new tokens, streamed)",
        "  clients  format  requests  aggregate tok/s  per stream tok/s  TTFT median  TTFT max  scaling"
        "  step tok/s  busy  grammar",
    ]
    for row in r["rows"]:
        grammar = f"{row['grammar_share']:7.1%}" if row.get("constrained") else "      -"
        constraint = "schema" if row.get("constrained") else "free"
        lines.append(
            f"  {row['clients']:7}  {constraint:>6}  {row['requests']:8}  "
            f"{row['tok_s']:15.1f}  {row['per_stream_tok_s']:16.1f}  "
            f"{row['ttft_median_s'] * 1e3:9.0f} ms  {row['ttft_max_s'] * 1e3:6.0f} ms  {row['scaling']:6.2f}x"
            f"  {row['step_tok_s']:10.1f}  {row['busy']:4.0%}  {grammar}"
        )
    return "\n".join(lines)
