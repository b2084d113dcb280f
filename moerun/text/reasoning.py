"""A thinking model's reasoning kept apart from its answer: Qwen3, DeepSeek-R1 (and V3.1) and GLM-4.5
open a reply with `<think>...</think>` and answer after it. Where the chat template ends the prompt
with `<think>` (Qwen3's thinking-only models, DeepSeek-R1's later templates), the reply starts inside
the reasoning and only the closing tag comes (`prompt_opens_thinking`).

`ThinkSplitter` reads a reply's text piece by piece and returns the reasoning and the rest as they
become certain: it holds back text that may be the start of a tag, and whitespace at the reasoning's
end. The reasoning is stripped of the whitespace around it, the answer of what separates it from the
tag, as llama.cpp's server returns them. Only a `<think>` that opens the reply (after whitespace)
starts reasoning; one later on is the answer's text.
"""

from __future__ import annotations

from collections.abc import Iterable

START, END = "<think>", "</think>"


def held_tail(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the prompt ends inside a `<think>` block, so the reply begins with reasoning."""
    return prompt.rstrip().endswith(START)


class ThinkSplitter:
    """Text of one reply in, (reasoning, the rest) out, piece by piece; `finish()` at the end."""

    def __init__(self, opened: bool = False):
        self.state = "reasoning" if opened else "start"  # start, reasoning, after (the tag), answer
        self.buffer = ""
        self.began = False  # reasoning text emitted (leading whitespace is dropped until then)

    def push(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, answer = "", ""
        if self.state == "start":
            opening = self.buffer.lstrip()
            if opening.startswith(START):
                self.state, self.buffer = "reasoning", opening[len(START) :]
            elif START.startswith(opening) and not final:
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = self.buffer.find(END)
            if end >= 0:
                reasoning = self._reasoning(self.buffer[:end].rstrip())
                self.state, self.buffer = "after", self.buffer[end + len(END) :]
            else:
                keep = len(self.buffer) if final else len(self.buffer) - held_tail(self.buffer, [END])
                piece = self.buffer[:keep].rstrip()
                reasoning = self._reasoning(piece)
                self.buffer = "" if final else self.buffer[len(piece) :]
        if self.state == "after":
            self.buffer = self.buffer.lstrip()
            if self.buffer:
                self.state = "answer"
        if self.state == "answer":
            answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def _reasoning(self, piece: str) -> str:
        if not self.began:
            piece = piece.lstrip()
            self.began = bool(piece)
        return piece
