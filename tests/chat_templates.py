"""The demo target with other chat templates and tool-call parsers, for tests.

Each variant is a copy of the demo target whose tokenizer_config names a template
and an mlx-lm `tool_parser_type`, so the tokenizer mlx-lm loads speaks that format:
Qwen3-Coder-style XML calls, GLM-4.7-style arg-key calls, a template that always
opens a think block (a thinking model's), one that is slow to render (for the event
loop), and a tool format without a call grammar.
"""

import json
import shutil
from pathlib import Path

from specprefill_engine.loading import DEMO_TARGET

DEMO_TEMPLATE = json.loads((DEMO_TARGET / "tokenizer_config.json").read_text())["chat_template"]

_SYSTEM = """{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"""
_TURNS_HEAD = """{%- for m in messages %}{%- if m['role'] == 'system' %}{% if not loop.first %}<|system|>
{{ m['content'] }}<|end|>
{% endif %}{%- elif m['role'] == 'user' %}<|user|>
{{ m['content'] }}<|end|>
{% elif m['role'] == 'tool' %}<|user|>
<tool_response>
{{ m['content'] }}
</tool_response><|end|>
{% elif m['role'] == 'assistant' %}<|assistant|>
{{ m['content'] if m['content'] is string else '' }}"""
_TURNS_TAIL = """<|end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

# Qwen3-Coder style: tools described in XML, calls as <function=...> with one
# <parameter=...> block per argument (the template iterates over the arguments).
CODER_TEMPLATE = _SYSTEM + """{%- if system is not none or tools %}<|system|>
{% if system is not none %}{{ system }}
{% endif %}{%- if tools %}
# Tools

You can call these functions:
<tools>
{%- for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}
<function>
<name>{{ f.name }}</name>
<description>{{ f.description }}</description>
<parameters>
{%- for pname, p in (f.parameters.properties or {}) | items %}
<parameter>
<name>{{ pname }}</name>
<type>{{ p.type }}</type>
</parameter>
{%- endfor %}
</parameters>
</function>
{%- endfor %}
</tools>

To call a function, reply in exactly this form:
<tool_call>
<function=example_function>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call>
{%- endif %}<|end|>
{% endif %}""" + _TURNS_HEAD + """{%- for tc in m.get('tool_calls') or [] %}{% set tc = tc.function if tc.function is defined else tc %}
<tool_call>
<function={{ tc.name }}>
{% for k, v in tc.arguments | items %}<parameter={{ k }}>
{{ v | tojson if v is mapping or (v is sequence and v is not string) else v }}
</parameter>
{% endfor %}</function>
</tool_call>{%- endfor %}""" + _TURNS_TAIL

# GLM 4.7 style: tools as JSON lines, calls as NAME<arg_key>K</arg_key><arg_value>V</arg_value>.
GLM_TEMPLATE = _SYSTEM + """{%- if system is not none or tools %}<|system|>
{% if system is not none %}{{ system }}
{% endif %}{%- if tools %}
# Tools

Function signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, output:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value></tool_call>
{%- endif %}<|end|>
{% endif %}""" + _TURNS_HEAD + """{%- for tc in m.get('tool_calls') or [] %}{% set tc = tc.function if tc.function is defined else tc %}<tool_call>{{ tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{%- endfor %}""" + _TURNS_TAIL

# A thinking model's template: the generation prompt always opens a think block.
THINKING_TEMPLATE = DEMO_TEMPLATE.replace(
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}", "<think>\n")

# Renders like the demo template, after a loop that makes every render slow.
SLOW_TEMPLATE = ("{% for i in range(6000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
                 + DEMO_TEMPLATE)

# Prints the arguments as they come: it takes JSON strings.
RAW_ARGUMENTS_TEMPLATE = _SYSTEM + _TURNS_HEAD + """{%- for tc in m.get('tool_calls') or [] %}
<call name="{{ tc.function.name }}">{{ tc.function.arguments }}</call>{%- endfor %}""" + _TURNS_TAIL


def demo_variant(directory: Path, template: str, tool_parser_type=None) -> str:
    """A copy of the demo target with this chat template and tool parser."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in DEMO_TARGET.iterdir():
        shutil.copy(path, directory / path.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    if tool_parser_type is not None:
        config["tool_parser_type"] = tool_parser_type
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)
