"""A chat reply read into its parts: the reasoning, the answer and the tool calls, whole or piece by
piece as it streams, in the format the model was trained to write (`ReplyFormat`), chosen from its
chat template, its vocabulary and its family, never from a flag:

- gpt-oss (harmony's markers in the vocabulary, and in the template or the family): channels and
  recipients (`moerun.text.harmony`);
- a template that speaks of `</think>` (Qwen3, DeepSeek-R1/V3.1, GLM-4.5): reasoning in `<think>`
  (`moerun.text.reasoning`);
- the tool-call syntax the template writes (`moerun.text.tool_calls`), else the one the vocabulary
  has markers for, else the family's.

`ReplyParser` takes the tokens a generation releases (each with `.id` and `.text`; special tokens
carry no text, so the markers among them are written back in) and gives `ReplyDelta`s; the deltas of
a reply fed in any pieces join to the same reply, which is what lets a stream equal the whole
response. A tool call comes out once it is complete, so a call that turns out not to parse is text
of the answer, streamed or not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from moerun.text.harmony import MARKERS as HARMONY_MARKERS
from moerun.text.harmony import REQUIRED as HARMONY_REQUIRED
from moerun.text.harmony import HarmonyParser
from moerun.text.reasoning import END, START, ThinkSplitter, held_tail, prompt_opens_thinking
from moerun.text.tool_calls import (
    SYNTAXES,
    DeepSeekCalls,
    TaggedCalls,
    ToolCall,
    ToolRequest,
    ToolSyntax,
    new_call_id,
)

# a family's tool-call syntax when neither its template nor its vocabulary names one
FAMILY_SYNTAX = {
    "mixtral": "mistral",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "qwen2_moe": "tagged",
    "qwen3_moe": "tagged",
    "glm4_moe": "tagged",
}
# the marker whose presence in a template or vocabulary names the syntax, most specific first
SYNTAX_MARKERS = (
    ("mistral", "[TOOL_CALLS]"),
    ("deepseek", DeepSeekCalls.begin),
    ("tagged", TaggedCalls.opens[0]),
)


@dataclass
class ReplyDelta:
    """What a piece of a reply adds: reasoning text, answer text, and the tool calls completed."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def add(self, other: ReplyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


@dataclass(frozen=True)
class ReplyFormat:
    """How one model writes a reply: harmony, or `<think>` reasoning and/or a tool-call syntax.
    `markers`: the special tokens (id -> text) the parser must see, which decoding leaves out."""

    harmony: bool = False
    thinking: bool = False
    tools: ToolSyntax | None = None
    markers: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer, model_type: str | None = None) -> ReplyFormat:
        """The format of a model with this tokenizer (None: plain text) and HF model_type."""
        if tokenizer is None:
            return cls()
        template = tokenizer.chat_template or ""
        harmony = all(tokenizer.token_to_id(m) is not None for m in HARMONY_REQUIRED) and (
            "<|channel|>" in template or model_type == "gpt_oss"
        )
        thinking = not harmony and (END in template or START in template)
        syntax = None
        if not harmony:
            named = [s for s, marker in SYNTAX_MARKERS if marker in template]
            named = named or [s for s, marker in SYNTAX_MARKERS if tokenizer.token_to_id(marker) is not None]
            name = named[0] if named else FAMILY_SYNTAX.get(model_type or "")
            syntax = SYNTAXES.get(name) if name else None
        texts = set(HARMONY_MARKERS) if harmony else set()
        if thinking:
            texts |= {START, END}
        if syntax is not None:
            texts |= set(syntax.markers)
        markers = {}
        for text in texts:
            token_id = tokenizer.token_to_id(text)
            if token_id is not None and tokenizer.is_special(token_id):
                markers[token_id] = text
        return cls(harmony, thinking, syntax, markers)

    def calls_tools(self) -> bool:
        """Whether moerun can read this model's tool calls."""
        return self.harmony or self.tools is not None

    def parser(self, prompt: str = "", tools: ToolRequest | None = None) -> ReplyParser:
        """A parser for one reply to `prompt` (the rendered prompt text: it may open the reasoning)."""
        return ReplyParser(self, prompt, tools)


