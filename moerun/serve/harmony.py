"""gpt-oss's chat format (OpenAI's "harmony"): an assistant reply is a run of messages, each
`<|channel|>NAME<|message|>TEXT<|end|>` (the last ended by `<|return|>`), where the `analysis` and
`commentary` channels hold the model's reasoning and `final` the answer. The server returns the
reasoning apart, as `reasoning_content` (llama.cpp's server and vLLM do the same), and the final
channel as `content`.

`ChannelSplitter` reads the released tokens of one reply by id: special tokens switch the state and
carry no text of their own (moerun's text stream gives special tokens none), and any text a token
carries is counted in the state before it switches (a token held back with its neighbours carries
their text)."""

from __future__ import annotations

from collections.abc import Iterable

from moerun.batching import Token

MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
REASONING_CHANNELS = ("analysis", "commentary")


def harmony_markers(tokenizer) -> dict[int, str] | None:
    """{token id: marker} when the tokenizer speaks harmony (it has every marker token), else None."""
    if tokenizer is None:
        return None
    ids = {tokenizer.token_to_id(m): m for m in MARKERS}
    return None if None in ids else ids


class ChannelSplitter:
    """One reply's tokens in, (reasoning text, answer text) out, piece by piece."""

    def __init__(self, markers: dict[int, str]):
        self.markers = markers
        self.state = "body"  # header: a channel's name; body: its text; between: a role name
        self.channel = "final"  # a reply that opens with plain text is an answer
        self.header = ""

    def push(self, tokens: Iterable[Token]) -> tuple[str, str]:
        reasoning, content = [], []
        for token in tokens:
            if token.text:
                if self.state == "header":
                    self.header += token.text
                elif self.state == "body":
                    (reasoning if self._reasoning() else content).append(token.text)
            marker = self.markers.get(token.id)
            if marker == "<|channel|>":
                self.state, self.header = "header", ""
            elif marker == "<|message|>":
                if self.state == "header":
                    self.channel = self.header.strip().split(" ")[0] or "final"
                self.state = "body"
            elif marker in ("<|end|>", "<|start|>"):
                self.state = "between"
        return "".join(reasoning), "".join(content)

    def _reasoning(self) -> bool:
        return self.channel in REASONING_CHANNELS
