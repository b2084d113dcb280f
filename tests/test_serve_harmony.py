"""gpt-oss's reasoning channel through the server: a reply in OpenAI's harmony format comes back
with the analysis channel as `reasoning_content` and the final channel as `content`, whole and
streamed. The model's own choice is scripted (its logits replaced by the reply's ids, one a step),
so the test is of the server's reading of the format; the parser also runs on moerun's text
stream of the same ids."""

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
from moerun.serve.server import start  # noqa: E402

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly, café.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there, café!<|return|>"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony")
    tok = byte_level_tokenizer("qwen2", extra_special=tuple(MARKERS))
    save_hf_dir(
        tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|return|>", chat_template=TEMPLATE
    )
    save_model(make_model("gpt_oss", vocab_size=tok.get_vocab_size()), path)
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
    model = moerun.load(checkpoint, dtype=torch.float32)
    script = model.tokenizer.encode(REPLY, add_special_tokens=False)
    vocab = model.config.vocab_size
    step = {"n": 0}

    def scripted_logits(hidden):  # one sequence at a time: the k-th call picks the reply's k-th id
        logits = torch.full((vocab,), -1e4)
        logits[script[min(step["n"], len(script) - 1)]] = 0.0
        step["n"] += 1
        return logits

    model.hidden_logits = scripted_logits
    running = start(model, model_name="gpt-oss-tiny", parallel=1)
    running.reset = lambda: step.update(n=0)
    yield running
    running.close()


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 0}


def test_the_reasoning_comes_apart_from_the_answer(server):
    server.reset()
    with httpx.Client(base_url=server.base, timeout=30) as http:
        reply = http.post("/v1/chat/completions", json=BODY).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets; answer briefly, café."
    assert message["content"] == "Hello there, café!"
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_streamed_the_reasoning_comes_as_its_own_deltas(server):
    server.reset()

    reasoning = content = ""
    body = {**BODY, "stream": True}
    with (
        httpx.Client(base_url=server.base, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert reasoning == "The user greets; answer briefly, café."
    assert content == "Hello there, café!"


def test_a_tokenizer_without_the_markers_is_not_split():
    assert not ReplyFormat.of(None).harmony
