"""Constrained decoding (`response_format`) on the demo target, alone and in the engine."""

import json

import mlx.core as mx
import numpy as np
import pytest

from decoding import allowed_tokens, constrained_decode, tool_call_lark
from specprefill_engine import Engine
from specprefill_engine.chat.constrained import (
    check_response_format, llg_tokenizer, make_constraint,
)
from specprefill_engine.chat.tool_calls import ToolsNotSupportedError

JOKE = {"type": "object", "properties": {"setup": {"type": "string"},
                                         "punchline": {"type": "string"}},
        "required": ["setup", "punchline"]}
TOOLS = [
    {"type": "function", "function": {"name": "magic_function", "description": "Magic.",
     "parameters": {"type": "object", "properties": {"input": {"type": "integer"}},
                    "required": ["input"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
     "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                    "required": ["location"]}}},
]


@pytest.fixture(scope="module")
def target():
    from specprefill_engine.loading import load_model

    return load_model()


@pytest.fixture(scope="module")
def engine():
    with Engine() as engine:
        yield engine


def decode(target, response_format, prompt="Tell me a joke.", max_tokens=80):
    """Greedy decode with mlx-lm's generate_step and our processor (fed generated tokens only)."""
    model, tokenizer = target
    processor = make_constraint(tokenizer, response_format)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tools=TOOLS)
    out = constrained_decode(model, tokenizer, processor, ids, max_tokens)
    return tokenizer.decode(out), processor


# validation -----------------------------------------------------------------------


def test_check_response_format_normalizes_and_refuses():
    assert check_response_format({"type": "json_object"}) == {"type": "json_object"}
    bare = check_response_format({"type": "json_schema", "schema": JOKE})
    assert bare == {"type": "json_schema", "json_schema": {"name": "response", "schema": JOKE}}
    openai = check_response_format({"type": "json_schema", "json_schema": {"name": "Joke", "schema": JOKE}})
    assert openai["json_schema"]["name"] == "Joke"
    call = check_response_format({"type": "tool_call", "tools": TOOLS, "tool_choice": "any"})
    assert call["tool_choice"] == "required" and call["parallel_tool_calls"] is False
    named = check_response_format({"type": "tool_call", "tools": TOOLS, "tool_choice": "get_weather"})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    for bad, error in [
        ("json", TypeError), ({"type": "xml"}, ValueError), ({"type": "json_schema"}, ValueError),
        ({"type": "tool_call", "tools": []}, ValueError),
        ({"type": "tool_call", "tools": TOOLS, "tool_choice": "nope"}, ValueError),
        ({"type": "tool_call", "tools": TOOLS + TOOLS[:1]}, ValueError),
        ({"type": "lark", "lark": "start: undefined_rule"}, ValueError),
        ({"type": "json_schema", "schema": "not a schema"}, TypeError),
    ]:
        with pytest.raises(error, match="response_format"):
            check_response_format(bad)


def test_reasoning_and_format_keys_are_checked():
    thinking = check_response_format({"type": "json_object", "reasoning": "open",
                                      "reasoning_budget": 8})
    assert thinking == {"type": "json_object", "reasoning": "open", "reasoning_budget": 8}
    coder = check_response_format({"type": "tool_call", "tools": TOOLS, "format": "qwen3_coder"})
    assert coder["format"] == "qwen3_coder"
    with pytest.raises(ValueError, match="reasoning must be one of"):
        check_response_format({"type": "json_object", "reasoning": "maybe"})
    with pytest.raises(ValueError, match="reasoning_budget must be an integer >= 0"):
        check_response_format({"type": "json_object", "reasoning_budget": -1})
    with pytest.raises(ToolsNotSupportedError, match="'mistral'"):
        check_response_format({"type": "tool_call", "tools": TOOLS, "format": "mistral"})


def test_llguidance_tokenizer_is_cached(target):
    _, tokenizer = target
    assert llg_tokenizer(tokenizer) is llg_tokenizer(tokenizer)


# the processor on the demo target ---------------------------------------------------


def test_json_schema_output_is_valid(target):
    text, processor = decode(target, {"type": "json_schema", "schema": JOKE})
    joke = json.loads(text)
    assert set(joke) == {"setup", "punchline"} and all(isinstance(v, str) for v in joke.values())
    assert processor.done and allowed_tokens(processor) == sorted(target[1].eos_token_ids)


def test_required_and_named_tool_calls_parse_with_the_tokenizers_parser(target):
    _, tokenizer = target
    for choice, names in (("required", {"magic_function", "get_weather"}),
                          ("magic_function", {"magic_function"})):
        text, _ = decode(target, {"type": "tool_call", "tools": TOOLS, "tool_choice": choice},
                         "What is the weather in Paris?")
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = tokenizer.tool_parser(text[len("<tool_call>"):-len("</tool_call>")], TOOLS)
        assert call["name"] in names
        expected = {"magic_function": {"input"}, "get_weather": {"location"}}[call["name"]]
        assert set(call["arguments"]) == expected


def test_auto_allows_text_and_the_start_of_a_call(target):
    _, tokenizer = target
    text, processor = decode(target, {"type": "tool_call", "tools": TOOLS, "tool_choice": "auto"},
                             "Hello", max_tokens=20)
    assert "<tool_call>" not in text  # the demo model chooses text
    fresh = make_constraint(tokenizer, {"type": "tool_call", "tools": TOOLS, "tool_choice": "auto"})
    first = allowed_tokens(fresh)
    start = tokenizer.encode("<tool_call>")[0]
    assert start in first and len(first) > 1000  # free text or a call


def test_padded_vocabulary_and_rows_are_independent(target):
    """V larger than the tokenizer's: padding stays masked. Two rows of a batch, each
    with its own processor and history, get their own masks."""
    _, tokenizer = target
    vocab = len(tokenizer._tokenizer) + 60
    schema = make_constraint(tokenizer, {"type": "json_schema", "schema": JOKE})
    call = make_constraint(tokenizer, {"type": "tool_call", "tools": TOOLS,
                                       "tool_choice": "get_weather"})
    logits = mx.zeros((2, vocab))
    rows = [schema(mx.array([], dtype=mx.int32), logits[0:1]),
            call(mx.array([], dtype=mx.int32), logits[1:2])]
    allowed = [np.nonzero(np.isfinite(np.array(row[0])))[0].tolist() for row in rows]
    assert allowed[0] == allowed_tokens(schema) and allowed[1] == allowed_tokens(call)
    assert allowed[0] != allowed[1] and max(allowed[0] + allowed[1]) < vocab - 60
    # advance row 1 only: row 0's state is untouched
    start = tokenizer.encode("<tool_call>\n")
    before = allowed_tokens(schema)
    call(mx.array(start, dtype=mx.int32), logits[1:2])
    assert allowed_tokens(schema) == before and call.consumed == len(start)
    with pytest.raises(ValueError, match="breaks the grammar"):
        call(mx.array(start + tokenizer.encode("xyz"), dtype=mx.int32), logits[1:2])


def test_integer_arguments_are_bounded_and_objects_closed():
    grammar = tool_call_lark(check_response_format(
        {"type": "tool_call", "tools": TOOLS, "tool_choice": "required"}))
    assert '"maximum": 9007199254740991' in grammar and '"additionalProperties": false' in grammar


# in the engine (the contract: response_format per request, a processor per row) ----------


def test_engine_requests_with_different_formats_run_together(engine):
    import asyncio

    messages = [{"role": "user", "content": "Tell me a joke."}]

    async def both():
        return await asyncio.gather(
            engine.generate(messages, max_tokens=60, response_format={
                "type": "json_schema", "json_schema": {"name": "Joke", "schema": JOKE}}),
            engine.generate(messages, max_tokens=60, tools=TOOLS, response_format={
                "type": "tool_call", "tools": TOOLS, "tool_choice": "get_weather"}),
            engine.generate(messages, max_tokens=8),
        )

    joke, call, plain = asyncio.run(both())
    assert set(json.loads(joke.text)) == {"setup", "punchline"} and joke.finish_reason == "stop"
    assert call.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"location": ')
    assert call.finish_reason == "stop"
    assert plain.text == engine.generate_sync(messages, max_tokens=8).text  # unconstrained row


def test_engine_refuses_a_bad_response_format_on_the_callers_thread(engine):
    with pytest.raises(ValueError, match="response_format"):
        engine.generate_sync("hi", response_format={"type": "yaml"})


def test_engine_streams_constrained_output(engine):
    chunks = list(engine.stream_sync([{"role": "user", "content": "hi"}], max_tokens=200,
                                     response_format={"type": "json_object"}))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop", text  # the grammar ended the object
    assert isinstance(json.loads(text), dict)
