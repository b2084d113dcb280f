"""Tool calls and reasoning through `moerun serve`, with the official `openai` client: a Qwen3-style
model (its chat template, `<think>` and `<tool_call>` in its vocabulary) whose choice of tokens is
scripted (its logits replaced by a reply's ids, one a step), so the server's own path runs: the
template rendering the tools, the scheduler, the reply read into `reasoning_content` and
`tool_calls`, whole and streamed (the stream's deltas joining to the whole message). The next turn,
with the call and its answer sent back, is rendered as transformers renders it (its token count).
Malformed tools and template variables get a 400 naming the field; the server stays up."""

import json

import httpx
import pytest
from family_templates import QWEN3
from hf_models import make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir
from tokenizers import AddedToken
from transformers import AutoTokenizer

openai = pytest.importorskip("openai")
from scripted_server import scripted_server  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
THINKING = "Paris, café."
CALLING = (
    f"<think>\n{THINKING}\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)
ANSWER = "<think>\nIt is 18 degrees.\n</think>\n\nIt is 18 °C in Paris.<|im_end|>"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tools")
    tok = byte_level_tokenizer("qwen2")
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t in ("</think>", "<tool_call>", "</tool_call>")]
    )
    save_hf_dir(
        tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|im_end|>", chat_template=QWEN3
    )
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size(), max_position_embeddings=2048), path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    running = scripted_server(checkpoint, "qwen3-tiny")
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def ask(server, client, reply: str, messages, **options):
    server.play(reply)
    return client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=400, **options)


def test_a_call_comes_back_as_tool_calls(server, client):
    reply = ask(server, client, CALLING, QUESTION, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == THINKING
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_the_deltas_join_to_the_whole_message(server, client):
    whole = ask(server, client, CALLING, QUESTION, tools=[WEATHER]).choices[0]
    chunks = list(ask(server, client, CALLING, QUESTION, tools=[WEATHER], stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = {}
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            if part.id:
                assert call["id"] is None and part.type == "function" and part.function.name
                call["id"] = part.id
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert reasoning == whole.message.model_extra["reasoning_content"] and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_the_next_turn_renders_the_call_and_its_answer(server, client, checkpoint):
    first = ask(server, client, CALLING, QUESTION, tools=[WEATHER]).choices[0].message
    call = first.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}
    messages = [*QUESTION, first.model_dump(exclude_none=True), answer]
    second = ask(server, client, ANSWER, messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is 18 °C in Paris."
    assert second.choices[0].message.model_extra["reasoning_content"] == "It is 18 degrees."
    assert second.choices[0].finish_reason == "stop"
    # the same turn in the form the template reads, through transformers
    calling = {
        "role": "assistant",
        "reasoning_content": THINKING,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    ids = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [*QUESTION, calling, answer], tools=[WEATHER], add_generation_prompt=True, return_dict=False
    )
    assert second.usage.prompt_tokens == len(ids)


def test_under_tool_choice_none_a_call_is_text(server, client):
    reply = ask(server, client, CALLING, QUESTION, tools=[WEATHER], tool_choice="none").choices[0]
    assert reply.finish_reason == "stop" and not reply.message.tool_calls
    assert reply.message.content.startswith("<tool_call>\n{") and reply.message.content.endswith(
        "</tool_call>"
    )


def test_chat_template_kwargs_reach_the_template(server, client, checkpoint):
    off = ask(
        server, client, ANSWER, QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    ids = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        QUESTION, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert off.usage.prompt_tokens == len(ids)
    assert off.usage.prompt_tokens > ask(server, client, ANSWER, QUESTION).usage.prompt_tokens


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        (
            {
                "messages": [
                    *QUESTION,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
                ]
            },
            "messages",
        ),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": "get_weather"}]}, "messages"),
    ],
)
def test_malformed_tool_requests_get_a_400(server, fields, param):
    body = {"messages": QUESTION, "max_tokens": 4, **fields}
    with httpx.Client(base_url=server.base, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["message"].endswith("."), error
        assert http.get("/health").status_code == 200


def test_tools_belong_to_chat(server):
    with httpx.Client(base_url=server.base, timeout=60) as http:
        reply = http.post("/v1/completions", json={"prompt": "hi", "tools": [WEATHER]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
