"""`moerun serve`'s bounds on the work one request may cause: the stop strings' total length, text
that is not Unicode (a lone UTF-16 surrogate), the Content-Type a body must carry, tokenising off the
event loop with a prompt refused untokenised when its characters cannot fit the context, and the
drain on shutdown after which running streams end with an error chunk."""

import json
import random
import threading
import time

import httpx
import pytest
import torch
from hf_models import chatml_checkpoint
from tiny_tokenizers import VARIANTS, random_text, save_hf_dir

import moerun
from moerun.cli.main import main
from moerun.serve.prompts import chars_per_token
from moerun.serve.protocol import MAX_STOP_CHARS
from moerun.text import Tokenizer

pytest.importorskip("uvicorn")
from moerun.serve.server import start  # noqa: E402

JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chatml_checkpoint(tmp_path_factory.mktemp("bounded"))


@pytest.fixture(scope="module")
def server(checkpoint):
    running = start(moerun.load(checkpoint, dtype=torch.float32), model_name="tiny", ctx_size=256)
    yield running
    running.close()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client


def _post(http, route: str, body: dict, **headers) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as any client's JSON encoder must
    return http.post(route, content=json.dumps(body), headers={**JSON, **headers})


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- stop strings ---


def test_stop_strings_past_their_bound_are_a_400(http):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    over = ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)]
    error = _error(_post(http, "/v1/completions", {**body, "stop": over}), 400)
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]
    # at the bound: accepted, and a stop string that never comes leaves the text as it was
    plain = _post(http, "/v1/completions", body).json()["choices"][0]["text"]
    at = _post(http, "/v1/completions", {**body, "stop": ["\x00" * MAX_STOP_CHARS]})
    assert at.status_code == 200 and at.json()["choices"][0]["text"] == plain


