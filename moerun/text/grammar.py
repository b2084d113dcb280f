"""Structured output: what a generation's text must match (a JSON schema, any JSON object, a Lark or
GBNF grammar), enforced as a token mask by llguidance, the grammar engine llama.cpp uses.

`Grammar` says what the text must match; `Grammar.compile(tokenizer, vocab_size, eos_ids)` checks it
against one vocabulary (every schema keyword the engine does not enforce is refused, named) and gives
a `CompiledGrammar`, from which each sequence takes its own `Matcher`. At each step the batch asks
every constrained sequence's matcher for its mask in one call (`fill_masks`, the engine's threads
computing them side by side; `start_masks` runs it on a thread while the step's forward pass runs)
and adds -inf to the logits of every token the grammar forbids (`mask_bias`, `apply_masks`) before
the sampler sees them. End-of-sequence ids are allowed only where the text
so far is complete. llguidance is an optional dependency (`pip install 'moerun[structured]'`);
without it a constrained request is refused with that sentence.

Why llguidance rather than xgrammar: it names every JSON-schema keyword it cannot enforce, where
xgrammar 0.2.9 accepts `not`, `if`/`then`, `uniqueItems`, `contains` and unknown formats and ignores
them (output that does not validate); it has no dependencies (xgrammar requires transformers, triton
and pydantic); a new schema compiles in about 1 ms rather than 36-151 ms. Its masks cost more per
token (see docs/PERFORMANCE.md, `python bench/grammar_engines.py`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moerun.text.chat_tools import ArgumentPairs, CallForm
    from moerun.text.tokenizer import Tokenizer

INSTALL = "pip install 'moerun[structured]' (the llguidance grammar engine)"
# JSON as the model writes it under a schema: one space after ',' and ':' (as json.dumps writes it),
# no other whitespace, so a model cannot run on in blank lines; unimplemented keywords refused.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OVERRIDES = {"lenient": False}
MAX_GRAMMAR_BYTES = 1 << 20


class GrammarError(ValueError):
    """A response format or grammar that cannot be enforced: malformed, using a feature the engine
    does not enforce (named), or the engine not installed."""


def engine():
    """The llguidance module, or GrammarError saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError(f"Structured output needs the grammar engine: {INSTALL}.") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a generation's text must match: `definition` in llguidance's grammar format, `source`
    naming it in messages ("the JSON schema 'person'", "the grammar in g.gbnf")."""

    definition: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict | bool, name: str | None = None) -> Grammar:
        """Text that parses as JSON and validates against `schema` (a JSON Schema object)."""
        source = f"the JSON schema {name!r}" if name else "the JSON schema"
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"{source} must be a JSON object, not {type(schema).__name__}.")
        text = _bounded_json(schema, source)
        try:
            definition = engine().LLMatcher.grammar_from_json_schema(text, JSON_OPTIONS, JSON_OVERRIDES)
        except ValueError as e:
            raise GrammarError(f"{source} is not valid: {_short(e)}") from None
        return cls(definition, source)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        grammar = cls.json_schema({"type": "object"})
        return cls(grammar.definition, "a JSON object")

    @classmethod
    def text(cls, text: str, source: str = "the grammar") -> Grammar:
        """A grammar in llguidance's Lark syntax or in llama.cpp's GBNF (told apart by their syntax:
        GBNF's rules are `name ::= ...`, Lark's `name: ...`); both start at the rule `root` (GBNF)
        or `start` (Lark)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"{source} is empty.")
        if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{source} is longer than {MAX_GRAMMAR_BYTES} bytes.")
        llg = engine()
        try:
            from llguidance.gbnf_to_lark import any_to_lark

            lark = any_to_lark(text)
        except Exception as e:  # the converter raises its own error types
            raise GrammarError(f"{source} is neither Lark nor GBNF: {_short(e)}") from None
        return cls(llg.LLMatcher.grammar_from_lark(lark), source)

    def compile(self, tokenizer: Tokenizer, vocab_size: int, eos_ids) -> CompiledGrammar:
        """This grammar over one vocabulary (`vocab_size`: the logits' width; `eos_ids`: the ids that
        end a generation, allowed only where the text is complete); GrammarError naming what the
        engine refuses (an unimplemented schema keyword, a bad rule)."""
        llg = engine()
        vocab = _engine_tokenizer(tokenizer, vocab_size, tuple(sorted(eos_ids)))
        matcher = llg.LLMatcher(vocab, self.definition, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{self.source} cannot be enforced: {_short(matcher.get_error())}")
        return CompiledGrammar(self, matcher, vocab.vocab_size)


def lark_json(schema: dict) -> str:
    """A Lark rule body matching JSON valid under `schema`, written as Grammar.json_schema writes
    JSON (for a grammar that wraps JSON in other text, e.g. a tool call's markers):
    `Grammar.text('start: "<tool_call>" call "</tool_call>"\\ncall: ' + lark_json(schema))`."""
    if not isinstance(schema, dict):
        raise GrammarError(f"A JSON schema must be a JSON object, not {type(schema).__name__}.")
    own = schema.get("x-guidance")  # llguidance's options inside a schema
    options = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {}), **JSON_OVERRIDES}
    return "%json " + _bounded_json({**schema, "x-guidance": options}, "the JSON schema")


