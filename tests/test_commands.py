"""`moerun generate` and `moerun chat` on a tiny model saved with a real tokenizer and template."""

import json

import pytest
import torch
from hf_models import make_model, save_model
from tiny_tokenizers import CHATML, byte_level_tokenizer, save_hf_dir

import moerun
from moerun.cli.chat import run_chat
from moerun.cli.main import main
from moerun.text import ChatTemplateError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatml")
    tok = byte_level_tokenizer("qwen2")
    save_hf_dir(
        tok, path, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|im_end|>", chat_template=CHATML
    )
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size()), path)
    return path


def _generate(checkpoint, capsys, *extra):
    args = ["generate", "--model", str(checkpoint), "--prompt", "hello café", "--dtype", "fp32", *extra]
    assert main(args) == 0
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
    model, system, max_tokens = "tiny", None, 6
    temperature, top_k, top_p, min_p, repeat_penalty, seed, stop = 0.0, 0, 1.0, 0.0, 1.0, None, []


def test_chat_keeps_the_conversation_and_survives_ctrl_c(checkpoint, capsys):
    model = moerun.load(checkpoint, dtype=torch.float32)
    prompts, real_generate = [], model.generate

    def spy(prompt, **kw):  # the second reply is interrupted after one token
        prompts.append(prompt)
        for i, token in enumerate(real_generate(prompt, **kw)):
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
