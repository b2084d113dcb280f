"""Tools, earlier calls and their answers through each family's chat template: a conversation as
OpenAI's clients send it (arguments as a JSON string, a calling message's content null, OpenAI's call
ids) renders to the prompt transformers' `apply_chat_template` makes of the same conversation in the
form that template was written for (arguments as an object where the template reads one, the
content as the template tests it), to the token. A template that never writes the tools (DeepSeek's)
gets them in the system message, with its own rendering of a call as the example."""

import hashlib
import json

import pytest
from family_templates import DEEPSEEK_R1, DEEPSEEK_V3, GLM45, GPT_OSS, MISTRAL, QWEN3, QWEN3_THINKING, QWEN25
from tiny_tokenizers import CHATML, byte_level_tokenizer, save_hf_dir
from transformers import AutoTokenizer

from moerun.text import Tokenizer
from moerun.text.chat_tools import template_tools, tool_call_tags
from moerun.text.reasoning import prompt_opens_thinking
from moerun.text.reply import ReplyDelta, ReplyFormat
from moerun.text.tool_calls import ToolRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, café or not.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MARKERS = (
    "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
    "[INST]", "[/INST]", "<s>", "</s>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>",
    "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>",
)  # fmt: skip
# family -> (template, EOS, how its template takes an earlier call: arguments as an object or a
# string, a calling message's content left out or as "")
FAMILIES = {
    "qwen3": (QWEN3, "<|im_end|>", "string", "missing"),
    "qwen2.5": (QWEN25, "<|im_end|>", "object", "missing"),
    "glm-4.5": (GLM45, "<|endoftext|>", "object", "missing"),
    "mistral": (MISTRAL, "</s>", "object", "missing"),
    "gpt-oss": (GPT_OSS, "<|end|>", "object", "missing"),
    "deepseek-v3": (DEEPSEEK_V3, "<｜end▁of▁sentence｜>", "string", "empty"),
    "deepseek-r1": (DEEPSEEK_R1, "<｜end▁of▁sentence｜>", "string", "empty"),
}
ARGUMENTS = {"city": "Paris, café"}


def conversation(arguments_form: str, content_form: str, call_id: str) -> list[dict]:
    """A question, a call, its answer and a next question; OpenAI's shape or a template's."""
    arguments = json.dumps(ARGUMENTS, ensure_ascii=False) if arguments_form == "string" else ARGUMENTS
    calling = {
        "role": "assistant",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }
    if content_form != "missing":
        calling["content"] = None if content_form == "none" else ""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        calling,
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": '{"celsius": 18}'},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (moerun's Tokenizer, transformers' tokenizer) of one directory."""
    out = {}
    for family, (template, eos, _, _) in FAMILIES.items():
        directory = tmp_path_factory.mktemp(family)
        backend = byte_level_tokenizer("qwen2", extra_special=MARKERS)
        config = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=eos, chat_template=template)
        save_hf_dir(backend, directory, **config, **({"bos_token": "<s>"} if family == "mistral" else {}))
        out[family] = (Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(directory))
    return out


