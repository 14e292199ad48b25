"""Tool-call formats decided from the tokenizer's mlx-lm parser: constrained calls in
Qwen3-Coder XML and GLM 4.7 arg-key markup that the matching parser reads back, a
clear error for a format without a call grammar, history arguments as the template
takes them. The tokenizers are the demo target's with another template and
`tool_parser_type` (tests/chat_templates.py)."""

import asyncio
import json
from typing import Optional

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from chat_templates import CODER_TEMPLATE, DEMO_TEMPLATE, GLM_TEMPLATE, demo_variant
from decoding import allowed_tokens, constrained_decode
from langchain_specprefill import ChatSpecPrefill
from langchain_specprefill.chat_model import ToolsNotSupportedError
from specprefill_engine import Engine
from specprefill_engine.chat.constrained import make_constraint
from specprefill_engine.loading import load_model

pytestmark = pytest.mark.timeout(600)

TOOLS = [
    {"type": "function", "function": {"name": "magic_function", "description": "Magic.",
     "parameters": {"type": "object", "properties": {"input": {"type": "integer"}},
                    "required": ["input"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
     "parameters": {"type": "object", "properties": {
         "location": {"type": "string", "maxLength": 24},
         "days": {"type": "integer", "minimum": 1, "maximum": 7},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["location", "days"]}}},
]
FORMATS = {"qwen3_coder": CODER_TEMPLATE, "glm47": GLM_TEMPLATE}
MARKUP = {"qwen3_coder": "<function=", "glm47": "<arg_key>"}  # the format's own markup


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    made = {name: demo_variant(root / name, template, name) for name, template in FORMATS.items()}
    made["pythonic"] = demo_variant(root / "pythonic", DEMO_TEMPLATE, "pythonic")
    return made


def parser_name(tokenizer) -> str:
    return tokenizer.tool_parser.__module__.rsplit(".", 1)[-1]


def decode(model, tokenizer, response_format, prompt, max_tokens=120):
    processor = make_constraint(tokenizer, response_format)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tools=TOOLS)
    out = constrained_decode(model, tokenizer, processor, ids, max_tokens)
    return tokenizer.decode(out), processor


def read_back(tokenizer, text):
    """The call as the tokenizer's own mlx-lm parser reads it."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    assert text.startswith(start) and text.endswith(end), text
    return tokenizer.tool_parser(text[len(start):-len(end)], TOOLS)


@pytest.mark.parametrize("form", list(FORMATS))
def test_forced_calls_are_written_in_the_parsers_format(paths, form):
    model, tokenizer = load_model(paths[form])
    assert parser_name(tokenizer) == form
    for choice in ("required", "get_weather", "magic_function"):
        text, processor = decode(model, tokenizer, {"type": "tool_call", "tools": TOOLS,
                                                    "tool_choice": choice},
                                 "What is the weather in Paris for 3 days?")
        call = read_back(tokenizer, text)
        assert processor.done and MARKUP[form] in text  # not JSON, which glm47 also reads
        if choice != "required":
            assert call["name"] == choice
        if call["name"] == "get_weather":
            arguments = call["arguments"]
            assert {"location", "days"} <= set(arguments) <= {"location", "days", "unit"}
            assert isinstance(arguments["location"], str) and len(arguments["location"]) <= 24
            assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
            assert arguments.get("unit", "celsius") in ("celsius", "fahrenheit")
        else:
            assert isinstance(call["arguments"]["input"], int)
    # "auto": free text, or the start of a call
    auto = make_constraint(tokenizer, {"type": "tool_call", "tools": TOOLS, "tool_choice": "auto"})
    first = allowed_tokens(auto)
    assert tokenizer.encode("<tool_call>")[0] in first and len(first) > 1000


@pytest.mark.parametrize("form", list(FORMATS))
def test_the_engine_constrains_in_the_tokenizers_format(paths, form):
    with Engine(model=paths[form], draft=None) as engine:
        result = engine.generate_sync(
            [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=120,
            response_format={"type": "tool_call", "tools": TOOLS, "tool_choice": "get_weather"})
        assert result.finish_reason == "stop" and MARKUP[form] in result.text
        assert read_back(engine.tokenizer, result.text)["name"] == "get_weather"


class WeatherInput(BaseModel):
    location: str = Field(max_length=20, description="A city")
    days: Optional[int] = Field(default=None, description="How many days")


@tool(args_schema=WeatherInput)
def get_weather(location: str, days: Optional[int] = None) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


@pytest.mark.parametrize("form", list(FORMATS))
def test_langchain_tool_calls_land_in_tool_calls(paths, form):
    llm = ChatSpecPrefill(model=paths[form], max_tokens=120)
    try:
        bound = llm.bind_tools([get_weather], tool_choice="any")
        message = bound.invoke("What is the weather in Paris?")
        assert message.invalid_tool_calls == [] and message.content == ""
        assert [c["name"] for c in message.tool_calls] == ["get_weather"]
        assert isinstance(message.tool_calls[0]["args"]["location"], str)
        chunks = list(bound.stream("What is the weather in Paris?"))
        assert any(c.tool_call_chunks for c in chunks)
        assert all("<tool_call>" not in c.content for c in chunks)
        streamed = sum(chunks[1:], chunks[0])
        assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in message.tool_calls]
        # the call goes back into the history as the template takes it (objects)
        history = [HumanMessage("What is the weather in Paris?"), message,
                   ToolMessage("It is sunny.", tool_call_id=message.tool_calls[0]["id"])]
        reply = llm.invoke(history, max_tokens=4)
        assert reply.usage_metadata["input_tokens"] == llm.get_num_tokens_from_messages(history)
    finally:
        llm.close()


@pytest.mark.parametrize("form", list(FORMATS))
def test_history_calls_are_rendered_with_object_arguments(paths, form):
    llm = ChatSpecPrefill(model=paths[form])
    try:
        call = AIMessage("", tool_calls=[{"name": "get_weather", "args": {"location": "Paris"},
                                          "id": "call_1"}])
        history = [HumanMessage("Weather in Paris?"), call,
                   ToolMessage("It is sunny.", tool_call_id="call_1")]
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                 "name": "get_weather", "arguments": {"location": "Paris"}}}]},
             {"role": "tool", "content": "It is sunny."}], add_generation_prompt=True,
            tokenize=False)
        shown = ("<parameter=location>\nParis\n</parameter>" if form == "qwen3_coder"
                 else "<arg_key>location</arg_key><arg_value>Paris</arg_value>")
        assert shown in text
        assert llm.get_num_tokens_from_messages(history) == \
            len(llm.tokenizer.encode(text, add_special_tokens=False))
    finally:
        llm.close()


def test_a_format_without_a_call_grammar_is_refused_before_anything_runs(paths):
    with Engine(model=paths["pythonic"], draft=None) as engine:
        assert parser_name(engine.tokenizer) == "pythonic"
        with pytest.raises(ToolsNotSupportedError, match="'pythonic'"):
            engine.generate_sync("hi", response_format={"type": "tool_call", "tools": TOOLS})
        assert not engine.active_request_ids
    llm = ChatSpecPrefill(model=paths["pythonic"], max_tokens=8)
    try:
        for choice in ("any", "get_weather"):
            with pytest.raises(ToolsNotSupportedError, match="'pythonic'"):
                llm.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Paris?")
            with pytest.raises(ToolsNotSupportedError, match="'pythonic'"):
                asyncio.run(llm.bind_tools([get_weather], tool_choice=choice).ainvoke("Paris?"))
        # "auto" needs no grammar: calls the model writes are parsed, unconstrained
        assert llm.bind_tools([get_weather]).invoke("Weather in Paris?").tool_calls == []
    finally:
        llm.close()


def test_a_tool_the_parser_cannot_read_back_is_refused(paths):
    with Engine(model=paths["qwen3_coder"], draft=None) as engine:
        unreadable = [{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"n": {"anyOf": [{"type": "integer"},
                                                             {"type": "null"}]}},
            "required": ["n"]}}}]
        with pytest.raises(ValueError, match="parameter 'n'.*qwen3_coder"):
            engine.generate_sync("hi", response_format={"type": "tool_call",
                                                        "tools": unreadable})
        # optional, it is left to its default
        optional = json.loads(json.dumps(unreadable))
        optional[0]["function"]["parameters"]["required"] = []
        result = engine.generate_sync("hi", max_tokens=60, response_format={
            "type": "tool_call", "tools": optional, "tool_choice": "pick"})
        assert read_back(engine.tokenizer, result.text) == {"name": "pick", "arguments": {}}
