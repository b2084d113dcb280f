"""`moerun serve` with `response_format` and `n`, through the official `openai` client: a random tiny
model's output under a JSON schema parses and validates (checked with `jsonschema`), whole and
streamed, alone and at 8 concurrent requests; a format the engine cannot enforce, or a malformed
one, is a 400 naming it and the server stays up; `n` choices each equal a request of its own with
seed + i, streamed with their index, the prompt counted once in usage."""

import concurrent.futures
import json
import sys

import httpx
import pytest
import torch
from hf_models import chatml_checkpoint, make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

import moerun

openai = pytest.importorskip("openai")
from moerun.serve.server import start  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "rank": {"type": "integer", "minimum": 1, "maximum": 50},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "rank", "sunny"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "A city, as JSON."}]
BUDGET = 80  # tokens: more than the longest text SCHEMA allows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chatml_checkpoint(tmp_path_factory.mktemp("served_structured"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return moerun.load(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def server(checkpoint):
    running = start(moerun.load(checkpoint, dtype=torch.float32), model_name="tiny", parallel=8, ctx_size=256)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def jsonschema():
    pytest.importorskip("llguidance")
    return pytest.importorskip("jsonschema")


def _ask(client, seed, stream=False, **extra):
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=BUDGET,
        temperature=1.0,
        seed=seed,
        response_format=FORMAT,
        stream=stream,
        **extra,
    )
    if not stream:
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = [c for c in reply if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]


def test_a_schema_reply_parses_and_validates_whole_and_streamed(client, jsonschema):
    for stream in (False, True):
        text, finish = _ask(client, seed=1, stream=stream)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert _ask(client, seed=1) == _ask(client, seed=1, stream=True)


def test_eight_concurrent_schema_requests_each_validate(client, jsonschema, server):
    """8 at once (the server's parallel), half streamed, each its own seed (its own matcher state)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _ask(client, seed=100 + i, stream=i % 2 == 1), range(8)))
    for text, finish in replies:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in replies}) > 1


def _metric(server, name: str) -> float:
    lines = httpx.get(server.base + "/metrics", timeout=30).text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(f"moerun_{name} ")))


def test_the_grammars_seconds_are_counted_within_the_step_seconds(client, server):
    grammar, steps = _metric(server, "grammar_seconds_total"), _metric(server, "step_seconds_total")
    _ask(client, seed=7)
    spent = _metric(server, "grammar_seconds_total") - grammar
    assert 0 < spent < _metric(server, "step_seconds_total") - steps
    # free: the grammar's seconds stay where they were
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7)
    assert _metric(server, "grammar_seconds_total") - grammar == pytest.approx(spent, abs=1e-6)


def test_completions_take_a_response_format_too(server, jsonschema):
    body = {"prompt": "x", "max_tokens": BUDGET, "temperature": 1, "seed": 5, "response_format": FORMAT}
    reply = httpx.post(server.url + "/completions", json=body, timeout=120).json()
    jsonschema.validate(json.loads(reply["choices"][0]["text"]), SCHEMA)


def test_an_unsupported_schema_feature_is_a_400_naming_it(server, jsonschema):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with httpx.Client(base_url=server.base, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": fmt})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "response_format" and '"if"' in error["message"]
        assert http.get("/health").status_code == 200


BAD_FORMATS = [
    "json",
    {"type": "xml"},
    {"type": 3},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": 3}},
    {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
    {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "banana"}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "http://example.com/s.json"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
    {"type": "json_schema", "json_schema": {"schema": {"properties": [1, 2]}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 5, "maxItems": 2}}},
]


def test_malformed_formats_are_400s_and_the_server_stays_up(server, jsonschema):
    with httpx.Client(base_url=server.base, timeout=30) as http:
        for fmt in BAD_FORMATS:
            for route, body in (
                ("/v1/chat/completions", {"messages": MESSAGES}),
                ("/v1/completions", {"prompt": "x"}),
            ):
                r = http.post(route, json={**body, "max_tokens": 4, "response_format": fmt})
                assert r.status_code == 400, (fmt, r.status_code, r.text[:300])
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/health").status_code == 200


def test_fuzzed_formats_never_give_a_500(server, jsonschema):
    """Random JSON values as response_format and as its schema: a 200 or a 400, never a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8))
    keys = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "$ref", "x"])
    value = st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
        max_leaves=10,
    )
    kind = st.sampled_from(["json_schema", "json_object", "text", "other"])
    http = httpx.Client(base_url=server.base, timeout=60)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(kind=kind, schema=value)
    def check(kind, schema):
        fmt = {"type": kind, "json_schema": {"name": "f", "schema": schema}}
        body = {"prompt": "x", "max_tokens": 1, "response_format": fmt}
        r = http.post("/v1/completions", json=body)
        assert r.status_code in (200, 400), (fmt, r.text[:300])

    try:
        check()
        assert http.get("/health").status_code == 200
    finally:
        http.close()


