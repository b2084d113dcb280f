"""`moerun generate` and `moerun chat` on a tiny model saved with a real tokenizer and template."""

import io
import json

import pytest
import torch
from hf_models import chatml_checkpoint, make_model, save_model
from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

import moerun
from moerun.cli.chat import run_chat
from moerun.cli.main import main
from moerun.text import ChatTemplateError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chatml_checkpoint(tmp_path_factory.mktemp("chatml"))


def _generate(checkpoint, capsys, *extra, expect=0):
    args = ["generate", "--model", str(checkpoint), "--prompt", "hello café", "--dtype", "fp32", *extra]
    assert main(args) == expect
    return capsys.readouterr()


def test_generate_streams_the_models_text_and_prints_figures(checkpoint, capsys):
    out = _generate(checkpoint, capsys, "--max-tokens", "12")
    expected = "".join(
        t.text for t in moerun.load(checkpoint, dtype=torch.float32).generate("hello café", 12)
    )
    assert out.out == expected + "\n"
    assert "tok/s decode" in out.err and "loaded" in out.err


def test_generate_json_record_and_seeded_sampling(checkpoint, capsys):
    flags = ["--max-tokens", "10", "--temperature", "1.2", "--top-k", "50", "--seed", "3", "--json"]
    first = json.loads(_generate(checkpoint, capsys, *flags).out)
    again = json.loads(_generate(checkpoint, capsys, *flags).out)
    assert first["ids"] == again["ids"] and first["text"] == again["text"]
    assert first["stats"]["new_tokens"] == len(first["ids"])


def test_generate_chat_flag_uses_the_template(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "hello café"}])
    expected = "".join(t.text for t in model.generate(ids, 8))
    assert _generate(checkpoint, capsys, "--max-tokens", "8", "--chat").out == expected + "\n"


class Args:
    command, model, system, max_tokens, ctx_size, ctx_size_default = "chat", "tiny", None, 6, None, None
    temperature, top_k, top_p, min_p, repeat_penalty, seed, stop = 0.0, 0, 1.0, 0.0, 1.0, None, []
    presence_penalty = frequency_penalty = 0.0
    chat_template_kwargs, hide_reasoning = None, False

    def __init__(self, **values):
        self.__dict__.update(values)


def test_chat_keeps_the_conversation_and_survives_ctrl_c(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompts, real_generate = [], model.generate

    def spy(prompt, max_new_tokens=None, **kw):  # the second reply is interrupted after one token
        prompts.append(prompt)
        for i, token in enumerate(real_generate(prompt, max_new_tokens, **kw)):
            if len(prompts) == 2 and i == 1:
                raise KeyboardInterrupt
            yield token

    model.generate = spy
    lines = iter(["hi there", "and then?", "last one"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert run_chat(model, Args(), read) == 0
    assert len(prompts) == 3
    reused = model.stats()["reused_tokens"]  # of the third turn
    first_reply = "".join(t.text for t in real_generate(prompts[0], max_new_tokens=6))
    second_partial = "".join(t.text for t in list(real_generate(prompts[1], max_new_tokens=6))[:1])
    expected = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": second_partial},
        {"role": "user", "content": "last one"},
    ]
    assert prompts[2] == model.tokenizer.encode_chat(expected)
    # the third turn prefilled only what the interrupted second one had not computed
    assert 0 < reused < len(prompts[2])
    assert "[stopped]" in capsys.readouterr().err


def test_chat_without_a_template_is_refused(tmp_path):
    save_hf_dir(byte_level_tokenizer("gpt2"), tmp_path, tokenizer_class="PreTrainedTokenizerFast")
    save_model(make_model("olmoe", vocab_size=byte_level_tokenizer("gpt2").get_vocab_size()), tmp_path)
    model = moerun.load(tmp_path, dtype=torch.float32)
    with pytest.raises(ChatTemplateError):
        run_chat(model, Args(), lambda _: "hello")
    assert main(["chat", "--model", str(tmp_path), "--dtype", "fp32"]) == 2


def _lines(read_lines):
    lines = iter(read_lines)

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    return read


def _recording(model):
    prompts, real_generate = [], model.generate

    def spy(prompt, max_new_tokens=None, **kw):
        prompts.append(prompt)
        return real_generate(prompt, max_new_tokens, **kw)

    model.generate = spy
    return prompts


def test_chat_reset_and_help(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompts = _recording(model)
    read = _lines(["hi there", "/help", "/reset", "again"])
    assert run_chat(model, Args(system="be brief"), read) == 0
    assert prompts[1] == model.tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "again"}]
    )
    err = capsys.readouterr().err
    assert "/reset" in err and "/exit" in err and "reset" in err.splitlines()[-2]


