"""Which ranks are still answering: each rank's beat counter in the group's key-value store.

A collective that fails (a peer's connection closed, or the group's timeout passed) does not say
which peer stopped. So every rank runs a daemon thread that advances its counter in the store the
group was set up with (torchrun's TCP store, or the file of a file:// rendezvous) every `BEAT_S`
seconds. A rank blocked in a collective, or computing, still beats (both release the GIL); a rank
that died, or that is stopped (SIGSTOP, a debugger), does not. When a collective fails the survivor
reads every counter, waits `LISTEN_S`, reads them again, and names the ranks whose counter did not
move (`Heartbeat.silent`).
"""

from __future__ import annotations

import threading
import time

BEAT_S = 1.0
LISTEN_S = 2.5 * BEAT_S  # a live rank beats at least twice in this window


def _key(rank: int) -> str:
    return f"moerun/expert_parallel/beat/{rank}"


class Heartbeat:
    """This rank's beat, and a look at the other `members`' (global ranks: the group's). `store`: a
    torch.distributed Store shared by the group (None: no store to share, and `silent` cannot tell)."""

    def __init__(self, store, rank: int, members: list[int]):
        self.store, self.rank, self.members = store, rank, members
        self._stop = threading.Event()
        self._thread = None
        if store is None:
            return
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name=f"moerun-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self, count: int) -> None:
        self.store.set(_key(self.rank), str(count))

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(BEAT_S):
            count += 1
            try:
                self._beat(count)
            except Exception:  # the store went away (its host ended): nothing left to tell
                return

    def _counters(self) -> dict[int, bytes]:
        others = [r for r in self.members if r != self.rank]
        # a rank that never beat has no key (get would wait for it): b"" for it
        return {r: self.store.get(_key(r)) if self.store.check([_key(r)]) else b"" for r in others}

    def silent(self) -> list[int] | None:
        """The other members whose beat did not move in LISTEN_S seconds (dead or stopped; global
        ranks); None when the store cannot be read (no store, or its host is one of the dead)."""
        if self.store is None:
            return None
        try:
            before = self._counters()
            time.sleep(LISTEN_S)
            after = self._counters()
        except Exception:
            return None
        return [r for r in before if before[r] == after[r]]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)
