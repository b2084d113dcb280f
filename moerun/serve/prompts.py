"""What a completion request asks of the model, as ids: a completion's prompt, or a chat's messages
and tools rendered by the model's chat template, with what reads the reply and, where tool_choice asks
for a call, the grammar of one. Text longer than the context could hold is refused before it is
tokenised (`chars_per_token` bounds the characters one token covers)."""

from __future__ import annotations

from collections.abc import Callable

from moerun.serve import protocol
from moerun.serve.protocol import Body, bad
from moerun.text import grammar
from moerun.text.chat_tools import tool_call_tags
from moerun.text.grammar import Grammar
from moerun.text.reasoning import END as THINK_END
from moerun.text.reasoning import prompt_opens_thinking
from moerun.text.reply import ReplyFormat, ReplyParser
from moerun.text.tool_calls import ToolRequest


def text_prompt(model, body: Body, most: int | None) -> str | list[int]:
    """A completion's prompt (text or ids); text of more than `most` characters is refused before
    it is tokenised."""
    prompt = protocol.completion_prompt(body)
    if isinstance(prompt, str) and model.tokenizer is None:
        raise bad("This model has no tokenizer, so the prompt must be token ids.", "prompt")
    if isinstance(prompt, str):
        _check_length(prompt, most, "prompt")
    return prompt


def chat_prompt(
    model, body: Body, fmt: ReplyFormat, most: int | None
) -> tuple[list[int], Callable[[], ReplyParser], Grammar | None]:
    """A chat's messages (and tools) in the model's template -> (its ids, what makes a parser for a
    reply, which `fmt` says how to read: one per choice, the grammar of a call where tool_choice asks
    for one); a rendering of more than `most` characters is refused before it is tokenised."""
    messages = protocol.chat_messages(body)
    tools = protocol.chat_tools(body)
    variables = protocol.template_variables(body)
    if tools is not None and tools.parsed and not fmt.calls_tools():
        raise bad(
            f"This model ({model.config.model_type}) has no tool-call syntax moerun can read: its chat "
            "template names none, nor does its vocabulary or family.",
            "tools",
        )
    try:
        text = model.tokenizer.render_chat(messages, tools=list(tools.tools) if tools else None, **variables)
    except ValueError as e:  # no template, or one that refuses these messages
        raise bad(str(e)[:300], "messages") from None
    _check_length(text, most, "messages")
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return ids, lambda: fmt.parser(text, tools), _forced_call(model, fmt, tools, text)


def _forced_call(model, fmt: ReplyFormat, tools: ToolRequest | None, prompt: str) -> Grammar | None:
    """Under tool_choice "required" or a named function: the grammar of a reply that is one call of
    those functions as the chat template writes a call (after closing the reasoning the prompt opens,
    so the reply is read as a call). None where the choice is the model's, where the template writes
    arguments in a form other than one JSON object or GLM-4.5's key/value pairs, or without the
    grammar engine: the choice is then only asked of the model."""
    if tools is None or not tools.parsed or tools.choice in ("auto", "none") or not grammar.available():
        return None
    tokenizer = model.tokenizer
    calls = tool_call_tags(tokenizer.chat_template, tokenizer.special_tokens, tools)
    if not calls:
        return None
    opening = f"{THINK_END}\n\n" if fmt.thinking and prompt_opens_thinking(prompt) else ""
    try:
        return grammar.tool_call_grammar(calls, tokenizer, opening)
    except grammar.GrammarError as e:  # a parameter the template's form of a call cannot hold to
        raise bad(str(e), "tools") from None


def _check_length(text: str, most: int | None, field: str) -> None:
    if most is not None and len(text) > most:
        raise bad(
            f"The prompt's {len(text)} characters cannot fit this server's context: at most {most} "
            "can (the context times the most characters one token of this vocabulary covers).",
            field,
        )


def chars_per_token(tokenizer) -> int:
    """The most characters of text one token can stand for: its longest entry (byte-level vocabularies
    spell each byte as one character, SentencePiece ones each character as one), or 0 where a token
    may stand for any number (a BPE that joins a run of unknown characters into one unknown token,
    a non-BPE model)."""
    from tokenizers.models import BPE

    if tokenizer is None:
        return 0
    backend = tokenizer.backend.model
    if not isinstance(backend, BPE) or (backend.fuse_unk and not backend.byte_fallback):
        return 0
    return max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=0)
