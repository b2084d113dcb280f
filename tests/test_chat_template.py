"""Chat templates rendered as transformers' `apply_chat_template` renders them, for templates in the
styles models ship (ChatML, Llama 2 with its raise_exception checks, one using the sandbox's extras),
and the errors a user gets for a bad template or a model without one."""

from __future__ import annotations

import datetime

import pytest
from jinja2.exceptions import TemplateError
from tiny_tokenizers import CHATML, SPM_CONFIG, byte_level_tokenizer, save_hf_dir, sentencepiece_tokenizer
from transformers import AutoTokenizer

from moerun.text import ChatTemplateError, Tokenizer, render_chat

# Llama 2's template as its tokenizer_config.json ships it.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# The sandbox's extras: tojson (non-ASCII kept, indent), namespace, loop controls, strftime_now, the
# {% generation %} block, tools passed as None, reasoning fields, undefined special tokens.
EXTRAS = """{%- set ns = namespace(n=0) -%}
{%- for message in messages -%}
  {%- if message.role == 'stop' %}{% break %}{% endif -%}
  {%- if message.content is not defined or message.content == '' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  <{{ message.role }}>{{ message.content | tojson }}
  {%- if message.reasoning_content is defined %}
 [{{ message.reasoning_content }}|{{ message.thinking }}]
  {%- endif %}
  {%- if message.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor -%}
{{ {'count': ns.n, 'tools': tools, 'meta': {'ключ': 'значение'}} | tojson(indent=2) }}
{{ 'bos:' ~ (bos_token if bos_token is defined else 'undefined') }}
{%- if tools is not none %} TOOLS{% endif %}
{{ strftime_now('%Y') }}
    {% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Café? 日本語 🙂"}],
    [
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "system", "content": 'You answer in JSON: {"a": 1}'},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two", "reasoning_content": "thinking..."},
        {"role": "user", "content": "Three <s> </s> <|im_end|>"},
    ],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        "chatml": save_hf_dir(
            byte_level_tokenizer("qwen2"), root / "chatml", eos_token="<|im_end|>", chat_template=CHATML
        ),
        "llama2": save_hf_dir(sentencepiece_tokenizer(), root / "llama2", chat_template=LLAMA2, **SPM_CONFIG),
        "extras": save_hf_dir(
            byte_level_tokenizer("gpt2"), root / "extras", eos_token="<|endoftext|>", chat_template=EXTRAS
        ),
        "none": save_hf_dir(byte_level_tokenizer("gpt2"), root / "none", eos_token="<|endoftext|>"),
    }


@pytest.mark.parametrize("name", ["chatml", "llama2", "extras"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_like_apply_chat_template(dirs, name, generation_prompt):
    ours, ref = Tokenizer.from_hf_dir(dirs[name]), AutoTokenizer.from_pretrained(dirs[name])
    for messages in CONVERSATIONS:
        if name == "llama2" and messages[-1]["role"] != "user":
            continue
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == expected
        ids = ref.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) == ids


def test_extras_render_as_documented(dirs):
    text = Tokenizer.from_hf_dir(dirs["extras"]).render_chat(
        [
            {"role": "user", "content": "naïve 日本"},
            {"role": "assistant", "content": "ok", "reasoning": "hm"},
            {"role": "user", "content": None},
            {"role": "stop", "content": "x"},
            {"role": "user", "content": "never"},
        ]
    )
    assert '<user>"naïve 日本"' in text  # tojson keeps non-ASCII
    assert '<assistant>"ok" [hm|hm]<|endoftext|>' in text  # reasoning aliased; generation block rendered
    assert "never" not in text and '"count": 2' in text and '"ключ": "значение"' in text
    assert '\n  "tools": null' in text  # tools=None is passed, and tojson indents
    assert "bos:undefined" in text and "TOOLS" not in text  # no BOS token: left undefined, not "None"
    assert str(datetime.date.today().year) in text and text.endswith("<assistant>")


def test_raise_exception(dirs):
    ours, ref = Tokenizer.from_hf_dir(dirs["llama2"]), AutoTokenizer.from_pretrained(dirs["llama2"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="must alternate"):
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"chat template of .*llama2 refused .*must alternate"):
        ours.render_chat(messages)


def test_no_template(dirs):
    with pytest.raises(ChatTemplateError, match=r"none has no chat template.*tokenizer_config.json"):
        Tokenizer.from_hf_dir(dirs["none"]).render_chat(CONVERSATIONS[0])


def test_bad_templates():
    messages = CONVERSATIONS[0]
    with pytest.raises(ChatTemplateError, match=r"model X is not valid Jinja \(line 1\)"):
        render_chat("{% for m in messages %}", messages, source="model X")
    # The sandbox: no attributes leading to interpreter internals, none stored on a namespace.
    with pytest.raises(ChatTemplateError, match="refused"):
        render_chat("{{ messages.__class__.__mro__ }}", messages)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat("{% set ns = namespace() %}{% set ns._x = 1 %}", messages)
    with pytest.raises(ChatTemplateError, match="immutable|refused"):
        render_chat("{{ messages.append(1) }}", messages)
    with pytest.raises(ChatTemplateError, match="no messages"):
        render_chat("x", [])


def test_messages_left_unchanged():
    messages = [{"role": "user", "content": "hi", "reasoning_content": None}]
    render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", messages)
    assert messages == [{"role": "user", "content": "hi", "reasoning_content": None}]
