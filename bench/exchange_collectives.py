"""The expert-parallel exchange's two collectives alone, on gloo: median milliseconds of an
all_reduce of a step's whole [T*k, H] fp32 rows against one all_to_all_single sending each rank's
span (uneven splits), at decode and prefill sizes. Run:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/exchange_collectives.py
"""

import statistics
import time

import torch
import torch.distributed as dist

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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in (1, 4, 8, 32, 128, 512):
        n = tokens * TOP_K
        counts = [n // world + (1 if r < n % world else 0) for r in range(world)]
        first = sum(counts[:rank])
        rows = torch.randn(n, HIDDEN)
        mine = rows[first : first + counts[rank]]
        splits = [counts[rank]] * world
        reduce_ms = _median_ms(lambda rows=rows: dist.all_reduce(rows))
        a2a_ms = _median_ms(
            lambda rows=rows, mine=mine, counts=counts, splits=splits: dist.all_to_all_single(
                rows, mine.repeat(world, 1), counts, splits
            )
        )
        if rank == 0:
            print(
                f"T={tokens:4d}  {n * HIDDEN * 4 / 2**20:6.2f} MiB of rows   "
                f"all_reduce {reduce_ms:7.3f} ms   all_to_all {a2a_ms:7.3f} ms"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
