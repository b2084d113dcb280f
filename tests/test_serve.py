"""`moerun serve` through the official `openai` client against a server on a free loopback port: chat
and completions, whole and streamed, usage, stops, seeds, logprobs, against the same model's
`generate` run here (a second copy of the model, loaded apart); continuous batching (concurrent
greedy requests give the tokens each gives alone); a client gone mid-stream frees its slot; a
bounded load run; prefix reuse; and the other routes."""

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import pytest
import torch
from hf_models import chatml_checkpoint

import moerun

openai = pytest.importorskip("openai")
from moerun.serve.server import OFF_LOOP_THREADS, start  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chatml_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same checkpoint loaded apart: what the server's answers are checked against."""
    return moerun.load(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def server(checkpoint):
    running = start(moerun.load(checkpoint, dtype=torch.float32), model_name="tiny", parallel=4, ctx_size=256)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def _alone(model, prompt, n, **options):
    tokens = list(model.generate(prompt, n, **options))
    return "".join(t.text for t in tokens), model.stats()


def _chat_ids(model, messages):
    return model.tokenizer.encode_chat(messages)


MESSAGES = [{"role": "user", "content": "hello café"}]


def test_chat_completion_is_the_models_generation(client, reference):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    ids = _chat_ids(reference, MESSAGES)
    text, stats = _alone(reference, ids, 12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == {"length": "length", "stop": "stop"}[stats["finish_reason"]]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == stats["new_tokens"]
    assert reply.usage.total_tokens == len(ids) + stats["new_tokens"]
    assert reply.object == "chat.completion" and reply.model == "tiny"


def test_streamed_chat_gives_the_same_text_and_usage(client, reference):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text, stats = _alone(reference, _chat_ids(reference, MESSAGES), 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == stats["new_tokens"]


def test_completions_whole_and_streamed(client, reference):
    text, stats = _alone(reference, "The quick brown", 10)
    whole = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0)
    assert whole.choices[0].text == text and whole.usage.completion_tokens == stats["new_tokens"]
    assert whole.usage.prompt_tokens == len(reference.tokenizer.encode("The quick brown"))
    streamed = client.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_strings_and_token_id_prompts(client, reference):
    full, _ = _alone(reference, "hello world", 24)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    reply = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=24, temperature=0, stop=[stop]
    )
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"
    ids = reference.tokenizer.encode("hello world")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == full


def test_a_seed_reproduces_a_sampled_reply(client):
    def ask(seed):
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
        )
        return reply.choices[0].message.content

    assert ask(7) == ask(7)
    assert len({ask(s) for s in range(4)}) > 1  # other seeds, other texts


def test_logprobs_are_the_models(client, reference):
    ids = _chat_ids(reference, MESSAGES)
    expected = list(reference.generate(ids, 6, logprobs=3))
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected)
    for got, want in zip(content, expected, strict=True):
        assert abs(got.logprob - want.logprob) <= 1e-4
        assert (
            len(got.top_logprobs) == 3 and abs(got.top_logprobs[0].logprob - want.top_logprobs[0][1]) <= 1e-4
        )


def test_concurrent_greedy_requests_get_what_each_gets_alone(client, reference, server):
    prompts = [f"request {i}: " + "abc " * i for i in range(8)]
    expected = [_alone(reference, p, 10)[0] for p in prompts]

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)

    steps = server.state.scheduler.counters.steps
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, prompts))
    assert [r.choices[0].text for r in replies] == expected
    # they ran side by side: far fewer steps than 8 requests of 10 tokens one after another
    assert server.state.scheduler.counters.steps - steps < 8 * 10


def _wait_idle(scheduler, seconds=10):
    deadline = time.monotonic() + seconds
    while (scheduler.running or scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not scheduler.running and not scheduler.waiting


def test_a_client_gone_mid_stream_frees_its_slot(server):
    scheduler = server.state.scheduler
    cancelled = scheduler.counters.cancelled
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    assert _wait_idle(scheduler)
    assert scheduler.counters.cancelled == cancelled + 1


def _threads() -> tuple[int, int]:
    """(threads other than the server's fixed off-loop pool, threads of that pool)"""
    names = [t.name for t in threading.enumerate()]
    pool = sum(name.startswith("moerun-off-loop") for name in names)
    return len(names) - pool, pool


def test_a_bounded_load_run_completes_with_nothing_leaked(server, client):
    threads, _ = _threads()
    scheduler = server.state.scheduler
    before = scheduler.counters.finished

    def ask(i):
        return client.completions.create(
            model="tiny", prompt=f"load {i}", max_tokens=4 + i % 5, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(64)))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in replies)
    assert scheduler.counters.finished - before == 64
    assert _wait_idle(scheduler)
    others, pool = _threads()
    assert others <= threads + 1 and 1 <= pool <= OFF_LOOP_THREADS


def test_a_conversations_next_turn_reuses_its_prefix(client, reference):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "and then?"})
    second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == _alone(reference, _chat_ids(reference, turn), 8)[0]