def tool_call_grammar(calls: list[CallForm], tokenizer: Tokenizer, opening: str = "") -> Grammar:
    """A reply that is one call of one of `calls` (each as a chat template writes it:
    `moerun.text.chat_tools.tool_call_tags`), after `opening` (e.g. "</think>" where the prompt left
    the reasoning open). The tokenizer's added tokens inside that text (`<tool_call>`,
    `[TOOL_CALLS]`, ...) are matched as those tokens, as the tokenizer splits them out: the engine
    reads every added token, special or not, as a token of its own that no spelling matches.
    GrammarError where a function's arguments cannot be held to their schema in the template's form
    (a string argument with a `format`, written bare)."""
    added = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
    rules, names = [], []
    for i, call in enumerate(calls):
        names.append(f"call{i}")
        parts = [_lark_text(call.before, added), f"args{i}", _lark_text(call.after, added)]
        rules.append(f"call{i}: " + " ".join(p for p in parts if p))
        if call.pairs is None:
            rules.append(f"args{i}: {lark_json(call.schema)}")
        else:
            rules += _argument_pairs(f"args{i}", call.schema, call.pairs, added)
    if not names:
        raise GrammarError("tool_choice names no function the request offers.")
    head = _lark_text(opening, added)
    start = "start: " + (head + " " if head else "") + "(" + " | ".join(names) + ")"
    return Grammar.text("\n".join([start, *rules]), "the tool call")


_BARE_STRING_KEYWORDS = {"type", "description", "title", "enum", "const", "default", "examples"}


def _bare_string(schema: dict) -> str:
    """A Lark regex for a string written bare between markers, as the reader strips it: no '<' (the
    closing marker's first character), no space at either end, within minLength/maxLength."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not isinstance(high, int | None) or (high is not None and high < low):
        raise GrammarError("A string argument's minLength and maxLength must be integers, the least first.")
    end, middle = r"[^<\s]", r"[^<]"
    shapes = []  # the non-empty lengths: one character, or two ends around 0 or more
    if low <= 1 and (high is None or high >= 1):
        shapes.append(end)
    if high is None or high >= 2:
        shapes.append(f"{end}{middle}{{{max(low - 2, 0)},{'' if high is None else high - 2}}}{end}")
    if not shapes:
        return '""'
    return f"/({'|'.join(shapes)})" + ("?/" if low == 0 else "/")


def _argument_pairs(rule: str, schema: dict, pairs: ArgumentPairs, added: dict[str, int]) -> list[str]:
    """Lark rules for arguments written as key/value pairs: the schema's properties in its order,
    the required ones always and the others optional; a string-typed value bare (one of its enum
    or const where it has them), any other value JSON under its own schema."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required", []) if isinstance(k, str)]
    keys = [*properties, *(k for k in required if k not in properties)]
    rules, items = [], []
    for j, key in enumerate(keys):
        value = properties.get(key, {})
        value = value if isinstance(value, dict) else {}
        if value.get("type") == "string":
            extra = set(value) - _BARE_STRING_KEYWORDS - {"minLength", "maxLength"}
            if extra:
                raise GrammarError(
                    f"The string argument {key!r} has {', '.join(sorted(extra))}, which a call written as "
                    "key/value pairs cannot be held to."
                )
            choices = value.get("enum", [value["const"]] if "const" in value else None)
            if choices is not None and not all(isinstance(c, str) for c in choices):
                raise GrammarError(f"The string argument {key!r} lists a value that is not a string.")
            body = (
                " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                if choices
                else _bare_string(value)
            )
        else:
            body = lark_json(value)
        pair = [
            _lark_text(pairs.key_open + key + pairs.between, added),
            f"{rule}_{j}",
            _lark_text(pairs.value_close, added),
        ]
        rules.append(f"{rule}_{j}: {body}")
        items.append("(" + " ".join(pair) + ")" + ("" if key in required else "?"))
    rules.insert(0, f"{rule}: " + (" ".join(items) if items else '""'))
    return rules


