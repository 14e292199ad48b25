"""Calls written without the template's markers (a fenced or bare JSON block) are read
as calls when they call a given tool with arguments its schema accepts: by the parser,
streamed or whole, and through every API (the output forced by constrained decoding)."""

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from langchain_specprefill import ChatSpecPrefill
from models import ROPE_CASES, save_with_demo_tokenizer
from specprefill_engine import Engine
from specprefill_engine.chat.parser_events import TextEvent, ToolCallEvent
from specprefill_engine.chat.tool_calls import OutputParser
from specprefill_engine.loading import DEMO_TARGET
from test_server import ASK, served  # noqa: F401  (served: the fixture)

PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                         "parameters": PATH}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}
TOOLS = [READ, COUNT]
CALL = '{"name": "read_file", "arguments": {"path": "a.py"}}'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_TARGET)


def read(tokenizer, text: str, tools=TOOLS, by_char: bool = False) -> tuple:
    """(content, [(name, arguments)], invalid calls) of a whole output, fed at once or
    one character at a time."""
    parser = OutputParser(tokenizer, parse_tools=True, tools=tools)
    pieces = list(text) if by_char else [text]
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish("stop")
    tool_calls = [e for e in events if isinstance(e, ToolCallEvent)]
    calls = [(v.name, json.loads(v.args)) for v in tool_calls if not v.error]
    invalid = [v for v in tool_calls if v.error]
    return "".join(e.text for e in events if isinstance(e, TextEvent)), calls, invalid


# the parser -----------------------------------------------------------------------


@pytest.mark.parametrize("text, content, calls", [
    (f"```json\n{CALL}\n```", "", [("read_file", {"path": "a.py"})]),
    (f"I will read it.\n```\n{CALL}\n```\nThen I know.", "I will read it.Then I know.",
     [("read_file", {"path": "a.py"})]),
    (f"```tool_call\n{CALL}\n```", "", [("read_file", {"path": "a.py"})]),
    (f'```JSON\n{{\n  "name": "count",\n  "arguments": {{\n    "n": 3\n  }}\n}}\n```', "",
     [("count", {"n": 3})]),
    (CALL, "", [("read_file", {"path": "a.py"})]),
    (f"Reading.\n  {CALL}", "Reading.", [("read_file", {"path": "a.py"})]),
    ('{"name": "read_file", "parameters": {"path": "b"}}', "", [("read_file", {"path": "b"})]),
    ('{"name": "count", "arguments": "{\\"n\\": 2}"}', "", [("count", {"n": 2})]),
    ('{"type": "function", "function": {"name": "count", "arguments": {"n": 1}}}', "",
     [("count", {"n": 1})]),
    (f'[{CALL}, {{"name": "count", "arguments": {{}}}}]', "",
     [("read_file", {"path": "a.py"}), ("count", {})]),
    (f'```json\n{CALL}\n{{"name": "count", "arguments": {{"n": 5}}}}\n```', "",
     [("read_file", {"path": "a.py"}), ("count", {"n": 5})]),
    (f"{CALL}\n{CALL}", "", [("read_file", {"path": "a.py"})] * 2),
    (f"```json\n{CALL}\n", "", [("read_file", {"path": "a.py"})]),  # ended before the fence
    (f"<think>x</think>{CALL}", "", [("read_file", {"path": "a.py"})]),
    ('{"name": "read_file", "arguments": {"path": "```"}}', "", [("read_file", {"path": "```"})]),
    ('{"name": "read_file", "arguments": {"path": "C:\\\\}\\""}}', "",
     [("read_file", {"path": 'C:\\}"'})]),  # escapes, a bracket in a string
])
def test_calls_without_markers_are_read_whole_or_char_by_char(tokenizer, text, content, calls):
    for by_char in (False, True):
        assert read(tokenizer, text, by_char=by_char) == (content, calls, [])


FENCED = f"```json\n{CALL}\n```"


@pytest.mark.parametrize("text, tools, near_miss", [
    (FENCED, TOOLS, FENCED.replace("read_file", "write_file")),  # a tool not given
    (FENCED, TOOLS, FENCED.replace('"path"', '"file"')),  # its schema needs a path
    ('{"name": "count", "arguments": {"n": 1}}', TOOLS, '{"name": "count", "arguments": {"n": -1}}'),
    ('{"name": "count", "arguments": "{\\"n\\": 1}"}', TOOLS,
     '{"name": "count", "arguments": "{n: 1}"}'),  # string arguments that are not JSON
    ('{"name": "read_file", "parameters": {"path": "a"}}', TOOLS,
     '{"name": "read_file", "description": "Read.", "parameters": {"path": "a"}}'),
    ('{"name": "read_file", "arguments": {"path": "a"}}', TOOLS,
     '{"name": "read_file", "arguments": {"path": "a"}, "parameters": {"path": "b"}}'),
    ('{"name": "count", "arguments": {}}', TOOLS, '{"name": "count"}'),
    (f"[{CALL}, {CALL}]", TOOLS, f'[{CALL}, {{"name": "nope", "arguments": {{}}}}]'),
    (f"x = 1\n{CALL}", TOOLS, f"```python\nx = 1\n{CALL}\n```"),  # in another code block
    (f"Call it:\n{CALL}", TOOLS, f"Call it: {CALL}"),  # not at the start of a line
    (FENCED, TOOLS, FENCED.replace("\n```", "\nand then\n```")),
    (FENCED, TOOLS, FENCED.replace("}}", "}")),  # unbalanced
    (f"[link](x) {{not json}} [{{]\n{CALL}", TOOLS, "```json\n[1, 2]\n```\n[link](x) {not json} [{]"),
    (FENCED, TOOLS, FENCED.replace("```json", "```js")),
])
def test_a_near_miss_of_a_call_stays_text_unchanged(tokenizer, text, tools, near_miss):
    for by_char in (False, True):
        assert read(tokenizer, text, tools, by_char)[1]
        assert read(tokenizer, near_miss, tools, by_char) == (near_miss, [], [])


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_nothing_is_recovered(tokenizer, tools):
    assert read(tokenizer, FENCED, TOOLS)[1] == [("read_file", {"path": "a.py"})]
    for text in (FENCED, CALL, f"[{CALL}]"):
        assert read(tokenizer, text, tools) == (text, [], [])


