"""Stop strings over streamed text: text is released as soon as it cannot be the start of a stop
string, and generation ends where the first stop string begins (the stop string itself is not
output, as in vLLM and llama.cpp)."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text not yet released: it may be the start of a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text -> (text safe to release now, whether a stop string was reached)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
