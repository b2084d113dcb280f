"""A response's choice built from the tokens that come back, whole or as streamed chunks: a
completion's text, or a chat's message with its reasoning (`reasoning_content`) and tool calls
(`tool_calls`) apart from its answer, read by the model's `moerun.text.reply` parser. Streamed, a
tool call comes in two chunks of its own once it is complete, its id and name and then its
arguments, as OpenAI's clients assemble them; the chunks join to the whole message."""

from __future__ import annotations

from moerun.serve import protocol
from moerun.serve.protocol import Options
from moerun.text.reply import ReplyDelta, ReplyParser


def text_choice(tokenizer, tokens: list, stats: dict, options: Options, index: int = 0) -> dict:
    """A whole completion's choice `index`."""
    logprobs = (
        protocol.completion_logprobs(tokenizer, tokens, options.logprobs) if options.want_logprobs else None
    )
    finish = protocol.FINISH.get(stats["finish_reason"], "stop")
    return {
        "index": index,
        "text": "".join(t.text for t in tokens),
        "finish_reason": finish,
        "logprobs": logprobs,
    }


def text_chunk(tokenizer, tokens: list, options: Options, offset: int, index: int = 0) -> dict:
    """A streamed completion's choice `index` for a batch of its new tokens; `offset`: the characters
    before them."""
    logprobs = (
        protocol.completion_logprobs(tokenizer, tokens, options.logprobs, offset)
        if options.want_logprobs
        else None
    )
    text = "".join(t.text for t in tokens)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


class ChatChoice:
    """One chat choice, read by `reply` as its tokens come."""

    def __init__(self, reply: ReplyParser, tokenizer, options: Options, index: int = 0):
        self.reply, self.tokenizer, self.options, self.index = reply, tokenizer, options, index
        self.calls = 0  # tool calls given out

    def whole(self, tokens: list, stats: dict) -> dict:
        """The whole response's choice: the message, its logprobs and the finish reason."""
        delta = self.reply.push_tokens(tokens)
        delta.add(self.reply.finish())
        self.calls += len(delta.calls)
        message = {"role": "assistant", "content": delta.content}
        if delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        if delta.calls:
            message["content"] = delta.content or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in delta.calls
            ]
        return {
            "index": self.index,
            "message": message,
            "finish_reason": self.finish_reason(stats),
            "logprobs": self._logprobs(tokens),
        }

    def first_chunk(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def chunks(self, tokens: list) -> list[dict]:
        """The streamed choices a batch of new tokens makes."""
        return self._delta_chunks(self.reply.push_tokens(tokens), tokens)

    def last_chunks(self, stats: dict) -> list[dict]:
        """What the reply held back until its end, then the finish reason."""
        return [*self._delta_chunks(self.reply.finish(), []), self._chunk({}, self.finish_reason(stats))]

    def finish_reason(self, stats: dict) -> str:
        """OpenAI's finish reason: "tool_calls" for a reply that called tools and stopped."""
        finish = protocol.FINISH.get(stats["finish_reason"], "stop")
        return "tool_calls" if self.calls and finish == "stop" else finish

    def _delta_chunks(self, delta: ReplyDelta, tokens: list) -> list[dict]:
        logprobs = self._logprobs(tokens) if tokens else None
        text = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.content or not delta.reasoning:
            text["content"] = delta.content
        chunks = []
        if delta.reasoning or delta.content or logprobs or (tokens and not delta.calls):
            chunks.append(self._chunk(text, logprobs=logprobs))
        for call in delta.calls:
            head = {"name": call.name, "arguments": ""}
            chunks.append(self._call_chunk({"id": call.id, "type": "function", "function": head}))
            chunks.append(self._call_chunk({"function": {"arguments": call.arguments}}))
            self.calls += 1
        return chunks

    def _call_chunk(self, part: dict) -> dict:
        return self._chunk({"tool_calls": [{"index": self.calls, **part}]})

    def _chunk(self, delta: dict, finish: str | None = None, logprobs=None) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, tokens: list) -> dict | None:
        if not self.options.want_logprobs:
            return None
        return protocol.chat_logprobs(self.tokenizer, tokens, self.options.logprobs)