def test_chat_keeps_going_when_the_context_is_full(checkpoint, capsys):
    """A context that holds about two turns (each is ~50 tokens with the template): the oldest
    turns are dropped, the user is told, and every prompt leaves room for a reply."""
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompts = _recording(model)
    turns = ["tell me a story", "and then what happened", "why", "go on", "the end?"]
    ctx = 2 * len(model.tokenizer.encode_chat([{"role": "user", "content": turns[1]}])) + 8
    assert run_chat(model, Args(ctx_size=ctx, max_tokens=8), _lines(turns)) == 0
    assert len(prompts) == len(turns)
    assert all(len(p) <= ctx - 8 for p in prompts)
    last = model.tokenizer.decode(prompts[-1])
    assert turns[-1] in last and turns[0] not in last
    assert "oldest" in capsys.readouterr().err


def test_a_ctx_size_past_the_models_context_is_one_sentence(checkpoint, capsys, tmp_path):
    """--ctx-size is checked against the model's context once it is loaded, in one sentence naming
    both numbers, by every command that has it (the tiny model's context is 256)."""
    expected = "--ctx-size must be between 1 and this model's context of 256 positions, got 300."
    err = _generate(checkpoint, capsys, "-c", "300", expect=2).err
    assert err.strip().splitlines()[-1] == f"moerun generate: {expected}"
    text = tmp_path / "text.txt"
    text.write_text("hello café " * 20)
    assert main(["perplexity", "-m", str(checkpoint), "-f", str(text), "-c", "300", "--dtype", "fp32"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"moerun perplexity: {expected}"

    def read(prompt):
        raise AssertionError("chat read a line before checking its context")

    model = moerun.load(checkpoint, dtype=torch.float32)
    with pytest.raises(ValueError) as refusal:
        run_chat(model, Args(ctx_size=300), read)
    assert str(refusal.value) == expected


def _json(checkpoint, capsys, *flags):
    return json.loads(_generate(checkpoint, capsys, "--json", *flags).out)


def test_finish_reason_length_and_context(checkpoint, capsys):
    record = _json(checkpoint, capsys, "-n", "3")
    assert record["finish_reason"] == "length" and len(record["ids"]) == 3
    prompt = moerun.load(checkpoint, dtype=torch.float32).tokenizer.encode("hello café")
    record = _json(checkpoint, capsys, "-n", "-1", "-c", str(len(prompt) + 5))
    assert record["finish_reason"] == "context" and len(record["ids"]) == 5
    assert record["stats"]["finish_reason"] == "context"


def test_max_tokens_minus_one_runs_to_the_end_of_the_context(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    out = _generate(checkpoint, capsys, "-n", "-1")
    ids = [t.id for t in model.generate("hello café", None)]
    assert len(model.tokenizer.encode("hello café")) + len(ids) == model.config.max_positions
    assert out.out == model.tokenizer.decode(ids) + "\n"
    assert "context of 256 positions is full" in out.err


def test_after_a_stop_string_ids_and_text_agree(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    full = [t.id for t in model.generate("hello café", 30)]
    text = model.tokenizer.decode(full)
    checked = 0
    for cut in range(2, len(text) - 3, 3):  # stop strings starting all over the text, many across tokens
        stop = text[cut : cut + 3]
        record = _json(checkpoint, capsys, "-n", "30", "--stop", stop)
        assert record["finish_reason"] == "stop" and record["text"] == text[: text.index(stop)]
        decoded = model.tokenizer.decode(record["ids"])
        assert record["ids"] == full[: len(record["ids"])]
        # the ids decode to the text, then at most the part of the stop string inside the last token
        assert decoded.startswith(record["text"])
        assert stop.startswith(decoded[len(record["text"]) :]) and len(decoded) < text.index(stop) + len(stop)
        checked += 1
    assert checked >= 5


def test_ctrl_c_in_generate_prints_the_figures_and_exits_130(checkpoint, capsys, monkeypatch):
    real_generate = moerun.MoEModel.generate

    def interrupted(self, prompt, max_new_tokens=128, **options):
        for i, token in enumerate(real_generate(self, prompt, max_new_tokens, **options)):
            if i == 3:
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(moerun.MoEModel, "generate", interrupted)
    out = _generate(checkpoint, capsys, "-n", "10", expect=130)
    model = moerun.load(checkpoint, dtype=torch.float32)
    expected = "".join(t.text for t in list(real_generate(model, "hello café", 10))[:3])
    assert out.out == expected + "\n"
    assert "Traceback" not in out.err and "[stopped]" in out.err and "generated" in out.err
    record = json.loads(_generate(checkpoint, capsys, "-n", "10", "--json", expect=130).out)
    assert record["finish_reason"] == "interrupted" and len(record["ids"]) == 3


def test_prompt_from_a_file_and_stdin(checkpoint, capsys, tmp_path, monkeypatch):
    expected = _generate(checkpoint, capsys, "-n", "6").out
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello café", encoding="utf-8")
    args = ["generate", "-m", str(checkpoint), "--dtype", "fp32", "-n", "6"]
    assert main([*args, "-f", str(prompt)]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr("sys.stdin", io.StringIO("hello café"))
    assert main([*args, "-f", "-"]) == 0
    assert capsys.readouterr().out == expected


def test_prompt_ids_without_a_tokenizer(tmp_path, capsys):
    save_model(make_model("olmoe"), tmp_path)
    args = ["generate", "-m", str(tmp_path), "--dtype", "fp32", "-n", "5", "--json"]
    assert main([*args, "--prompt-ids", "1,2,3"]) == 0
    ids = [t.id for t in moerun.load(tmp_path, dtype=torch.float32).generate([1, 2, 3], 5)]
    assert json.loads(capsys.readouterr().out)["ids"] == ids
    assert main([*args, "-p", "hello"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the "loaded" line
    assert "no tokenizer" in last and "--prompt-ids" in last and "Traceback" not in err


def test_json_logprobs(checkpoint, capsys):
    record = _json(checkpoint, capsys, "-n", "4", "--logprobs", "3")
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompt = model.tokenizer.encode("hello café")
    logits = model.logits(torch.tensor([prompt + record["ids"]]))[0, len(prompt) - 1 : -1].log_softmax(-1)
    for i, entry in enumerate(record["logprobs"]):
        assert entry["id"] == record["ids"][i] and entry["token"] == model.tokenizer.id_to_token(entry["id"])
        assert entry["logprob"] == pytest.approx(float(logits[i, entry["id"]]), abs=1e-4)
        assert [t["id"] for t in entry["top_logprobs"]] == logits[i].topk(3).indices.tolist()


def test_warm_up_runs_before_the_timed_generation_and_no_bar_goes_to_a_file(checkpoint, capsys, monkeypatch):
    calls, real_warm_up, real_generate = [], moerun.MoEModel.warm_up, moerun.MoEModel.generate

    def warm_up(self):
        calls.append("warm_up")
        real_warm_up(self)

    def generate(self, *args, **kwargs):
        calls.append("generate")
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(moerun.MoEModel, "warm_up", warm_up)
    monkeypatch.setattr(moerun.MoEModel, "generate", generate)
    out = _generate(checkpoint, capsys, "-n", "4")
    assert calls == ["warm_up", "generate"]
    lines = out.err.splitlines()  # stderr is not a terminal here: no bar, the placement line then "loaded"
    assert "\r" not in out.err and "fits" in lines[0] and lines[1].startswith("loaded")
    calls.clear()
    _generate(checkpoint, capsys, "-n", "4", "--no-warmup")
    assert calls == ["generate"]


def test_warm_up_leaves_generation_unchanged(checkpoint):
    model, fresh = moerun.load(checkpoint, dtype=torch.float32), moerun.load(checkpoint, dtype=torch.float32)
    model.warm_up()
    assert [t.id for t in model.generate("hello café", 8)] == [t.id for t in fresh.generate("hello café", 8)]


def test_generate_prompts_file_runs_a_batch(checkpoint, capsys, tmp_path):
    """--prompts-file: one record per line, in order, each the tokens the prompt gives alone, with
    --parallel smaller than the batch (the last prompt joins when a sequence finishes)."""
    prompts = ["hello café", "a", "", "The quick brown fox"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    flags = ["--prompts-file", str(tmp_path / "prompts.txt"), "--max-tokens", "6", "--parallel", "2"]
    args = ["generate", "--model", str(checkpoint), "--dtype", "fp32", *flags, "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    model = moerun.load(checkpoint, dtype=torch.float32)
    expected = [[t.id for t in model.generate(p, 6)] for p in prompts if p]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["ids"] for r in records] == expected
    assert "batch of 3 prompts (2 at once)" in captured.err
    assert main(args[:-1]) == 0  # the text form: a header per prompt, then its completion
    text = capsys.readouterr().out
    assert text.count("=== prompt ") == 3 and text.index("prompt 1/3") < text.index("prompt 3/3")


def test_generate_an_empty_prompts_file_is_one_sentence(checkpoint, capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    args = ["generate", "--model", str(checkpoint), "--prompts-file", str(tmp_path / "empty.txt")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no prompts" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory):
    """A tiny Qwen3 model under the thinking template (its prompt opens `<think>`), `</think>` an
    added token, and a grammar that makes its reply reasoning, then `</think>`, then an answer."""
    import family_templates
    from tokenizers import AddedToken

    path = tmp_path_factory.mktemp("thinking")
    tok = byte_level_tokenizer("qwen2")
    tok.add_tokens([AddedToken("</think>", normalized=False, special=False)])
    save_hf_dir(
        tok,
        path,
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token="<|im_end|>",
        chat_template=family_templates.QWEN3_THINKING,
    )
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size()), path)
    (path / "reply.lark").write_text('start: "Let me see." "</think>" "\\n\\nYes."')
    return path


def test_generate_chat_shows_the_reasoning_apart(thinking_checkpoint, capsys):
    pytest.importorskip("llguidance")
    grammar = ["--grammar", str(thinking_checkpoint / "reply.lark")]
    run = [
        "generate",
        "--model",
        str(thinking_checkpoint),
        "--prompt",
        "hi",
        "--dtype",
        "fp32",
        "--chat",
        *grammar,
    ]
    assert main([*run, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == "Let me see.</think>\n\nYes."
    assert record["reasoning_content"] == "Let me see." and record["content"] == "Yes."
    assert main(run) == 0
    assert capsys.readouterr().out == "Thinking...\nLet me see.\n...done thinking.\n\nYes.\n"
    assert main([*run, "--hide-reasoning"]) == 0
    assert capsys.readouterr().out == "Yes.\n"


def test_chat_shows_the_reasoning_apart_and_keeps_the_answer(thinking_checkpoint, capsys):
    pytest.importorskip("llguidance")
    model = moerun.load(thinking_checkpoint, dtype=torch.float32)
    reply = moerun.Grammar.text((thinking_checkpoint / "reply.lark").read_text())
    prompts, real_generate = [], model.generate

    def constrained(prompt, max_new_tokens=None, **kw):
        prompts.append(prompt)
        return real_generate(prompt, max_new_tokens, response_format=reply, **kw)

    model.generate = constrained
    out = io.StringIO()
    assert run_chat(model, Args(max_tokens=40), _lines(["hi", "and?"]), out=out) == 0
    assert out.getvalue().count("Thinking...\nLet me see.\n...done thinking.\n\nYes.\n") == 2
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Let me see."},
        {"role": "user", "content": "and?"},
    ]
    assert prompts[1] == model.tokenizer.encode_chat(turns)


def test_chat_template_kwargs_reach_the_template(thinking_checkpoint):
    """--chat-template-kwargs '{"enable_thinking": false}': Qwen3's template closes an empty
    reasoning in the prompt, which it does not do otherwise."""
    model = moerun.load(thinking_checkpoint, dtype=torch.float32)
    prompts = _recording(model)
    variables = '{"enable_thinking": false}'
    assert run_chat(model, Args(chat_template_kwargs=variables), _lines(["hi"]), out=io.StringIO()) == 0
    turn = [{"role": "user", "content": "hi"}]
    assert prompts[0] == model.tokenizer.encode_chat(turn, enable_thinking=False)
    assert prompts[0] != model.tokenizer.encode_chat(turn)
    with pytest.raises(ValueError, match="JSON object"):
        run_chat(model, Args(chat_template_kwargs="[1]"), _lines(["hi"]))