def test_the_other_routes(server, reference):
    with httpx.Client(base_url=server.base, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
        tokens = http.post("/tokenize", json={"content": "hello café"}).json()
        assert tokens["tokens"] == reference.tokenizer.encode("hello café")
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["content"]
        assert text == reference.tokenizer.decode(tokens["tokens"])
        metrics = http.get("/metrics").text
    values = dict(line.split(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert int(values["moerun_requests_total"]) >= 1 and "moerun_queue_length" in values
    assert int(values["moerun_generation_tokens_total"]) > 0 and "moerun_batch_size" in values


def test_the_server_is_an_openai_json_body_per_error(server):
    with httpx.Client(base_url=server.base, timeout=30) as http:
        r = http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": "ten"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.post("/v1/chat/completions", json={"model": "other", "messages": MESSAGES})
        assert r.status_code == 404 and "other" in r.json()["error"]["message"]
        assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 400, "max_tokens": 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "401" in message and "256" in message  # both lengths
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # more than parallel=4
        assert http.get("/health").status_code == 200


def test_an_api_key_is_required_when_set(checkpoint):
    running = start(moerun.load(checkpoint, dtype=torch.float32), model_name="tiny", api_key="sekrit")
    try:
        with httpx.Client(base_url=running.base, timeout=30) as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 401
            wrong = {"Authorization": "Bearer nope"}
            r = http.post("/v1/completions", json=body, headers=wrong)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # health stays open, as llama-server's
        good = openai.OpenAI(base_url=running.url, api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
    finally:
        running.close()


def test_a_full_queue_is_a_503(checkpoint):
    running = start(moerun.load(checkpoint, dtype=torch.float32), model_name="tiny", parallel=1, queue_size=0)
    try:
        with httpx.Client(base_url=running.base, timeout=30) as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    finally:
        running.close()


MALFORMED = [
    b"",
    b"[]",
    b"null",
    b"\xff\xfe{",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": 1' + b"0" * 5000 + b"}",
    json.dumps({"prompt": "hi", "max_tokens": 10**30}).encode(),
    json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
    json.dumps({"prompt": "hi", "temperature": float("nan")}).encode(),
    json.dumps({"prompt": "hi", "stop": [1, 2]}).encode(),
    json.dumps({"prompt": "hi", "stop": ["a"] * 100}).encode(),
    json.dumps({"prompt": [10**12]}).encode(),
    json.dumps({"prompt": [-1, 2]}).encode(),
    json.dumps({"prompt": {"a": 1}}).encode(),
    json.dumps({"prompt": "hi", "logprobs": 99}).encode(),
    json.dumps({"prompt": "hi", "seed": 2**70}).encode(),
    json.dumps({"prompt": "hi", "stream_options": 3, "stream": True}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    json.dumps({"messages": [{"role": 3}]}).encode(),
    json.dumps({"messages": "hi"}).encode(),
    json.dumps({"messages": [], "max_tokens": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}).encode(),
    json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}
    ).encode(),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_malformed_bodies_get_a_400_and_the_server_stays_up(server, route):
    with httpx.Client(base_url=server.base, timeout=30) as http:
        for body in MALFORMED:
            r = http.post(route, content=body, headers={"content-type": "application/json"})
            # every body is malformed for a completion; some are fine text for /tokenize
            allowed = (400, 413) if route.startswith("/v1") else (200, 400, 413)
            assert r.status_code in allowed, (route, body[:60], r.status_code, r.text[:200])
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/health").status_code == 200


def test_health_is_503_while_the_model_loads():
    from starlette.testclient import TestClient

    from moerun.serve.app import ServerState, build_app

    state = ServerState("tiny")
    with TestClient(build_app(state)) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        state.load_error = "no config.json in /x"
        assert "no config.json in /x" in http.get("/health").json()["error"]["message"]


def test_fuzzed_fields_never_give_a_500(server):
    """Random JSON values (hypothesis) in every field a completion reads: a 200 or a 4xx in OpenAI's
    error shape, never a 500, and the server answers after."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=False),
        st.text(max_size=20),
    )
    value = st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8,
    )
    fields = [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "n",
        "stream",
        "presence_penalty",
        "frequency_penalty",
        "model",
    ]
    body = st.dictionaries(st.sampled_from(fields), value, max_size=6)
    http = httpx.Client(base_url=server.base, timeout=30)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=body, chat=st.booleans())
    def check(body, chat):
        body = {**body, "max_tokens": body.get("max_tokens", 2)} if not chat else body
        route = "/v1/chat/completions" if chat else "/v1/completions"
        r = http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.text[:300])
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    try:
        check()
        assert http.get("/health").status_code == 200
    finally:
        http.close()


def test_the_serve_command_answers_once_loaded(checkpoint):
    """`moerun serve` as a user starts it: a process on a free loopback port, 503 or no answer
    while loading, then the API; Ctrl-C (SIGINT) stops it."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "moerun", "serve", "-m", str(checkpoint), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--dtype", "fp32", "--alias", "tiny"], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and status != 200:
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            time.sleep(0.2)
        assert status == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        # --ctx-size's default, 4096, is the model's 256 here: a default is never refused
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 256
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert "ready on http://127.0.0.1" in err and "Traceback" not in err


def test_a_ctx_size_past_the_models_context_refuses_to_serve(checkpoint):
    """An explicit --ctx-size longer than the model's context is not cut to it: once the model is
    loaded the server stops, and the command exits 2 with one sentence naming both numbers."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "moerun", "serve", "-m", str(checkpoint), "--port", "0", "-c", "512"]
    run = subprocess.run([*command, "--dtype", "fp32"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "moerun serve: --ctx-size must be between 1 and this model's context of 256 positions, got 512."
    )
    assert "ready on" not in run.stderr and "Traceback" not in run.stderr


def test_start_refuses_a_ctx_size_past_the_models_context(reference):
    with pytest.raises(ValueError, match="context of 256 positions, got 257"):
        start(reference, ctx_size=257)