class ReplyParser:
    """One reply's tokens (or text) in, `ReplyDelta`s out; `finish()` once the reply has ended."""

    def __init__(self, fmt: ReplyFormat, prompt: str = "", tools: ToolRequest | None = None):
        self.format = fmt
        self.tools = tools if tools is not None and tools.parsed else None
        self.harmony = HarmonyParser(self.tools) if fmt.harmony else None
        self.think = ThinkSplitter(prompt_opens_thinking(prompt)) if fmt.thinking else None
        syntax = fmt.tools if self.tools is not None else None
        self.calls = CallExtractor(syntax, self.tools) if syntax is not None else None
        self.id_style = syntax.id_style if syntax is not None else "openai"
        self.count = 0  # calls given out

    def push_tokens(self, tokens: Iterable) -> ReplyDelta:
        """Released tokens (`.id`, `.text`): their text, with the special markers written back after
        the text a token carries (a token released with held-back text carries that text)."""
        pieces = []
        for token in tokens:
            pieces.append(token.text)
            if token.id in self.format.markers:
                pieces.append(self.format.markers[token.id])
        return self.push("".join(pieces))

    def push(self, text: str) -> ReplyDelta:
        return self._run(text, final=False)

    def finish(self) -> ReplyDelta:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> ReplyDelta:
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.finish() if final else self.harmony.push(text)
            return ReplyDelta(reasoning, content, self._calls(calls))
        reasoning, content = "", text
        if self.think is not None:
            reasoning, content = self.think.finish() if final else self.think.push(text)
        calls = []
        if self.calls is not None:
            content, calls = self.calls.push(content, final)
        return ReplyDelta(reasoning, content, self._calls(calls))

    def _calls(self, calls: list[tuple[str, str]]) -> list[ToolCall]:
        out = []
        for name, arguments in calls:
            if self.count and not self.tools.parallel:
                break  # parallel_tool_calls: false keeps the first
            out.append(ToolCall(new_call_id(self.id_style), name, arguments))
            self.count += 1
        return out


class CallExtractor:
    """The answer's text in, (text, [(name, arguments)]) out: call regions taken out where a syntax's
    marker opens one, text between them passed on. The whitespace that separates a call from the text
    around it is dropped (held back until it is known not to precede a call)."""

    def __init__(self, syntax: ToolSyntax, tools: ToolRequest):
        self.syntax, self.parameters = syntax, tools.parameters
        self.buffer = ""
        self.held = ""  # whitespace at the end of the text given out, held until text follows it
        self.after_call = False  # the whitespace that follows a call is dropped

    def push(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        out, calls = [], []
        while True:
            starts = [(i, m) for m in self.syntax.opens if (i := self.buffer.find(m)) >= 0]
            if not starts:
                keep = len(self.buffer) - (0 if final else held_tail(self.buffer, self.syntax.opens))
                out.append(self._text(self.buffer[:keep], final))
                self.buffer = self.buffer[keep:]
                break
            start = min(starts)[0]
            out.append(self._text(self.buffer[:start], False))
            region = self.syntax.region(self.buffer[start:], final, self.parameters)
            self.buffer = self.buffer[start:]
            if region is None:
                break
            size, found = region
            if found is None:  # not a call after all: its text is the answer's
                out.append(self._text(self.buffer[:size], final and size == len(self.buffer)))
            else:
                calls += found
                self.held, self.after_call = "", True
            self.buffer = self.buffer[size:]
        return "".join(out), calls

    def _text(self, text: str, final: bool) -> str:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text, self.held = self.held + text, ""
        if final:
            return text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body
