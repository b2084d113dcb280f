"""Stop strings over streamed text: text is released as soon as it cannot be the start of a stop
string, and generation ends where the first stop string begins (the stop string itself is not
output, as in vLLM and llama.cpp).

The stop strings are one Aho-Corasick automaton, built once in time linear in their total length.
Its state is the longest suffix of the text read so far that is a prefix of some stop string, which
is exactly the text to hold back, and each new character moves it in amortised constant time. So a
push costs time linear in the new text, whatever the stop strings' lengths."""

from __future__ import annotations

import collections
from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max(map(len, self.stops), default=0)
        # the trie of the stop strings: node 0 is the root (the empty prefix)
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]  # each node's prefix length
        for stop in self.stops:
            node = 0
            for ch in stop:
                if ch not in self._next[node]:
                    self._next[node][ch] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                node = self._next[node][ch]
        ends = {self._walk(stop) for stop in self.stops}
        # fail: the node of the longest proper suffix that is in the trie; found: the length of the
        # longest stop string that ends the node's prefix (0: none)
        self._fail = [0] * len(self._next)
        self._found = [0] * len(self._next)
        queue = collections.deque(self._next[0].values())
        while queue:  # breadth first: a node's fail link is shorter, so already known
            node = queue.popleft()
            self._found[node] = self._depth[node] if node in ends else self._found[self._fail[node]]
            for ch, child in self._next[node].items():
                self._fail[child] = self._move(self._fail[node], ch)
                queue.append(child)
        self._state = 0
        self._held: collections.deque[str] = collections.deque()  # the held text, in pieces
        self._held_chars = 0  # == depth of the state

    def _walk(self, text: str) -> int:
        node = 0
        for ch in text:
            node = self._next[node][ch]
        return node

    def _move(self, node: int, ch: str) -> int:
        while node and ch not in self._next[node]:
            node = self._fail[node]
        return self._next[node].get(ch, 0)

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text -> (text safe to release now, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        state, base, found = self._state, self._held_chars, self._found
        stop_at = None  # where the earliest stop string seen begins, counted from the held text
        scan = len(text)
        i = 0
        while i < scan:
            state = self._move(state, text[i])
            if found[state]:
                begin = base + i + 1 - found[state]  # the longest stop ending here begins first
                if stop_at is None or begin < stop_at:
                    stop_at = begin
                    # a stop string that begins earlier still must end before this position
                    scan = min(scan, stop_at - base + self.longest - 1)
            i += 1
        if stop_at is not None:
            out = ("".join(self._held) + text)[:stop_at]
            self._held.clear()
            self._state, self._held_chars = 0, 0
            return out, True
        self._state = state
        self._held.append(text)
        self._held_chars += len(text)
        return self._release(base + len(text) - self._depth[state]), False

    def _release(self, count: int) -> str:
        """The first `count` characters of the held text, no longer held."""
        out = []
        self._held_chars -= count
        while count:
            piece = self._held.popleft()
            if len(piece) > count:
                piece, rest = piece[:count], piece[count:]
                self._held.appendleft(rest)
            out.append(piece)
            count -= len(piece)
        return "".join(out)

    def flush(self) -> str:
        out = "".join(self._held)
        self._held.clear()
        self._state, self._held_chars = 0, 0
        return out
