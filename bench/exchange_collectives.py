"""The expert-parallel messages of one MoE layer alone, on gloo, through moerun's own ExpertParallel:
median milliseconds of rank 0 sending the layer's inputs [T, H + 2k] fp32 to every rank (a
broadcast), and of the step's rows [T*k, H] fp32 coming back to rank 0 by each collective
(all_to_all_single with uneven splits, or a reduce of the whole buffer), at decode and prefill
sizes, the rows spread evenly over the ranks. Run:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/exchange_collectives.py
"""

import statistics
import time

import torch
import torch.distributed as dist

from moerun.distributed import ExpertParallel
from moerun.distributed.expert_parallel import COLLECTIVES

HIDDEN, TOP_K, REPEATS = 2048, 8, 30


def _median_ms(fn) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[5:])


def main() -> None:
    torch.set_num_threads(1)
    ep = ExpertParallel.from_env()
    world = ep.world
    for tokens in (1, 4, 8, 32, 128, 512):
        n = tokens * TOP_K
        counts = [n // world + (1 if r < n % world else 0) for r in range(world)]
        starts = [sum(counts[:r]) for r in range(world)]
        spans = [(a, a + c) for a, c in zip(starts, counts, strict=True)]
        x, ids, weights = torch.randn(tokens, HIDDEN), torch.zeros(tokens, TOP_K), torch.rand(tokens, TOP_K)
        if ep.leads:
            inputs_ms = _median_ms(lambda x=x, ids=ids, w=weights: ep.share_inputs(x, ids, w, "bench"))
        else:
            inputs_ms = _median_ms(
                lambda t=tokens: ep.receive_inputs(t, HIDDEN, TOP_K, torch.float32, "bench")
            )
        rows_ms = {}
        for collective in COLLECTIVES:
            ep.collective = collective
            rows = torch.randn(n, HIDDEN)
            rows_ms[collective] = _median_ms(lambda rows=rows, spans=spans: ep.exchange(rows, spans, "bench"))
        if ep.leads:
            kib = tokens * (HIDDEN + 2 * TOP_K) * 4 / 2**10
            print(
                f"T={tokens:4d}  inputs {kib:8.1f} KiB {inputs_ms:7.3f} ms   "
                f"rows {n * HIDDEN * 4 / 2**20:6.2f} MiB: "
                + "   ".join(f"{c} {ms:7.3f} ms" for c, ms in rows_ms.items())
            )
    ep.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
