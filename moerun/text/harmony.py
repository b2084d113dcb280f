"""gpt-oss's chat format (OpenAI's "harmony"): an assistant reply is a run of messages, each a header
and a body, `<|channel|>NAME<|message|>TEXT<|end|>`, the last ended by `<|return|>` (an answer) or
`<|call|>` (a tool call). The `analysis` and `commentary` channels hold the model's reasoning, `final`
the answer. A message addressed to a function names it in its header, before the channel or after it:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>` or
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`; its body is the
call's JSON arguments.

`HarmonyParser` reads one reply's text with the markers written in (they are special tokens, which
moerun's text stream leaves out: `moerun.text.reply` puts them back), piece by piece. The prompt ends
with `<|start|>assistant`, so a reply may open with the rest of a header (` to=functions.NAME`); a
reply that opens with other text is an answer.
"""

from __future__ import annotations

import re

from moerun.text.reasoning import held_tail
from moerun.text.tool_calls import ToolRequest, arguments_text

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
REQUIRED = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")  # a tokenizer that has these speaks harmony
ENDS = ("<|end|>", "<|call|>", "<|return|>")
REASONING_CHANNELS = ("analysis", "commentary")
FUNCTIONS = "functions."
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))


class HarmonyParser:
    """Text of one reply in, (reasoning, answer, [(function name, arguments' JSON)]) out, piece by
    piece; `finish()` at the end. Calls are read only when `tools` asks for them; a call whose body is
    not a JSON object is answer text."""

    def __init__(self, tools: ToolRequest | None = None):
        self.tools = tools if tools is not None and tools.parsed else None
        self.state = "opening"  # opening, header, body, call, between (after a message's end)
        self.channel = "final"
        self.header = ""
        self.call: tuple[str, str] | None = None  # (function name, body so far)
        self.buffer = ""

    def push(self, text: str) -> tuple[str, str, list[tuple[str, str]]]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str, list[tuple[str, str]]]:
        return self._run(final=True)

    def _run(self, final: bool):
        out = {"reasoning": [], "answer": [], "calls": []}
        while True:
            match = _MARKER.search(self.buffer)
            if match is None:
                keep = len(self.buffer) if final else len(self.buffer) - held_tail(self.buffer, MARKERS)
                self._text(self.buffer[:keep], final, out)
                self.buffer = self.buffer[keep:]
                break
            self._text(self.buffer[: match.start()], True, out)
            self.buffer = self.buffer[match.end() :]
            self._marker(match.group(), out)
        if final:
            self._end_message(out)
        return "".join(out["reasoning"]), "".join(out["answer"]), out["calls"]

    def _text(self, text: str, settled: bool, out: dict) -> None:
        """Text between markers (`settled`: no more of it can follow before a marker)."""
        if self.state == "opening":  # the rest of the prompt's `<|start|>assistant` header, or an answer
            self.header += text
            opening = self.header.lstrip()
            if opening.startswith("to=") or ("to=".startswith(opening) and not settled):
                return
            self.state, self.channel = "body", "final"
            text, self.header = self.header, ""
        if self.state == "header":
            self.header += text
        elif self.state == "body" and text:
            out["reasoning" if self.channel in REASONING_CHANNELS else "answer"].append(text)
        elif self.state == "call":
            self.call = (self.call[0], self.call[1] + text)

    def _marker(self, marker: str, out: dict) -> None:
        if marker == "<|start|>":
            self._end_message(out)
            self.state, self.header = "header", ""
        elif marker == "<|message|>":
            if self.state in ("header", "opening"):
                self._open_body()
        elif marker in ENDS:
            self._end_message(out)
            self.state = "between"
        elif self.state in ("opening", "header", "between", "body"):  # <|channel|>, <|constrain|>
            if self.state in ("between", "body"):
                self.header = ""
            self.state = "header"
            self.header += marker

    def _open_body(self) -> None:
        channel = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", self.header)
        recipient = re.search(r"to=([^\s<]+)", self.header)
        self.channel = channel.group(1) if channel else "final"
        self.header = ""
        name = recipient.group(1) if recipient else ""
        if self.tools is not None and name.startswith(FUNCTIONS):
            self.state, self.call = "call", (name[len(FUNCTIONS) :], "")
        else:
            self.state = "body"

    def _end_message(self, out: dict) -> None:
        if self.state == "call":
            name, body = self.call
            arguments = arguments_text(body)
            if arguments is not None and name:
                out["calls"].append((name, arguments))
            else:
                out["answer"].append(body)
            self.call = None
        elif self.state == "opening" and self.header:
            out["answer"].append(self.header)
            self.header = ""
        self.state = "between"