CALL_ID = "a1B2c3D4e"  # the 9 letters and digits Mistral's template insists on (and moerun makes for it)


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.startswith("deepseek")])
def test_a_round_trip_renders_as_transformers_renders_it(family, tokenizers):
    ours, theirs = tokenizers[family]
    _, _, arguments, content = FAMILIES[family]
    sent = conversation("string", "none", CALL_ID)  # as OpenAI's client sends it
    expected = theirs.apply_chat_template(
        conversation(arguments, content, CALL_ID), tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert ours.render_chat(sent, tools=[WEATHER]) == expected
    ids = theirs.apply_chat_template(
        conversation(arguments, content, CALL_ID),
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert ours.encode_chat(sent, tools=[WEATHER]) == list(ids)
    assert "Paris, café" in expected and "get_weather" in expected


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-r1"])
def test_a_template_without_tools_gets_them_in_the_system_message(family, tokenizers):
    ours, theirs = tokenizers[family]
    sent = conversation("string", "none", "call_0123456789abcdef")
    # what the template writes for a calling turn, found with transformers
    question = [{"role": "user", "content": "Hello"}]
    call = {"id": "call00001", "type": "function"}
    call["function"] = {"name": "function_name", "arguments": '{"argument_name": "argument value"}'}
    turn = theirs.apply_chat_template(
        [*question, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
    )
    example = turn[turn.index("<｜tool▁calls▁begin｜>") :].removesuffix("<｜end▁of▁sentence｜>")
    system = "\n".join(
        [
            "Be brief.",
            "",
            "You can call these functions, each described by a JSON schema:",
            json.dumps(WEATHER["function"], ensure_ascii=False),
            "",
            "To call a function, write the call in this form:",
            example,
        ]
    )
    told = conversation("string", "empty", "call_0123456789abcdef")
    told[0] = {"role": "system", "content": system}
    expected = theirs.apply_chat_template(told, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(sent, tools=[WEATHER]) == expected


def test_openai_ids_become_the_same_9_characters_on_both_sides(tokenizers):
    ours, _ = tokenizers["mistral"]
    openai_id = "call_abcdefghijklmnopqrstuvwx"
    text = ours.render_chat(conversation("string", "none", openai_id), tools=[WEATHER])
    short = hashlib.sha256(openai_id.encode()).hexdigest()[:9]
    assert text.count(f'"id": "{short}"') == 1 and text.count(f'"call_id": "{short}"') == 1
    assert openai_id not in text


def test_what_each_template_takes(tokenizers):
    """The forms found by rendering agree with what each template's text says it reads."""
    for family, (template, _, arguments, _) in FAMILIES.items():
        caps = template_tools(template, (("eos_token", FAMILIES[family][1]),))
        assert caps.arguments == arguments or family == "qwen3", family  # Qwen3's reads both
        assert caps.renders_tools == (not family.startswith("deepseek")), family
        assert caps.short_ids == (family == "mistral"), family


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "mistral", "gpt-oss", "deepseek-v3"])
def test_a_call_written_as_the_template_writes_it_is_read_back(family, tokenizers):
    ours, _ = tokenizers[family]
    request = ToolRequest.make([WEATHER], "required")
    (form,) = tool_call_tags(ours.chat_template, ours.special_tokens, request)
    before, schema, after = form.before, form.schema, form.after
    assert schema == WEATHER["function"]["parameters"] and form.pairs is None
    fmt = ReplyFormat.of(ours, None)
    parser, reply = (
        fmt.parser(ours.render_chat(conversation("string", "none", CALL_ID)), request),
        ReplyDelta(),
    )
    reply.add(parser.push(before + json.dumps(ARGUMENTS) + after))
    reply.add(parser.finish())
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", ARGUMENTS)]
    assert reply.content == "" and reply.reasoning == ""


def test_glm_calls_are_key_value_pairs_read_back(tokenizers):
    """GLM-4.5's template writes a call's arguments as <arg_key>/<arg_value> pairs: the form found by
    rendering it, filled with the arguments, is read back by GLM's parser as those arguments."""
    ours, _ = tokenizers["glm-4.5"]
    request = ToolRequest.make([WEATHER], "required")
    (form,) = tool_call_tags(ours.chat_template, ours.special_tokens, request)
    assert form.pairs is not None and form.before.endswith("get_weather\n")
    written = "".join(
        form.pairs.key_open
        + k
        + form.pairs.between
        + (v if isinstance(v, str) else json.dumps(v))
        + form.pairs.value_close
        for k, v in ARGUMENTS.items()
    )
    parser, reply = (
        ReplyFormat.of(ours, None).parser(ours.render_chat(conversation("string", "none", CALL_ID)), request),
        ReplyDelta(),
    )
    reply.add(parser.push(form.before + written + form.after))
    reply.add(parser.finish())
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", ARGUMENTS)]


def test_a_template_that_knows_no_tools_still_renders_a_round_trip(tmp_path):
    directory = save_hf_dir(
        byte_level_tokenizer("qwen2"), tmp_path, eos_token="<|im_end|>", chat_template=CHATML
    )
    ours, theirs = Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(directory)
    text = ours.render_chat(conversation("string", "none", CALL_ID), tools=[WEATHER])
    told = conversation("string", "empty", CALL_ID)
    told[0]["content"] += "\n\nYou can call these functions, each described by a JSON schema:\n"
    told[0]["content"] += json.dumps(WEATHER["function"], ensure_ascii=False)
    assert text == theirs.apply_chat_template(told, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize(
    "template, variables, opened",
    [
        (QWEN3, {}, False),
        (QWEN3, {"enable_thinking": False}, False),
        (QWEN3_THINKING, {}, True),
        (DEEPSEEK_R1, {}, True),
        (DEEPSEEK_V3, {}, False),
        (GLM45, {"enable_thinking": False}, False),
    ],
)
def test_a_prompt_that_opens_the_reasoning(template, variables, opened, tmp_path):
    """The prompt transformers renders says whether the reply starts inside <think>."""
    directory = save_hf_dir(
        byte_level_tokenizer("qwen2"), tmp_path, eos_token="<|im_end|>", chat_template=template
    )
    question = [{"role": "user", "content": "Hi"}]
    prompt = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        question, add_generation_prompt=True, tokenize=False, **variables
    )
    assert prompt_opens_thinking(prompt) == opened
    reply = ReplyFormat.of(Tokenizer.from_hf_dir(directory), None).parser(prompt).push("Hmm.</think>Hello")
    assert (reply.reasoning, reply.content) == (("Hmm.", "Hello") if opened else ("", "Hmm.</think>Hello"))