# --- text that is not Unicode ---


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user\udfff", "content": "a"}]}, "messages"),
        ("/v1/completions", {"prompt": "\udc00", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"], "max_tokens": 1}, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
        ("/tokenize", {"content": "\ud800"}, "content"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(http, route, body, field):
    error = _error(_post(http, route, body), 400)
    assert error["param"] == field and "surrogate" in error["message"]
    if field == "messages":
        assert "'messages[0]." in error["message"]
    assert http.get("/health").status_code == 200


def test_a_surrogate_pair_is_one_character(http, server):
    emoji = "😀"  # json.dumps writes it as the pair \ud83d\ude00
    assert "\\ud83d\\ude00" in json.dumps(emoji)
    r = _post(http, "/tokenize", {"content": emoji})
    assert r.status_code == 200 and r.json()["tokens"] == server.state.model.tokenizer.encode(emoji)


# --- Content-Type ---


@pytest.mark.parametrize(
    "headers",
    [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_not_sent_as_json_is_a_415(http, route, headers):
    body = json.dumps({"prompt": "hi", "messages": MESSAGES, "content": "hi", "tokens": [1]})
    error = _error(http.post(route, content=body, headers=headers), 415)
    assert "Content-Type: application/json" in error["message"]


def test_json_content_types_are_taken(http):
    for kind in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"):
        r = http.post("/tokenize", content=json.dumps({"content": "hi"}), headers={"content-type": kind})
        assert r.status_code == 200, (kind, r.text[:200])


# --- tokenising: off the event loop, bounded by the context ---


@pytest.fixture
def held_tokenizer(server):
    """The served model's tokenizer with `encode` held until the test lets it go: (entered, release,
    calls) events and a list of the texts it was called on."""
    tokenizer = server.state.model.tokenizer
    encode, entered, release, calls = tokenizer.encode, threading.Event(), threading.Event(), []

    def held(text, *args, **kwargs):
        calls.append(text)
        entered.set()
        release.wait(60)
        return encode(text, *args, **kwargs)

    tokenizer.encode = held
    yield entered, release, calls
    release.set()
    del tokenizer.encode  # the class's method again


@pytest.mark.parametrize(
    "route, body",
    [
        ("/tokenize", {"content": "hello there"}),
        ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    ],
)
def test_tokenising_leaves_the_server_answering(server, http, held_tokenizer, route, body):
    """While a request's text is being tokenised (held here until released), the event loop answers
    other requests: tokenising runs in a thread."""
    entered, release, _ = held_tokenizer
    answer = []
    thread = threading.Thread(target=lambda: answer.append(_post(http, route, body)))
    thread.start()
    try:
        assert entered.wait(30)
        with httpx.Client(base_url=server.base, timeout=30) as other:
            assert other.get("/health").status_code == 200
            assert other.get("/v1/models").status_code == 200
        assert not release.is_set() and thread.is_alive()  # the first is still tokenising
    finally:
        release.set()
        thread.join(60)
    assert answer[0].status_code == 200, answer[0].text[:300]


def test_the_event_loop_runs_while_a_long_text_is_tokenised(server):
    """Tokenising in a thread is not enough: the tokenizer must let go of the GIL meanwhile (the
    `tokenizers` package's `encode` keeps it, `encode_batch` does not). An event loop ticking every
    millisecond is never held up for long while a megabyte of text is tokenised beside it."""
    import asyncio

    tokenizer = server.state.model.tokenizer
    text = "Hello world, the quick brown fox jumps over the lazy dog. " * 18000

    async def tokenise_beside_a_ticker() -> tuple[float, float]:
        done, worst = False, 0.0

        async def ticker() -> None:
            nonlocal worst
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.001)
                worst, last = max(worst, time.perf_counter() - last), time.perf_counter()

        ticks = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        ids = await asyncio.to_thread(tokenizer.encode, text)
        seconds, done = time.perf_counter() - start, True
        await ticks
        assert len(ids) > 100_000
        return seconds, worst

    seconds, worst = asyncio.run(tokenise_beside_a_ticker())
    assert worst < seconds / 4, (seconds, worst)  # held, the loop would wait the whole time


def test_a_prompt_too_long_for_any_tokenisation_is_refused_untokenised(server, http, held_tokenizer):
    _, release, calls = held_tokenizer
    release.set()
    most = 256 * chars_per_token(server.state.model.tokenizer)
    error = _error(_post(http, "/v1/completions", {"prompt": "a" * (most + 1), "max_tokens": 1}), 400)
    assert str(most + 1) in error["message"] and str(most) in error["message"]
    assert error["param"] == "prompt" and calls == []
    long_message = [{"role": "user", "content": "a" * most}]  # the template's text adds to it
    error = _error(_post(http, "/v1/chat/completions", {"messages": long_message}), 400)
    assert error["param"] == "messages" and calls == []
    # within the bound it is tokenised, and its tokens are what refuse it
    error = _error(_post(http, "/v1/completions", {"prompt": "a " * 300, "max_tokens": 1}), 400)
    assert calls == ["a " * 300] and "600" in error["message"] and "256" in error["message"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_token_stands_for_more_characters_than_the_bound(tmp_path, variant):
    """The bound's premise, on each kind of vocabulary the tests build: a text of n characters takes
    at least n / chars_per_token tokens. Tried where it is tightest (each token's own text, repeated)
    and on random text with special tokens, accents and emoji."""
    backend, config = VARIANTS[variant]
    tokenizer = Tokenizer.from_hf_dir(save_hf_dir(backend(), tmp_path, **config))
    per_token = chars_per_token(tokenizer)
    assert per_token > 0
    rng = random.Random(0)
    texts = [tokenizer.decode([i], skip_special_tokens=False) * 3 for i in range(tokenizer.vocab_size)]
    texts += [random_text(rng, 60) for _ in range(300)]
    texts += ["e\u0301" * 50, "\u1100\u1161" * 40, " " * 200, "\n" * 100]  # combining marks, jamo
    for text in texts:
        assert len(text) <= per_token * len(tokenizer.encode(text, add_special_tokens=False)), text


# --- shutting down ---


def test_shutdown_drains_then_ends_running_streams_with_an_error(checkpoint):
    """close() (what SIGTERM does to `moerun serve`): a short request finishes within the drain; a
    long stream and a long whole request still running when it ends get the error (a chunk, then
    [DONE]; a 503); the server stops soon after."""
    running = start(moerun.load(checkpoint, dtype=torch.float32), ctx_size=256, drain_s=3.0)
    step = running.state.scheduler.batch.step

    def slow_step():  # 200 tokens take 40 s: far past the drain
        time.sleep(0.2)
        return step()

    running.state.scheduler.batch.step = slow_step
    results: dict = {}
    body = {"prompt": "hello", "max_tokens": 200, "temperature": 0}

    def stream():
        with (
            httpx.Client(base_url=running.base, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            results["stream"] = [line for line in r.iter_lines() if line]

    def whole(name, max_tokens):
        with httpx.Client(base_url=running.base, timeout=60) as http:
            results[name] = http.post("/v1/completions", json={**body, "max_tokens": max_tokens})

    threads = [
        threading.Thread(target=stream),
        threading.Thread(target=whole, args=("whole", 200)),
        threading.Thread(target=whole, args=("short", 2)),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while running.state.scheduler.counters.requests < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running.state.scheduler.counters.requests == 3
    start_s = time.monotonic()
    running.close()
    closed_s = time.monotonic() - start_s
    for thread in threads:
        thread.join(30)
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["message"] == "The server is shutting down." and error["code"] == "shutting_down"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    assert 0 < len(chunks) < 200 and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert _error(results["whole"], 503)["code"] == "shutting_down"
    short = results["short"]
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
    assert 3.0 <= closed_s < 25  # the drain, then the error, not the 40 s the long ones needed


def test_the_drain_timeout_is_checked_before_loading(tmp_path, capsys):
    assert main(["serve", "-m", str(tmp_path / "none"), "--drain-timeout", "-1"]) == 2
    assert "--drain-timeout must be a number of seconds >= 0" in capsys.readouterr().err
