"""Each family's reply read into reasoning, answer and tool calls: known replies written in the syntax
each family documents (the formats vLLM's tool parsers and llama.cpp's chat parsers read), with the
parts written out by hand; whole, and cut at every point (and a character at a time), the pieces
joining to the same reply. Text that is not a valid call comes back as the answer's text."""

import json

import jsonschema
import pytest
from family_templates import DEEPSEEK_R1, GLM45, GPT_OSS, QWEN3, QWEN25
from family_templates import MISTRAL as MISTRAL_TEMPLATE
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_tokenizers import byte_level_tokenizer
from tokenizers import AddedToken

from moerun.batching import TextRelease, Token
from moerun.text import Tokenizer
from moerun.text.reply import ReplyDelta, ReplyFormat
from moerun.text.tool_calls import SYNTAXES, ToolRequest, ToolRequestError, tool_call_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = ToolRequest.make([WEATHER, TIME])

QWEN = ReplyFormat(thinking=True, tools=SYNTAXES["tagged"])
MISTRAL = ReplyFormat(tools=SYNTAXES["mistral"])
DEEPSEEK = ReplyFormat(thinking=True, tools=SYNTAXES["deepseek"])
HARMONY = ReplyFormat(harmony=True)

# (format, prompt's end, reply, expected reasoning, answer, [(name, arguments)])
CASES = {
    "qwen3 thinking then two calls": (
        QWEN,
        "<|im_start|>assistant\n",
        '<think>\nThe user wants the weather in Paris and Rome.\n</think>\n\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Rome", "days": 3}}\n</tool_call>',
        "The user wants the weather in Paris and Rome.",
        "",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 3})],
    ),
    "qwen2.5 text before a call": (
        QWEN,
        "",
        'Let me look that up.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "",
        "Let me look that up.",
        [("get_time", {})],
    ),
    "qwen3 thinking model, the prompt opened <think>": (
        QWEN,
        "<|im_start|>assistant\n<think>\n",
        "Plain question, café.\n</think>\n\nIt is 3 o'clock, café.",
        "Plain question, café.",
        "It is 3 o'clock, café.",
        [],
    ),
    "qwen3 with thinking off": (
        QWEN,
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Hello! <think> is only text here.",
        "",
        "Hello! <think> is only text here.",
        [],
    ),
    "qwen3-coder xml call": (
        QWEN,
        "",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "New York", "days": 2})],
    ),
    "glm-4.5 arg pairs": (
        QWEN,
        "<|assistant|>",
        "\n<think>Need the weather.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
        "Need the weather.",
        "Checking.",
        [("get_weather", {"city": "Beijing", "days": 5})],
    ),
    "a call that is not json is text": (
        QWEN,
        "",
        "Try <tool_call>{get_weather: Paris}</tool_call> later",
        "",
        "Try <tool_call>{get_weather: Paris}</tool_call> later",
        [],
    ),
    "a call cut off by the end is read": (
        QWEN,
        "",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        "",
        "",
        [("get_time", {})],
    ),
    "reasoning cut off by the end": (
        QWEN,
        "",
        "<think>\nStill thinking about",
        "Still thinking about",
        "",
        [],
    ),
    "mistral v0.3 list": (
        MISTRAL,
        "[/INST]",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
        '"arguments": {}}]',
        "",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    "mistral name[ARGS] calls": (
        MISTRAL,
        "[/INST]",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e'
        '[ARGS]{"city": "Oslo", "days": 1}',
        "",
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 1})],
    ),
    "mistral broken list is text": (
        MISTRAL,
        "",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ',
        "",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ',
        [],
    ),
    "deepseek-v3 calls": (
        DEEPSEEK,
        "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        "",
        [("get_weather", {"city": "Beijing"}), ("get_time", {})],
    ),
    "deepseek-r1 reasoning, then a v3.1 call": (
        DEEPSEEK,
        "<｜Assistant｜><think>\n",
        "The user asks for Tokyo.\n</think>\n\nOne moment.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        'get_weather<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "The user asks for Tokyo.",
        "One moment.",
        [("get_weather", {"city": "Tokyo"})],
    ),
    "gpt-oss call after analysis": (
        HARMONY,
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Need to call get_weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"San Francisco"}<|call|>',
        "Need to call get_weather.",
        "",
        [("get_weather", {"city": "San Francisco"})],
    ),
    "gpt-oss recipient in the role header": (
        HARMONY,
        "<|start|>assistant",
        " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        "",
        "",
        [("get_time", {})],
    ),
    "gpt-oss answer": (
        HARMONY,
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hi, café!"
        "<|return|>",
        "Say hi.",
        "Hi, café!",
        [],
    ),
}


