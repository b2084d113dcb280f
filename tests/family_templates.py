# ruff: noqa: E501  (templates are data: a line of one is a line of its output)
"""Chat templates in the style each family ships, written for the tests: short, but with the parts
that matter to tools and reasoning done the way the family's own template does them (how the tools
are listed, how an earlier call's arguments are written and what form they must come in, how a tool's
answer is written, what the generation prompt ends with). Each comment says what it keeps."""

# Qwen3: tools in the system turn, calls as <tool_call> JSON; arguments written as they come if a
# string, as JSON if an object; an answered call goes back in a user turn as <tool_response>; an
# earlier turn's reasoning in <think>; `enable_thinking=false` closes an empty <think> in the prompt.
QWEN3 = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for tool in tools %}

{{ tool | tojson }}
{%- endfor %}

</tools>

Call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content is string %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}
{%- if message.content is string %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}

<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

# Qwen3's thinking-only models: the generation prompt opens the reasoning.
QWEN3_THINKING = QWEN3.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n",
)

# Qwen2.5: the same syntax without reasoning, and the arguments always go through tojson (a string
# would be encoded twice).
QWEN25 = (
    QWEN3.replace(
        "{% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}"
        "{{ tool_call.arguments | tojson }}{% endif %}",
        "{{ tool_call.arguments | tojson }}",
    )
    .replace(
        "{% if message.reasoning_content is string %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}\n",
        "",
    )
    .replace(
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}\n",
        "",
    )
)
assert "think" not in QWEN25

# GLM-4.5: a call is the name then <arg_key>/<arg_value> pairs read with .items() (an object only),
# string values written bare; reasoning in <think></think>; an answer in <|observation|>.
GLM45 = """[gMASK]<sop>
{%- if tools %}<|system|>
# Tools

You may call one or more functions. Their signatures:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

Write each call as <tool_call>{function-name}
<arg_key>{arg-key}</arg_key>
<arg_value>{arg-value}</arg_value>
</tool_call>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|user|>
{{ m.content }}{{ '/nothink' if (enable_thinking is defined and not enable_thinking) else '' }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if m.reasoning_content is string %}
<think>{{ m.reasoning_content }}</think>
{%- else %}
<think></think>
{%- endif %}
{%- if m.content %}
{{ m.content }}
{%- endif %}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function else tc %}
<tool_call>{{ f.name }}
{% for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- elif m.role == 'system' %}<|system|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' }}{% endif %}"""

# Mixtral-8x22B-Instruct: [AVAILABLE_TOOLS] before the last user turn, calls as
# `[TOOL_CALLS] [{...}]` built from `function | tojson`, ids of 9 letters and digits enforced,
# answers in [TOOL_RESULTS].
MISTRAL = """{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and message == user_messages[-1] %}[AVAILABLE_TOOLS] [
{%- for tool in tools %}{{ tool | tojson }}{{ ', ' if not loop.last }}{% endfor %}][/AVAILABLE_TOOLS]
{%- endif %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls is defined and message.tool_calls is not none %}[TOOL_CALLS] [
{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function | tojson %}{{ out[:-1] }}
{%- if tool_call.id is not defined or tool_call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}, "id": "{{ tool_call.id }}"}{{ ', ' if not loop.last else ']' + eos_token }}
{%- endfor %}
{%- elif message.role == 'assistant' %} {{ message.content | trim }}{{ eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

# gpt-oss (harmony): the tools as a TypeScript-like namespace in the developer message, an earlier
# call as a message to functions.NAME with its arguments through tojson, the answer as a message
# from functions.NAME; `reasoning_effort` in the system message.
GPT_OSS = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}
# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- set last = namespace(name=none) %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}
{%- set call = message.tool_calls[0].function %}<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
{%- set last.name = call.name %}
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'tool' %}
{%- if last.name is none %}{{ raise_exception('A tool message needs a call before it.') }}{% endif %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

# DeepSeek-V3 (and R1): the tools are not written at all; an earlier call joins the arguments to
# text (a string only) and tests the calling message's content for none; answers between
# <｜tool▁outputs▁begin｜> and <｜tool▁outputs▁end｜>.
DEEPSEEK_V3 = """{%- set ns = namespace(is_tool=false, system='') %}
{%- for message in messages %}{% if message.role == 'system' %}{% set ns.system = message.content %}{% endif %}{% endfor %}
{{- bos_token }}{{ ns.system }}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.is_tool = false %}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' and message.tool_calls is defined and message.tool_calls is not none %}
{%- set ns.is_tool = false %}
{%- for tool in message.tool_calls %}
{%- set call = '<｜tool▁call▁begin｜>' + tool.type + '<｜tool▁sep｜>' + tool.function.name + '\\n```json\\n' + tool.function.arguments + '\\n```<｜tool▁call▁end｜>' %}
{%- if loop.first %}
{%- if message.content is none %}<｜Assistant｜><｜tool▁calls▁begin｜>{{ call }}
{%- else %}<｜Assistant｜>{{ message.content + '<｜tool▁calls▁begin｜>' + call }}{% endif %}
{%- else %}
{{ call }}
{%- endif %}
{%- endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- elif message.role == 'assistant' %}
{%- if ns.is_tool %}<｜tool▁outputs▁end｜>{{ message.content }}<｜end▁of▁sentence｜>{% set ns.is_tool = false %}
{%- else %}<｜Assistant｜>{{ message.content }}<｜end▁of▁sentence｜>{% endif %}
{%- elif message.role == 'tool' %}
{%- if not ns.is_tool %}<｜tool▁outputs▁begin｜>{% else %}
{% endif %}<｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜>
{%- set ns.is_tool = true %}
{%- endif %}
{%- endfor %}
{%- if ns.is_tool %}<｜tool▁outputs▁end｜>{% endif %}
{%- if add_generation_prompt and not ns.is_tool %}<｜Assistant｜>{% endif %}"""

# DeepSeek-R1's later template: the generation prompt opens the reasoning, and an earlier answer's
# reasoning is cut off at </think>.
DEEPSEEK_R1 = DEEPSEEK_V3.replace(
    "{%- if add_generation_prompt and not ns.is_tool %}<｜Assistant｜>{% endif %}",
    "{%- if add_generation_prompt and not ns.is_tool %}<｜Assistant｜><think>\n{% endif %}",
).replace(
    "{%- else %}<｜Assistant｜>{{ message.content }}<｜end▁of▁sentence｜>{% endif %}",
    "{%- else %}<｜Assistant｜>{{ message.content.split('</think>')[-1] }}<｜end▁of▁sentence｜>{% endif %}",
)
