"""The prefetch throttle: judged on hand-made counters, and in a model whose predictions are useless
against one whose predictions are exact."""

from moerun.offload.stats import OffloadStats
from moerun.offload.throttle import PrefetchThrottle


def _run(throttle: PrefetchThrottle, steps: int, issued_per_step: int, used_per_step: int) -> list[bool]:
    stats, allowed = OffloadStats(), []
    for _ in range(steps):
        allowed.append(throttle.allow(stats))
        if allowed[-1]:
            stats.prefetch_issued += issued_per_step
            stats.prefetch_used += used_per_step
    return allowed


def test_useless_predictions_pause_prefetch_then_it_is_tried_again():
    allowed = _run(PrefetchThrottle(round_size=32, min_useful=0.25, pause_steps=10), 30, 8, 1)
    # 4 steps issue 32 with 4 used (12.5%): judged at step 5, paused for steps 5-14, tried at 15
    assert allowed[:4] == [True] * 4
    assert allowed[4:14] == [False] * 10
    assert allowed[14:18] == [True] * 4 and allowed[18] is False


def test_useful_predictions_never_pause():
    assert all(_run(PrefetchThrottle(round_size=32, min_useful=0.25, pause_steps=10), 50, 8, 2))