def _read(fmt, prompt, pieces, tools=TOOLS) -> ReplyDelta:
    parser, reply = fmt.parser(prompt, tools), ReplyDelta()
    for piece in pieces:
        reply.add(parser.push(piece))
    reply.add(parser.finish())
    return reply


def _parts(reply: ReplyDelta):
    return reply.reasoning, reply.content, [(c.name, json.loads(c.arguments)) for c in reply.calls]


@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_whole_and_cut_anywhere(case):
    fmt, prompt, text, reasoning, content, calls = CASES[case]
    expected = (reasoning, content, calls)
    assert _parts(_read(fmt, prompt, [text])) == expected
    assert _parts(_read(fmt, prompt, list(text))) == expected
    for cut in range(len(text) + 1):
        assert _parts(_read(fmt, prompt, [text[:cut], text[cut:]])) == expected, cut


def test_calls_have_ids_and_arguments_as_json_text():
    reply = _read(*CASES["mistral name[ARGS] calls"][:2], [CASES["mistral name[ARGS] calls"][2]])
    assert [len(c.id) for c in reply.calls] == [9, 9] and all(c.id.isalnum() for c in reply.calls)
    reply = _read(QWEN, "", [CASES["qwen2.5 text before a call"][2]])
    call = reply.calls[0]
    assert call.id.startswith("call_") and call.arguments == "{}"


def test_without_tools_or_under_none_the_calls_stay_text():
    fmt, prompt, text = CASES["qwen2.5 text before a call"][:3]
    none = ToolRequest.make([WEATHER, TIME], "none")
    for tools in (None, none):
        assert _parts(_read(fmt, prompt, [text], tools)) == ("", text, [])


def test_parallel_tool_calls_false_keeps_the_first():
    fmt, prompt, text = CASES["qwen3 thinking then two calls"][:3]
    one = ToolRequest.make([WEATHER, TIME], "auto", False)
    assert [c.name for c in _read(fmt, prompt, [text], one).calls] == ["get_weather"]
    assert json.loads(_read(fmt, prompt, [text], one).calls[0].arguments) == {"city": "Paris"}


def test_glm_values_follow_the_schema():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    assert _parts(_read(QWEN, "", [text]))[2] == [("get_weather", {"city": "42"})]  # a string in the schema