def _lark_text(text: str, tokens: dict[str, int]) -> str:
    """`text` as Lark items: its pieces as string literals, the `tokens` (text -> id) in it as <[id]>."""
    if not text:
        return ""
    names = sorted(tokens, key=len, reverse=True)
    if names:
        pattern = "(" + "|".join(re.escape(s) for s in names) + ")"
        pieces = re.split(pattern, text)
    else:
        pieces = [text]
    return " ".join(
        f"<[{tokens[p]}]>" if p in tokens else json.dumps(p, ensure_ascii=False) for p in pieces if p
    )


def available() -> bool:
    """Whether the grammar engine is installed."""
    try:
        engine()
    except GrammarError:
        return False
    return True


def response_format_grammar(fmt) -> Grammar | None:
    """OpenAI's `response_format` -> the Grammar it asks for (None for `{"type": "text"}`), or
    GrammarError naming the field that is wrong."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise GrammarError('response_format must be an object with a "type".')
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise GrammarError(
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}.'
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError('response_format.json_schema must be an object with a "schema".')
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise GrammarError("response_format.json_schema.name must be a string.")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise GrammarError("response_format.json_schema.strict must be true or false.")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON schema object.")
    return Grammar.json_schema(schema, name)


class CompiledGrammar:
    """A grammar checked against one vocabulary of `mask_vocab` ids (at least the logits' width);
    `matcher()` gives a sequence its own state."""

    def __init__(self, grammar: Grammar, pristine, mask_vocab: int):
        self.grammar, self._pristine, self.mask_vocab = grammar, pristine, mask_vocab

    def matcher(self) -> Matcher:
        return Matcher(self._pristine.deep_copy(), self.grammar.source)


class Matcher:
    """One sequence's place in its grammar: `advance(token)` after each token picked; `done` once
    nothing but the end can follow."""

    def __init__(self, state, source: str):
        self.state, self.source = state, source
        self.seconds = 0.0  # spent in advance, for the batch's account of the grammar's cost

    def advance(self, token_id: int) -> None:
        """Take the token picked (one the mask allowed); GrammarError if the engine refuses it all
        the same (a mask and a parser out of step: a literal spelling a special token did so until
        the engine's encoder read text as text, `_TextOnly`)."""
        start = time.perf_counter()
        taken = self.state.consume_token(int(token_id))
        self.seconds += time.perf_counter() - start
        if not taken:
            error = _short(self.state.get_error().splitlines()[0] if self.state.get_error() else "")
            raise GrammarError(f"{self.source} broke down at token {token_id}: {error}")

    @property
    def done(self) -> bool:
        """Whether the text is complete and nothing may follow (the generation ends here)."""
        return self.state.is_stopped()


def mask_words(vocab_size: int) -> int:
    """int32 words of one sequence's mask (a bit per token)."""
    return (vocab_size + 31) // 32


_executor = None
_executor_lock = threading.Lock()


def fill_masks(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each matcher, as bits: int32 [n, mask_words(vocab_size)] on the CPU,
    computed in one call on the engine's threads."""
    global _executor
    llg = engine()
    with _executor_lock:
        if _executor is None:
            _executor = llg.LLExecutor()
    masks = torch.empty((len(matchers), mask_words(vocab_size)), dtype=torch.int32)
    pairs = [(m.state, i) for i, m in enumerate(matchers)]
    _executor.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), masks.shape[1] * 4, len(matchers))
    return masks


_background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moerun-grammar")


def start_masks(matchers: list[Matcher], vocab_size: int) -> concurrent.futures.Future:
    """fill_masks on a background thread: a step starts its masks before its forward pass and
    collects them after, so on a GPU the engine's work hides behind the model's (the engine lets go
    of the GIL while it computes). The matchers must not move until the result is taken."""
    return _background.submit(fill_masks, matchers, vocab_size)


# byte value -> the 8 tokens it covers, as what to add to their logits: 0 (allowed) or -inf
_BYTE_BIAS = torch.where((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))
_byte_bias: dict[torch.device, torch.Tensor] = {}  # the table on each device it was asked for


def mask_bias(masks: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """masks int32 [n, words] (a bit per token) -> float32 [n, vocab_size] on `device`: 0 where the
    bit is set, -inf where it is clear, to add to the logits. A table lookup per mask byte: its cost
    does not depend on which tokens are allowed (a masked_fill's does, through branches)."""
    n, device = masks.shape[0], torch.device(device)
    if device not in _byte_bias:
        _byte_bias[device] = _BYTE_BIAS.to(device)
    by_byte = masks.contiguous().view(torch.uint8).reshape(-1).to(device).long()  # 1 byte a token
    return _byte_bias[device].index_select(0, by_byte).view(n, -1)[:, :vocab_size]


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with every token whose bit in masks [n, words] is clear at -inf (in place)."""
    return logits.add_(mask_bias(masks, logits.shape[1], logits.device))


# --- the engine's view of a vocabulary, built once per (tokenizer, width, end ids): ~1 s at 152k ---

_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def prepare(tokenizer: Tokenizer | None, vocab_size: int, eos_ids) -> None:
    """Build the engine's view of this vocabulary now, if the engine is installed (a server does it
    on its own thread at start, so its first constrained request does not wait ~1-4 s for it)."""
    if tokenizer is None or not eos_ids:
        return
    with contextlib.suppress(GrammarError):  # not installed, or a vocabulary it cannot read: said on use
        _engine_tokenizer(tokenizer, vocab_size, tuple(sorted(eos_ids)))


def _engine_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    llg = engine()
    key = (vocab_size, eos_ids)
    with _vocab_lock:
        built = _vocabularies.setdefault(tokenizer, {})
        if key not in built:
            if not eos_ids:
                raise GrammarError(f"{tokenizer.source} names no end-of-sequence token to end a grammar.")
            n_vocab = max(vocab_size, tokenizer.vocab_size)
            try:
                read = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=list(eos_ids))
                text_only = llg.TokenizerWrapper(_TextOnly(read, tokenizer, eos_ids))
                built[key] = llg.LLTokenizer(text_only, n_vocab=n_vocab, eos_token=list(eos_ids))
            except Exception as e:  # the engine reads tokenizer.json with its own parser
                raise GrammarError(
                    f"The grammar engine cannot read the vocabulary of {tokenizer.source}: {_short(e)}"
                ) from None
        return built[key]


class _TextOnly:
    """The vocabulary as the engine read it from tokenizer.json, with an encoder that reads text as
    text: where a grammar forces bytes that spell an added token ("<|im_end|>" as a schema's const,
    "<tool_call>" in a Lark literal), the engine tokenises them to allow the next token, and
    tokenizer.json's own encoder would give the added token's id, which the engine (reading every
    added token as a token no spelling matches) then refuses, an error mid-reply, or which ends the
    reply as an end-of-sequence id (JSON cut short). Here no added token comes out of text."""

    def __init__(self, read, tokenizer: Tokenizer, eos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as Backend

        self.eos_token_id, self.bos_token_id = eos_ids[0], None
        self.tokens = [read.decode_bytes([i]) for i in range(read.vocab_size)]
        self.special_token_ids = [i for i in range(read.vocab_size) if read.is_special_token(i)]
        self._read = read
        spec = json.loads(tokenizer.backend.to_str())
        spec["added_tokens"] = []  # "<|im_end|>" in the text is text
        self._encoder = Backend.from_str(json.dumps(spec))

    def __call__(self, data: bytes) -> list[int]:
        """The ids of `data`: its text as text; from the first byte that is not UTF-8 text (a forced
        run may end mid-character), as the engine's own tokenizer splits bytes."""
        try:
            return self._encode(data.decode())
        except UnicodeDecodeError as e:
            return self._encode(data[: e.start].decode()) + self._read.tokenize_bytes(data[e.start :])

    def _encode(self, text: str) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids if text else []


def _bounded_json(schema, source: str) -> str:
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarError(f"{source} cannot be written as JSON: {_short(e)}") from None
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{source} is longer than {MAX_GRAMMAR_BYTES} bytes.")
    return text


def _short(error) -> str:
    text = str(error).strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."
