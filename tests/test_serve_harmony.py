"""gpt-oss's reasoning channel through the server: a reply in OpenAI's harmony format comes back
with the analysis channel as `reasoning_content` and the final channel as `content`, whole and
streamed, and a message to `functions.NAME` as a tool call. The model's own choice is scripted (its
logits replaced by the reply's ids, one a step), so the test is of the server's reading of the
format; the parser also runs on moerun's text stream of the same ids."""

import json

import httpx
import pytest
import torch
from hf_models import make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

import moerun
from moerun.batching import TextRelease, Token
from moerun.text.reply import ReplyDelta, ReplyFormat

pytest.importorskip("uvicorn")
from scripted_server import scripted_server  # noqa: E402

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly, café.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there, café!<|return|>"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony")
    tok = byte_level_tokenizer("qwen2", extra_special=tuple(MARKERS))
    ends = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]  # as gpt-oss's generation_config
    model = make_model(
        "gpt_oss", vocab_size=tok.get_vocab_size(), max_position_embeddings=1024, eos_token_id=ends
    )
    save_model(model, path)
    save_hf_dir(
        tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|return|>", chat_template=TEMPLATE
    )
    return path


def test_the_parser_on_moerun_s_text_stream(checkpoint):
    tokenizer = moerun.load(checkpoint, dtype=torch.float32).tokenizer
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    fmt = ReplyFormat.of(tokenizer, "gpt_oss")
    assert fmt.harmony
    release, parser, reply = TextRelease(tokenizer, []), fmt.parser(), ReplyDelta()
    for i, token_id in enumerate(ids):
        out, _ = release.push(Token(token_id), i == len(ids) - 1)
        reply.add(parser.push_tokens(out))
    reply.add(parser.finish())
    assert reply.reasoning == "The user greets; answer briefly, café."
    assert reply.content == "Hello there, café!"


@pytest.fixture(scope="module")
def server(checkpoint):
    running = scripted_server(checkpoint, "gpt-oss-tiny")
    yield running
    running.close()


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 0}


def test_the_reasoning_comes_apart_from_the_answer(server):
    server.play(REPLY)
    with httpx.Client(base_url=server.base, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json=BODY).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets; answer briefly, café."
    assert message["content"] == "Hello there, café!"
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_streamed_the_reasoning_comes_as_its_own_deltas(server):
    server.play(REPLY)

    reasoning = content = ""
    body = {**BODY, "stream": True}
    with (
        httpx.Client(base_url=server.base, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert reasoning == "The user greets; answer briefly, café."
    assert content == "Hello there, café!"


def test_a_message_to_a_function_is_a_tool_call(server):
    body = {**BODY, "tools": [WEATHER], "max_tokens": 300}
    for stream in (False, True):
        server.play(CALL)
        with httpx.Client(base_url=server.base, timeout=120) as http:
            if not stream:
                choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
                message, finish = choice["message"], choice["finish_reason"]
            else:
                deltas = []
                with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            deltas.append(json.loads(line[6:])["choices"][0])
                finish = deltas[-1]["finish_reason"]
                parts = [p for d in deltas for p in d["delta"].get("tool_calls") or []]
                message = {
                    "reasoning_content": "".join(d["delta"].get("reasoning_content") or "" for d in deltas),
                    "tool_calls": [
                        {
                            "function": {
                                "name": parts[0]["function"]["name"],
                                "arguments": parts[1]["function"]["arguments"],
                            }
                        }
                    ],
                }
        assert finish == "tool_calls"
        assert message["reasoning_content"] == "Need the weather."
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
            "city": "Paris"
        }


def test_a_tokenizer_without_the_markers_is_not_split():
    assert not ReplyFormat.of(None).harmony