def test_without_the_engine_a_format_is_a_400_saying_what_to_install(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` fails (same process)
    body = {"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}
    r = httpx.post(server.url + "/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format"
    assert "pip install 'moerun[structured]'" in error["message"]


# --- n choices ---


def test_n_choices_are_requests_with_seed_plus_i(client, reference):
    prompt, options = "The quick brown", dict(max_tokens=8, temperature=1.0, seed=21)
    reply = client.completions.create(model="tiny", prompt=prompt, n=3, **options)
    expected = [
        "".join(t.text for t in reference.generate(prompt, 8, temperature=1.0, seed=21 + i)) for i in range(3)
    ]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == expected
    assert reply.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))  # counted once
    assert reply.usage.completion_tokens == sum(
        len(list(reference.generate(prompt, 8, temperature=1.0, seed=21 + i))) for i in range(3)
    )


def test_n_choices_streamed_carry_their_index(client, reference):
    ids = reference.tokenizer.encode_chat(MESSAGES)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=4,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    expected = [
        "".join(t.text for t in reference.generate(ids, 8, temperature=1.0, seed=4 + i)) for i in range(3)
    ]
    assert [texts[i] for i in range(3)] == expected and sorted(finishes) == [0, 1, 2]
    assert usage.prompt_tokens == len(ids)


def test_n_choices_under_a_schema_each_validate(client, jsonschema):
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=BUDGET,
        temperature=1.0,
        seed=9,
        n=3,
        response_format=FORMAT,
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


# --- tool_choice that asks for a call ---

CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
DICE = {
    "type": "function",
    "function": {
        "name": "roll",
        "parameters": {
            "type": "object",
            "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
            "required": ["sides"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {"get_weather": CITY, "roll": DICE}


MARKERS = (
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)


@pytest.fixture(scope="module", params=["QWEN3", "QWEN3_THINKING", "GLM45"])
def tool_server(tmp_path_factory, request):
    """A random model under Qwen3's template, the thinking one whose prompt opens `<think>`, or
    GLM-4.5's (a call's arguments as <arg_key>/<arg_value> pairs); the markers in its vocabulary."""
    import family_templates
    from tokenizers import AddedToken

    path = tmp_path_factory.mktemp("tools-random")
    tok = byte_level_tokenizer("qwen2")
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in MARKERS])
    save_hf_dir(
        tok,
        path,
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token="<|im_end|>",
        chat_template=getattr(family_templates, request.param),
    )
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size(), max_position_embeddings=1024), path)
    running = start(moerun.load(path, dtype=torch.float32), model_name="tools", parallel=4, ctx_size=1024)
    yield running
    running.close()


def _check_calls(choice, jsonschema, names):
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.function.name in names
        parameters = TOOLS[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), parameters)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_tool_choice_required_makes_a_random_model_call_a_tool(tool_server, jsonschema, enable_thinking):
    """Under tool_choice "required" the reply is a call of an offered tool whose arguments validate,
    whole and streamed, at 4 requests at once: with thinking off (the prompt opens and closes the
    reasoning), on, and under a template whose prompt opens it (the reply closes it first)."""
    client = openai.OpenAI(base_url=tool_server.url, api_key="none", max_retries=0, timeout=120)
    extra = {"chat_template_kwargs": {"enable_thinking": enable_thinking}}

    def ask(seed):
        return client.chat.completions.create(
            model="tools",
            messages=MESSAGES,
            tools=[CITY, DICE],
            tool_choice="required",
            max_tokens=BUDGET,
            temperature=1.0,
            seed=seed,
            extra_body=extra,
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for reply in pool.map(ask, range(4)):
            _check_calls(reply.choices[0], jsonschema, TOOLS)
    stream = client.chat.completions.create(
        model="tools",
        messages=MESSAGES,
        tools=[CITY, DICE],
        tool_choice={"type": "function", "function": {"name": "roll"}},
        max_tokens=BUDGET,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body=extra,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert calls[0].function.name == "roll" and chunks[-1].finish_reason == "tool_calls"
    arguments = "".join(d.function.arguments or "" for d in calls)
    jsonschema.validate(json.loads(arguments), DICE["function"]["parameters"])


def test_tool_choice_and_a_response_format_together_are_a_400(tool_server, jsonschema):
    body = {"messages": MESSAGES, "tools": [CITY], "tool_choice": "required", "response_format": FORMAT}
    r = httpx.post(tool_server.url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_a_string_pattern_in_key_value_pairs_is_a_400_naming_it(tool_server):
    """GLM-4.5 writes a string argument bare, where a `pattern` cannot be held: a 400 naming the
    argument and the keyword, and the server goes on. Under JSON-object templates it is held."""
    tool = {
        "type": "function",
        "function": {
            "name": "code",
            "parameters": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
            },
        },
    }
    body = {"messages": MESSAGES, "tools": [tool], "tool_choice": "required", "max_tokens": 200}
    body["temperature"] = 0  # the masked argmax: a call within the budget, the same each run
    r = httpx.post(tool_server.url + "/chat/completions", json=body, timeout=60)
    if "<arg_key>" in tool_server.state.model.tokenizer.chat_template:
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "'zip'" in r.json()["error"]["message"] and "pattern" in r.json()["error"]["message"]
        assert httpx.get(tool_server.base + "/health", timeout=30).status_code == 200
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        arguments = json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
        assert len(arguments["zip"]) == 5 and arguments["zip"].isdigit()
