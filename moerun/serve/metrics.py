"""`/metrics`: the server's counters in Prometheus' text format."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moerun.serve.app import ServerState


def metrics_text(state: ServerState) -> str:
    lines = []

    def metric(name: str, kind: str, help: str, value) -> None:
        lines.extend(
            [f"# HELP moerun_{name} {help}", f"# TYPE moerun_{name} {kind}", f"moerun_{name} {value}"]
        )

    s = state.scheduler
    metric("ready", "gauge", "1 once the model is loaded.", int(s is not None))
    if s is not None:
        c = s.counters
        metric("requests_total", "counter", "Completion requests received.", c.requests)
        metric("requests_finished_total", "counter", "Requests answered in full.", c.finished)
        metric("requests_cancelled_total", "counter", "Requests whose client went away.", c.cancelled)
        metric("requests_failed_total", "counter", "Requests the model failed on.", c.failed)
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", c.prompt_tokens)
        metric(
            "prompt_tokens_reused_total",
            "counter",
            "Prompt tokens copied from a kept prefix.",
            c.reused_tokens,
        )
        metric("generation_tokens_total", "counter", "Tokens generated.", c.generated_tokens)
        metric("steps_total", "counter", "Forward passes over the running batch.", c.steps)
        metric("step_seconds_total", "counter", "Seconds spent in those passes.", round(c.step_s, 6))
        metric(
            "grammar_seconds_total",
            "counter",
            "Of those, seconds spent on structured output's token masks.",
            round(c.grammar_s, 6),
        )
        metric("queue_length", "gauge", "Requests waiting for a slot.", s.waiting)
        metric("batch_size", "gauge", "Requests running.", s.running)
        metric(
            "tokens_per_second",
            "gauge",
            "Tokens generated per second over the last steps.",
            round(c.rate(), 3),
        )
        cache = getattr(state.model, "expert_cache", None)
        if cache is not None:
            total = cache.summary()["total"]
            metric("expert_cache_hits_total", "counter", "Expert cache hits.", total["hits"])
            metric("expert_cache_misses_total", "counter", "Expert cache misses.", total["misses"])
    return "\n".join(lines) + "\n"