@pytest.mark.parametrize(
    "tools, choice, parallel, param",
    [
        ({"type": "function"}, None, None, "tools"),
        ([{"type": "retrieval"}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, None, "tools"),
        ([WEATHER, WEATHER], None, None, "tools"),
        ([WEATHER], "sometimes", None, "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None, "tool_choice"),
        ([WEATHER], {"function": "get_weather"}, None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        ([WEATHER], None, "yes", "parallel_tool_calls"),
    ],
)
def test_malformed_tool_requests_are_named(tools, choice, parallel, param):
    with pytest.raises(ToolRequestError) as e:
        ToolRequest.make(tools, choice, parallel)
    assert e.value.param == param and str(e.value).endswith(".")


def test_the_schema_a_constrained_call_must_match():
    assert tool_call_schema(ToolRequest.make([WEATHER, TIME])) is None  # auto: the model's choice
    named = tool_call_schema(
        ToolRequest.make([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    )
    jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, named)
    required = tool_call_schema(ToolRequest.make([WEATHER, TIME], "required"))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, required)
    for bad in ({"name": "get_weather", "arguments": {"days": 2}}, {"name": "other", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


def _tokenizer(template: str, special=(), added=()) -> Tokenizer:
    backend = byte_level_tokenizer("qwen2", extra_special=special)
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    return Tokenizer(backend, special={"eos_token": "<|im_end|>"}, chat_template=template)


@pytest.mark.parametrize(
    "template, special, family, harmony, thinking, syntax",
    [
        (QWEN3, (), "qwen3_moe", False, True, "tagged"),
        (QWEN25, (), "qwen2_moe", False, False, "tagged"),
        (GLM45, (), "glm4_moe", False, True, "tagged"),
        (MISTRAL_TEMPLATE, ("[TOOL_CALLS]",), "mixtral", False, False, "mistral"),
        (DEEPSEEK_R1, (), "deepseek_v3", False, True, "deepseek"),
        ("{{ messages[0].content }}", (), "deepseek_v3", False, False, "deepseek"),  # by family
        ("{{ messages[0].content }}", ("[TOOL_CALLS]",), "olmoe", False, False, "mistral"),  # by vocabulary
        ("{{ messages[0].content }}", (), "olmoe", False, False, None),
        (GPT_OSS, ("<|start|>", "<|end|>", "<|message|>", "<|channel|>"), "gpt_oss", True, False, None),
    ],
)
def test_the_format_comes_from_template_vocabulary_and_family(
    template, special, family, harmony, thinking, syntax
):
    fmt = ReplyFormat.of(_tokenizer(template, special), family)
    assert (fmt.harmony, fmt.thinking, fmt.tools.name if fmt.tools else None) == (harmony, thinking, syntax)
    assert fmt.calls_tools() == (harmony or syntax is not None)


def test_special_markers_are_read_from_the_released_tokens():
    """Mistral's [TOOL_CALLS] is a special token: decoding leaves it out, the parser puts it back."""
    tokenizer = _tokenizer(MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "[ARGS]"))
    fmt = ReplyFormat.of(tokenizer, "mixtral")
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}<|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "[TOOL_CALLS]" not in tokenizer.decode(ids)
    for stops in ([], ["\n\n"]):  # stop strings hold text back, so tokens come out in groups
        release, parser, reply = TextRelease(tokenizer, stops), fmt.parser("", TOOLS), ReplyDelta()
        for i, token_id in enumerate(ids):
            released, _ = release.push(Token(token_id), i == len(ids) - 1)
            reply.add(parser.push_tokens(released))
        reply.add(parser.finish())
        assert _parts(reply) == ("", "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})])


PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<function=get_time>", "<parameter=city>", "</parameter>", "</function>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|start|>", "<|channel|>",
    "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>", "analysis", "final",
    "commentary", " to=functions.get_time", "function", "get_weather", "\n```json\n", "\n```",
    '{"name": "get_time", "arguments": {}}', '{"city": "Oslo"}', "{", "}", "[", "]", '"', "\n", " ",
    "<", "|", "text", "é", "🙂",
]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    fmt=st.sampled_from([QWEN, MISTRAL, DEEPSEEK, HARMONY]),
    opened=st.booleans(),
)
def test_any_text_reads_the_same_in_any_pieces(pieces, cuts, fmt, opened):
    text = "".join(pieces)
    prompt = "<think>\n" if opened else ""
    whole = _parts(_read(fmt, prompt, [text]))
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    split = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _parts(_read(fmt, prompt, split)) == whole
    assert _parts(_read(fmt, prompt, list(text))) == whole
    reasoning, content, calls = whole
    # without calls or reasoning, the text is the answer as it came (DeepSeek's list brackets aside)
    brackets = fmt is DEEPSEEK and "tool▁calls▁" in text
    if not (calls or opened or fmt.harmony or "think>" in text or brackets):
        assert content == text
