"""Thinking models and constraints: when the prompt opens a think block, a constrained
reply thinks first (bounded by a reasoning budget, then `</think>` is forced) and the
grammar constrains what follows; the structured output parses, tool calls land in
tool_calls, the thinking in reasoning_content. The demo template opens a think
block with enable_thinking; the thinking template always does; the demo model never
closes one itself, so the budget is what ends its thinking."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from chat_templates import THINKING_TEMPLATE, demo_variant
from decoding import allowed_tokens, constrained_decode
from langchain_specprefill import ChatSpecPrefill
from specprefill_engine import Engine
from specprefill_engine.chat.constrained import make_constraint
from specprefill_engine.loading import load_model

agents = pytest.importorskip("langchain.agents")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from streaming_agent import LookUpFirst  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# short strings: the demo model's jokes would otherwise run to max_tokens
JOKE = {"type": "object", "properties": {"setup": {"type": "string", "maxLength": 40},
                                         "punchline": {"type": "string", "maxLength": 40}},
        "required": ["setup", "punchline"]}
THINKING = {"enable_thinking": True}


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke", max_length=40)
    punchline: str = Field(description="answer to resolve the joke", max_length=40)


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


@pytest.fixture(scope="module")
def target():
    return load_model()


def think_then(target, response_format, max_tokens=90):
    """Greedy decode of a prompt that opens a think block, with the constraint."""
    model, tokenizer = target
    processor = make_constraint(tokenizer, response_format)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a joke."}],
                                        add_generation_prompt=True, **THINKING)
    return constrained_decode(model, tokenizer, processor, ids, max_tokens)


def test_the_budget_forces_the_end_of_thinking_then_the_grammar_holds(target):
    _, tokenizer = target
    tokens = think_then(target, {"type": "json_schema", "schema": JOKE, "reasoning": "open",
                                 "reasoning_budget": 12})
    text = tokenizer.decode(tokens)
    thought, _, answer = text.partition("</think>")
    assert thought and len(tokenizer.encode(thought)) <= 12 + 1  # a token may straddle
    assert set(json.loads(answer)) == {"setup", "punchline"}


@pytest.mark.parametrize("response_format", [
    {"type": "regex", "regex": "[0-9]{3}"},
    {"type": "lark", "lark": 'start: "answer: " /[a-z]{2,4}/'},
    {"type": "tool_call", "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}}, "required": ["location"]}}}],
     "tool_choice": "required"},
])
def test_every_format_follows_the_thinking(target, response_format):
    _, tokenizer = target
    text = tokenizer.decode(think_then(target, {**response_format, "reasoning": "open",
                                                "reasoning_budget": 6}))
    thought, marker, answer = text.partition("</think>")
    assert thought and marker
    kind = response_format["type"]
    if kind == "regex":
        assert answer.strip().isdigit() and len(answer.strip()) == 3
    elif kind == "lark":
        assert answer.lstrip().startswith("answer: ")
    else:
        body = answer.strip()
        assert body.startswith("<tool_call>") and body.endswith("</tool_call>")
        assert json.loads(body[len("<tool_call>"):-len("</tool_call>")])["name"] == "get_weather"


def test_optional_reasoning_lets_the_model_open_a_think_block(target):
    _, tokenizer = target
    schema = {"type": "json_schema", "schema": JOKE, "reasoning": "optional",
              "reasoning_budget": 4}
    fresh = make_constraint(tokenizer, schema)
    first = allowed_tokens(fresh)
    assert tokenizer.encode("{")[0] in first and tokenizer.encode("<think>")[0] in first
    opened = tokenizer.encode("<think>")
    fresh(mx.array(opened, dtype=mx.int32), mx.zeros((1, len(tokenizer._tokenizer))))
    assert len(allowed_tokens(fresh)) > 1000  # free thinking inside the block
    closed = make_constraint(tokenizer, {"type": "json_schema", "schema": JOKE})
    assert tokenizer.encode("<think>")[0] not in allowed_tokens(closed)


def test_engine_response_format_thinks_first_when_the_prompt_opens_a_block():
    with Engine() as engine:
        messages = [{"role": "user", "content": "Tell me a joke."}]
        result = engine.generate_sync(messages, max_tokens=100, chat_template_kwargs=THINKING,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "Joke", "schema": JOKE}, "reasoning_budget": 16})
        thought, marker, answer = result.text.partition("</think>")
        assert marker and thought.strip()
        assert set(json.loads(answer)) == {"setup", "punchline"}
        # without a think block the grammar holds from the first token, as before
        plain = engine.generate_sync(messages, max_tokens=100, response_format={
            "type": "json_schema", "json_schema": {"name": "Joke", "schema": JOKE}})
        assert set(json.loads(plain.text)) == {"setup", "punchline"}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_of_a_thinking_model_parses(method):
    llm = ChatSpecPrefill(reasoning=True, max_tokens=120, reasoning_budget=20)
    raw = llm.with_structured_output(Joke, method=method, include_raw=True).invoke(
        "Tell me a joke.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Joke)
    assert raw["raw"].additional_kwargs["reasoning_content"]
    assert "</think>" not in raw["raw"].content


def test_tool_calls_of_a_thinking_model_land_in_tool_calls():
    llm = ChatSpecPrefill(reasoning=True, max_tokens=100, reasoning_budget=20).bind_tools(
        [get_weather], tool_choice="any")
    message = llm.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.additional_kwargs["reasoning_content"] and message.content == ""
    chunks = list(llm.stream("What is the weather in Paris?"))
    reasoning = [c for c in chunks if c.additional_kwargs.get("reasoning_content")]
    calls = [c for c in chunks if c.tool_call_chunks]
    assert reasoning and calls and chunks.index(reasoning[0]) < chunks.index(calls[0])


def test_a_thinking_template_thinks_by_default(tmp_path):
    llm = ChatSpecPrefill(model=demo_variant(tmp_path / "thinking", THINKING_TEMPLATE),
                          max_tokens=100)
    try:
        raw = llm.with_structured_output(Joke, include_raw=True).invoke("Tell me a joke.")
        assert isinstance(raw["parsed"], Joke)
        assert raw["raw"].additional_kwargs["reasoning_content"]
    finally:
        llm.close()


def test_an_agent_that_thinks_before_calling_its_tool_streams():
    agent = agents.create_agent(ChatSpecPrefill(reasoning=True, max_tokens=80, reasoning_budget=24),
                                [get_weather],
                                middleware=[LookUpFirst()])
    question = {"messages": [HumanMessage("What is the weather in Paris?")]}
    streamed = list(agent.stream(question, stream_mode="messages"))
    model_chunks = [m for m, meta in streamed if meta["langgraph_node"] == "model"]
    assert all(isinstance(m, AIMessageChunk) for m in model_chunks)
    first_call = next(i for i, m in enumerate(model_chunks) if m.tool_call_chunks)
    # the first turn thought, then called the tool (streamed as a tool_call_chunk)
    assert any(m.additional_kwargs.get("reasoning_content") for m in model_chunks[:first_call])
    assert [c["name"] for m in model_chunks for c in m.tool_call_chunks] == ["get_weather"]
    assert all("<tool_call>" not in m.content and "</think>" not in m.content
               for m in model_chunks)
    tool_results = [m for m, meta in streamed if meta["langgraph_node"] == "tools"]
    assert len(tool_results) == 1 and tool_results[0].content.startswith("It is sunny in ")
    # the second turn thought again, then answered in text; the loop ended on its own
    after = model_chunks[first_call + 1:]
    assert any(m.additional_kwargs.get("reasoning_content") for m in after)
    final = agent.invoke(question)["messages"]
    assert [type(m).__name__ for m in final] == ["HumanMessage", "AIMessage", "ToolMessage",
                                                 "AIMessage"]
    assert final[1].tool_calls[0]["name"] == "get_weather" and not final[3].tool_calls
    assert final[3].additional_kwargs["reasoning_content"]