def test_ordinary_text_is_released_as_it_comes_and_a_block_once_known(tokenizer):
    parser = OutputParser(tokenizer, parse_tools=True, tools=TOOLS)

    def content(piece: str) -> str:
        return "".join(e.text for e in parser.feed(piece) if isinstance(e, TextEvent))

    assert content("Here is the plan.") == "Here is the plan."
    assert content("\n[1] First") == "\n[1] First"
    assert content("\n```py") == "\n```py"  # no call opens with that fence word
    assert content("thon\nprint(1)") == "thon\nprint(1)"
    assert content("\n``") == ""  # may close the block: held back
    assert content("`\nDone. ") == "\n```\nDone."  # (trailing whitespace waits, as always)
    assert content('\n```json\n{"a": ') == ""
    assert content('1}\n``') == ""
    assert content("`\nAfter") == ' \n```json\n{"a": 1}\n```\nAfter'
    assert content(f"\n```json\n{CALL[:20]}") == ""
    events = parser.feed(f"{CALL[20:]}\n```") + parser.finish("stop")
    assert [(type(e), getattr(e, "name", e)) for e in events] == [(ToolCallEvent, "read_file")]


# the engine, a tiny random model, the output forced --------------------------------


def test_a_forced_fenced_call_streamed_from_the_engine_is_read_as_a_call(tmp_path):
    fenced = f"Reading it.\n```json\n{CALL}\n```"
    regex = "".join("\\" + c if c in "\\.+*?()|[]{}^$" else "\\n" if c == "\n" else c
                    for c in fenced)
    path = save_with_demo_tokenizer(ROPE_CASES["llama"], tmp_path / "tiny")
    with Engine(model=str(path)) as engine:
        rendered = engine.render([{"role": "user", "content": "Read a.py."}], TOOLS)
        parser = OutputParser(engine.tokenizer, parse_tools=True, tools=TOOLS)
        chunks = list(engine.stream_sync(rendered, max_tokens=64,
                                         response_format={"type": "regex", "regex": regex}))
    assert "".join(c.text for c in chunks) == fenced and len(chunks) > 10
    events = [e for c in chunks for e in parser.feed(c.text)] + parser.finish("stop")
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "Reading it."
    assert [(e.name, json.loads(e.args)) for e in events if isinstance(e, ToolCallEvent)] == \
        [("read_file", {"path": "a.py"})]


# every API (the demo pair; a json_schema response_format forces a bare call) ---------

WEATHER = {"type": "object", "properties": {"location": {"type": "string"}},
           "required": ["location"]}
API_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                               "parameters": WEATHER}}]
FORCED = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"location": {"enum": ["Paris"]}},
                  "required": ["location"]}}}
PARIS = {"location": "Paris"}


def test_openai_chat_streams_a_recovered_call(served):  # noqa: F811
    chunks = [c.choices[0] for c in served.openai().chat.completions.create(
        model="m", messages=ASK, tools=API_TOOLS, max_tokens=40, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": FORCED}})
        if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [call.function.name for call in calls] == ["get_weather"]
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == PARIS
    assert chunks[-1].finish_reason == "tool_calls"


def test_anthropic_messages_give_a_recovered_tool_use(served):  # noqa: F811
    reply = served.anthropic().messages.create(
        model="m", messages=ASK, max_tokens=40,
        tools=[{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": FORCED}}})
    assert [b.type for b in reply.content] == ["tool_use"] and reply.stop_reason == "tool_use"
    assert reply.content[0].name == "get_weather" and reply.content[0].input == PARIS


def test_responses_give_a_recovered_function_call(served):  # noqa: F811
    reply = served.openai().responses.create(
        model="m", input=ASK, max_output_tokens=40,
        tools=[{"type": "function", **API_TOOLS[0]["function"]}],
        text={"format": {"type": "json_schema", "name": "c", "schema": FORCED}})
    assert [item.type for item in reply.output] == ["function_call"]
    assert reply.output[0].name == "get_weather" and json.loads(reply.output[0].arguments) == PARIS


def test_langchain_bind_tools_gives_a_recovered_call():
    llm = ChatSpecPrefill(max_tokens=40).bind_tools(API_TOOLS)
    forced = {"type": "json_schema", "json_schema": {"name": "c", "schema": FORCED}}
    message = llm.invoke("What is the weather in Paris?", response_format=forced)
    assert message.content == "" and message.invalid_tool_calls == []
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", PARIS)]
    chunks = list(llm.stream("What is the weather in Paris?", response_format=forced))
    total = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", PARIS)]


def test_without_jsonschema_a_fenced_call_is_still_read(tokenizer, monkeypatch):
    """The core install has no jsonschema: a call's arguments then go unchecked, and
    reading the reply never fails."""
    import sys

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` raises
    text = '```json\n{"name": "read_file", "arguments": {"path": "a.py"}}\n```'
    content, calls, invalid = read(tokenizer, text)
    assert (content, calls, invalid) == ("", [("read_file", {"path": "a.py"})], [])
