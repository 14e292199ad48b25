"""The HTTP server, through real clients against a real uvicorn on 127.0.0.1.

One server (demo pair, an API key, short keep-alives) serves the module; its Engine is
also called directly, so every text can be checked against the engine's own greedy
output. The CLI's `serve` runs in a subprocess for the signal drain and overload.
"""

import asyncio
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import uvicorn
from pydantic import BaseModel

from chat_templates import CODER_TEMPLATE, DEMO_TEMPLATE, demo_variant
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.state import RequestState
from specprefill_server import ServerConfig, create_app
from specprefill_server.streaming import EventStream

KEY = "test-key-7f3a"
ROOT = Path(__file__).parent.parent
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}},
           "required": ["location"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"},
                                               "b": {"type": "integer"}}}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Served:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.app = engine, create_app(engine, config)
        # an explicit TCP protocol, as uvicorn's own binding has: asyncio disables Nagle's
        # algorithm only then, and without that each response waits ~40 ms for an ACK
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def gate(self):
        return self.app.state.server.gate

    def openai(self, key=KEY, cls=openai.OpenAI):
        return cls(base_url=self.base + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key=KEY, cls=anthropic.Anthropic):
        return cls(base_url=self.base, api_key=key, max_retries=0)

    def settled(self, timeout: float = 20.0) -> bool:
        """Whether the engine and the server have no request left (polled, bounded)."""
        deadline = time.monotonic() + timeout
        while self.engine.active_request_ids or self.gate.active:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def served():
    served = Served(Engine(), ServerConfig(api_key=KEY, keepalive=0.05,
                                           max_body_bytes=1 << 20))
    yield served
    served.stop()


def case(served, seed: int, n_tokens: int = 300):
    found = make_case(served.engine.tokenizer, seed, "passkey", n_tokens)
    return [dict(m) for m in found.messages], found.answer


# OpenAI ---------------------------------------------------------------------------


def test_openai_chat_gives_the_engines_text_streamed_or_not_with_usage(served):
    messages, _ = case(served, 1, 600)
    direct = served.engine.generate_sync(messages, max_tokens=10)
    client = served.openai()
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                           temperature=0)
    assert reply.choices[0].message.content == direct.text
    assert reply.choices[0].finish_reason == direct.finish_reason
    assert reply.usage.prompt_tokens == direct.usage.prompt_tokens
    assert reply.usage.completion_tokens == len(direct.token_ids)
    assert reply.model_extra["specprefill"]["total_tokens"] == direct.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == direct.usage.prompt_tokens
    # the next turn: the prompt so far comes from the prefix cache
    turn = messages + [{"role": "assistant", "content": direct.text},
                       {"role": "user", "content": "Say it again."}]
    second = client.chat.completions.create(model="m", messages=turn, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= 256
    # reasoning_effort opens the template's think block: the demo model never closes it
    thought = client.chat.completions.create(model="m", messages=ASK, max_tokens=6,
                                             reasoning_effort="high").choices[0].message
    assert thought.content == "" and thought.model_extra["reasoning_content"]
    streamed = [c.choices[0].delta for c in client.chat.completions.create(
        model="m", messages=ASK, max_tokens=6, reasoning_effort="high", stream=True) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in streamed) == \
        thought.model_extra["reasoning_content"]


def test_openai_tool_calls_forced_named_streamed_and_auto(served):
    client = served.openai()
    forced = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=64,
                                            tool_choice="required", parallel_tool_calls=False)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "add")
    assert isinstance(json.loads(call.function.arguments), dict)
    named = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=64, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "add"}})
    args = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert named.choices[0].message.tool_calls[0].function.name == "add"
    assert all(isinstance(value, int) for value in args.values())
    deltas = [c.choices[0] for c in client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=64, tool_choice="required",
        parallel_tool_calls=False, stream=True) if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert [(c.index, c.function.name) for c in calls] == [(0, call.function.name)]
    assert calls[0].function.arguments == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    auto = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=24)
    assert auto.choices[0].message.tool_calls is None  # the demo model answers in text
    assert auto.choices[0].message.content and "<tool_call>" not in auto.choices[0].message.content
    # the call and its result go back through the template
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C."}]
    after = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8)
    assert after.usage.prompt_tokens > auto.usage.prompt_tokens + 20


class Answer(BaseModel):
    passkey: int


def test_openai_structured_output_parses(served):
    messages, _ = case(served, 2)
    client = served.openai()
    parsed = client.chat.completions.parse(model="m", messages=messages, max_tokens=40,
                                           response_format=Answer)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    loose = client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_a_thinking_reply_thinks_then_keeps_the_format(served):
    """With the template's think block open, the format holds after the thinking (the
    demo model never closes it: `</think>` is forced at the budget, half of max_tokens)."""
    parsed = served.openai().chat.completions.parse(
        model="m", messages=ASK, max_tokens=60, response_format=Answer,
        reasoning_effort="high").choices[0].message
    assert parsed.model_extra["reasoning_content"] and isinstance(parsed.parsed, Answer)
    schema = Answer.model_json_schema()
    reply = served.anthropic().messages.create(
        model="m", messages=ASK, max_tokens=60, thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert isinstance(json.loads(reply.content[1].text)["passkey"], int)


def test_openai_errors_are_the_clients_own_exceptions(served):
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=ASK, temperature=5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="top_k") as engine_check:
        client.chat.completions.create(model="m", messages=ASK, extra_body={"top_k": -1})
    assert engine_check.value.body["param"] == "top_k"  # the engine's own check, named
    with pytest.raises(openai.BadRequestError) as fewer:
        client.chat.completions.create(model="m", messages=ASK, n=0)
    assert fewer.value.body["param"] == "n"
    # an unknown field is ignored and named in a header; a known one is still checked
    loose = client.chat.completions.with_raw_response.create(
        model="m", messages=ASK, max_tokens=2, extra_body={"temprature": 1, "zz_new": {}})
    assert loose.headers["x-specprefill-ignored-fields"] == "temprature, zz_new"
    assert loose.parse().choices[0].message.content is not None
    # max_tokens past the context: clamped to what fits, with a warning
    clamped = client.chat.completions.create(model="m", messages=ASK, max_tokens=20000)
    assert re.fullmatch(r"max_tokens clamped from 20000 to \d+: prompt \d+ \+ max_tokens "
                        r"must fit the context of 16384", clamped.model_extra["warnings"][0])
    long = [{"role": "user", "content": "1 " * 17000}]
    with pytest.raises(openai.BadRequestError, match=r"prompt is \d+ tokens, longer than the "
                       r"model's context of 16384"):
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        served.openai(key="wrong").chat.completions.create(model="m", messages=ASK, max_tokens=2)
    for body, status in ((b"{not json", 400), (b"x" * (1 << 20) + b"x", 413)):
        answer = httpx.post(served.base + "/v1/chat/completions", content=body,
                            headers={"authorization": f"Bearer {KEY}",
                                     "content-type": "application/json"})
        assert answer.status_code == status and set(answer.json()["error"]) >= {"message", "type"}
    missing = httpx.get(served.base + "/v1/nothing", headers={"x-api-key": KEY})
    assert missing.status_code == 404 and "error" in missing.json()


def test_a_schema_that_does_not_compile_is_a_400_and_the_engine_goes_on(served):
    """The engine compiles the grammar when it takes the request: {"type": "foo"} is a
    ValueError naming response_format there, never a worker failure."""
    client = served.openai()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, response_format=bad)
    tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, tools=tool,
                                       tool_choice="required")
    assert client.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices


def test_tool_calls_in_the_models_own_format(tmp_path):
    """Forced calls are written and read in the tokenizer's format (Qwen3-Coder XML
    here); a format without a call grammar gets a 400 for a forced choice only."""
    short = {"type": "object", "properties": {"location": {"type": "string", "maxLength": 16}},
             "required": ["location"]}  # XML strings are free text up to their closing tag
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": short}}]
    coder = Served(Engine(demo_variant(tmp_path / "coder", CODER_TEMPLATE, "qwen3_coder"),
                          draft=None), ServerConfig())
    try:
        client = coder.openai()
        forced = client.chat.completions.create(
            model="m", messages=ASK, tools=tools, max_tokens=64, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert forced.choices[0].finish_reason == "tool_calls"
        call = forced.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["location"], str)
        use = coder.anthropic().messages.create(
            model="m", messages=ASK, max_tokens=64, tools=[{"name": "get_weather",
                                                            "input_schema": short}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert [b.type for b in use.content] == ["tool_use"] and use.stop_reason == "tool_use"
        assert isinstance(use.content[0].input["location"], str)
    finally:
        coder.stop()
    pythonic = Served(Engine(demo_variant(tmp_path / "pythonic", DEMO_TEMPLATE, "pythonic"),
                             draft=None), ServerConfig())
    try:
        client = pythonic.openai()
        with pytest.raises(openai.BadRequestError, match="'pythonic'") as refused:
            client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4,
                                           tool_choice="required")
        assert refused.value.body["param"] == "tool_choice"
        auto = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                              max_tokens=4)
        assert auto.choices[0].message.content is not None  # parsed, not constrained
    finally:
        pythonic.stop()


def test_completions_models_and_health(served):
    client = served.openai()
    direct = served.engine.generate_sync("def parse(text):", max_tokens=8)
    assert client.completions.create(model="m", prompt="def parse(text):",
                                     max_tokens=8).choices[0].text == direct.text
    streamed = client.completions.create(model="m", prompt="def parse(text):", max_tokens=8,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct.text
    assert [m.id for m in client.models.list()] == ["demo-target"]
    assert httpx.get(served.base + "/health").json()["status"] == "ok"  # open without a key


# Anthropic ------------------------------------------------------------------------


def test_anthropic_messages_give_the_engines_text_with_usage_and_stop_reasons(served):
    messages, answer = case(served, 3, 600)
    direct = served.engine.generate_sync(messages, max_tokens=10)
    client = served.anthropic()
    reply = client.messages.create(model="m", messages=messages, max_tokens=10)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == direct.text
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[direct.finish_reason]
    with client.messages.stream(model="m", messages=messages, max_tokens=10) as stream:
        assert "".join(stream.text_stream) == direct.text
        final = stream.get_final_message()
    counted = client.messages.count_tokens(model="m", messages=messages).input_tokens
    assert counted == direct.usage.prompt_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    assert final.usage.cache_read_input_tokens >= 256  # the same prompt, from the prefix cache
    cut = client.messages.create(model="m", messages=messages, max_tokens=10,
                                 stop_sequences=[answer[2:4]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == answer[2:4]
    assert cut.content[0].text == direct.text[:direct.text.index(answer[2:4])]


def test_anthropic_tool_use_thinking_and_structured_output(served):
    client = served.anthropic()
    server_tool = {"type": "web_search_20250305", "name": "web_search"}  # left out, not fatal
    forced = client.messages.create(
        model="m", messages=ASK, max_tokens=64, tools=ANTHROPIC_TOOLS + [server_tool],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert forced.stop_reason == "tool_use" and [b.type for b in forced.content] == ["tool_use"]
    use = forced.content[0]
    assert use.name == "get_weather" and isinstance(use.input["location"], str)
    with client.messages.stream(model="m", messages=ASK, max_tokens=64, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}
                                ) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert any(e.type == "input_json" for e in events)
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.stop_reason == "tool_use"
    auto = client.messages.create(model="m", messages=ASK, max_tokens=16, tools=ANTHROPIC_TOOLS)
    assert auto.stop_reason in ("end_turn", "max_tokens") and auto.content[0].type == "text"
    history = ASK + [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "Sunny, 22 C."}]}]
    after = client.messages.create(model="m", messages=history, max_tokens=8,
                                   tools=ANTHROPIC_TOOLS)
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens > \
        auto.usage.input_tokens + auto.usage.cache_read_input_tokens + 20
    thinking = {"type": "enabled", "budget_tokens": 1024}
    thought = client.messages.create(model="m", messages=ASK, max_tokens=12, thinking=thinking)
    assert [b.type for b in thought.content] == ["thinking"]  # the demo never closes </think>
    with client.messages.stream(model="m", messages=ASK, max_tokens=12,
                                thinking=thinking) as stream:
        assert stream.get_final_message().content[0].thinking == thought.content[0].thinking
    schema = {"type": "object", "properties": {"passkey": {"type": "integer"}},
              "required": ["passkey"]}
    messages, _ = case(served, 4)
    structured = client.messages.create(
        model="m", messages=messages, max_tokens=40,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert isinstance(json.loads(structured.content[0].text)["passkey"], int)


def test_anthropic_errors_are_the_clients_own_exceptions(served):
    client = served.anthropic()
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", messages=ASK, max_tokens=4,
                               extra_body={"temperature": 3})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(model="m", messages=ASK, max_tokens=4, extra_body={"top_k": -1})
    loose = client.messages.with_raw_response.create(model="m", messages=ASK, max_tokens=2,
                                                     extra_body={"foo": 1})
    assert loose.headers["x-specprefill-ignored-fields"] == "foo"
    with pytest.raises(anthropic.BadRequestError, match="the last message that is not a "
                       "system message must be a user message"):
        client.messages.create(model="m", max_tokens=4, messages=ASK + [
            {"role": "assistant", "content": "It is"}, {"role": "system", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])
    with pytest.raises(anthropic.AuthenticationError):
        served.anthropic(key="wrong").messages.create(model="m", messages=ASK, max_tokens=2)
    broken = httpx.post(served.base + "/v1/messages", content=b"{not json",
                        headers={"x-api-key": KEY, "content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["type"] == "error"


# streams: keep-alives, disconnects, load ---------------------------------------------


def _events_before_first_token(served, path: str, body: dict) -> tuple:
    """(lines before the first token, every line) of a raw SSE stream."""
    lines = []
    with httpx.stream("POST", served.base + path, json=body, timeout=120,
                      headers={"x-api-key": KEY}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    first = next(i for i, line in enumerate(lines)
                 if re.search(r'"content":"[^"]|text[_.]delta', line))
    return lines[:first], lines


def test_a_long_prefill_stream_gets_keepalives_before_its_first_token(served):
    messages, _ = case(served, 5, 1200)
    before, lines = _events_before_first_token(served, "/v1/chat/completions", {
        "model": "m", "messages": messages, "max_tokens": 2, "stream": True,
        "specprefill": False})
    assert '"role":"assistant"' in before[0]  # sent once the engine has the request
    assert before.count(": keep-alive") >= 1 and lines[-1] == "data: [DONE]"
    messages, _ = case(served, 6, 1200)
    before, _ = _events_before_first_token(served, "/v1/chat/completions", {
        "model": "m", "messages": messages, "max_tokens": 2, "stream": True,
        "specprefill": False, "progress": True})
    progress = [json.loads(line[6:])["progress"] for line in before if '"progress"' in line]
    assert progress and progress[-1]["phase"] == "prefill"
    messages, _ = case(served, 7, 1200)
    before, lines = _events_before_first_token(served, "/v1/messages", {
        "model": "m", "messages": messages, "max_tokens": 2, "stream": True,
        "specprefill": False})
    assert before[0] == "event: message_start" and before.count("event: ping") >= 1
    assert lines[-2:] == ["event: message_stop", 'data: {"type": "message_stop"}']


def test_a_client_that_disconnects_aborts_its_request(served):
    messages, _ = case(served, 8, 600)
    body = {"model": "m", "messages": messages, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", served.base + "/v1/chat/completions", json=body, timeout=60,
                      headers={"x-api-key": KEY}) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break
    assert served.settled(), served.engine.active_request_ids
    body["stream"] = False  # a whole-result request: the client gives up waiting
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.base + "/v1/messages", json=body, headers={"x-api-key": KEY},
                   timeout=0.5)
    assert served.settled(), served.engine.active_request_ids


async def test_32_streams_a_third_disconnecting_each_finished_text_is_the_engines(served):
    tokenizer = served.engine.tokenizer
    prompts = [[dict(m) for m in make_case(tokenizer, 100 + i, "passkey", 80).messages]
               for i in range(32)]
    direct = await asyncio.gather(*[served.engine.generate(p, max_tokens=8) for p in prompts])
    expected = [r.text for r in direct]
    client = served.openai(cls=openai.AsyncOpenAI)
    rng = random.Random(0)

    async def one(prompt, leave_after):
        stream = await client.chat.completions.create(model="m", messages=prompt, max_tokens=8,
                                                      stream=True)
        parts = []
        async for chunk in stream:
            if leave_after is not None and len(parts) >= leave_after:
                await stream.close()
                return None
            parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    for _ in range(2):
        leaving = set(rng.sample(range(32), 11))
        texts = await asyncio.gather(*[one(p, rng.randrange(0, 6) if i in leaving else None)
                                       for i, p in enumerate(prompts)])
        for i, text in enumerate(texts):
            if i not in leaving:
                assert text == expected[i], i
        assert await asyncio.to_thread(served.settled)
    await client.close()
    left = await asyncio.to_thread(left_behind)
    assert not left, left[:3]  # nothing of the 64 requests is kept on either side


def left_behind(timeout: float = 10.0) -> list:
    """The RequestStates and EventStreams still alive, polled until none are (or the
    timeout): the server's thread may still be closing a response whose request has left."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        left = [o for o in gc.get_objects() if isinstance(o, (RequestState, EventStream))]
        if not left or time.monotonic() > deadline:
            return left
        del left
        time.sleep(0.05)


# agent frameworks -------------------------------------------------------------------


def _check_agent(messages) -> None:
    kinds = [type(m).__name__ for m in messages]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    assert messages[1].tool_calls[0]["name"] == "get_weather"
    assert messages[2].content.startswith("It is sunny in ")
    assert not messages[3].tool_calls and messages[3].text.strip()


@pytest.mark.parametrize("flavour", ["openai", "anthropic"])
def test_langchain_create_agent_calls_a_tool_and_answers(served, flavour):
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(location: str) -> str:
        """Get the weather at a location."""
        return f"It is sunny in {location}."

    class FirstCallForced(AgentMiddleware):
        """One forced call (as the LangChain test's LookUpFirst), then free answers."""

        def wrap_model_call(self, request, handler):
            settings = dict(request.model_settings, parallel_tool_calls=False)
            if any(isinstance(m, ToolMessage) for m in request.messages):
                return handler(request.override(model_settings=settings))
            return handler(request.override(tool_choice="any", model_settings=settings))

    if flavour == "openai":
        from langchain_openai import ChatOpenAI

        model = ChatOpenAI(model="demo-target", base_url=served.base + "/v1", api_key=KEY,
                           max_tokens=64, temperature=0, max_retries=0)
    else:
        from langchain_anthropic import ChatAnthropic

        model = ChatAnthropic(model="demo-target", base_url=served.base, api_key=KEY,
                              max_tokens=64, temperature=0, max_retries=0)
    agent = create_agent(model, [get_weather], middleware=[FirstCallForced()])
    _check_agent(agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]})
                 ["messages"])


async def test_openai_agents_sdk_runs_one_tool_call(served):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # no export to anyone's servers
    calls = []

    @function_tool
    def get_weather(location: str) -> str:
        """Get the weather at a location."""
        calls.append(location)
        return f"It is sunny in {location}."

    client = served.openai(cls=openai.AsyncOpenAI)
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="demo-target", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=48, temperature=0))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    await client.close()


# the engine gone; the CLI's drain and overload ------------------------------------------


def test_the_server_runs_the_model_once_before_it_accepts_and_keeps_nothing_of_it():
    """The warm-up (a GPU builds each kernel on its first use, which a session's first
    request would otherwise wait for) ran before the port accepted: the target's first
    prefill is behind it, and it left nothing in the prefix caches or the policy's
    records; the first request answers as a fresh engine's."""
    served = Served(Engine(), ServerConfig())
    try:
        runtime = served.engine._worker.runtime
        assert "target" in runtime.costs.warm
        memory = served.engine.stats()["memory"]
        assert (memory.prefix_cache, memory.draft_prefix_cache, memory.requests) == (0, 0, {})
        assert not runtime.decisions.records and not runtime.decisions.prompts
        answer = served.openai().chat.completions.create(model="m", messages=ASK, max_tokens=6,
                                                         temperature=0)
    finally:
        served.stop()
    with Engine() as fresh:
        assert answer.choices[0].message.content == fresh.generate_sync(
            ASK, max_tokens=6, temperature=0).text


def test_an_engine_that_is_gone_is_a_503_in_both_shapes():
    served = Served(Engine(), ServerConfig())
    try:
        served.engine.shutdown_sync()
        with pytest.raises(openai.InternalServerError) as gone:
            served.openai().chat.completions.create(model="m", messages=ASK, max_tokens=2)
        assert gone.value.status_code == 503 and "shut down" in gone.value.message
        with pytest.raises(anthropic.APIStatusError) as gone:
            served.anthropic().messages.create(model="m", messages=ASK, max_tokens=2,
                                               stream=True)
        assert gone.value.status_code == 503
        assert gone.value.body["error"]["type"] == "overloaded_error"
        assert httpx.get(served.base + "/health").status_code == 503
    finally:
        served.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_refuses_past_its_bound_and_drains_at_sigterm():
    port = _free_port()
    env = dict(os.environ, SPECPREFILL_API_KEY=KEY,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "specprefill_engine.cli", "serve", "--port", str(port),
         "--max-batch-size", "2", "--max-queued", "0", "--drain-timeout", "10",
         "--log-level", "info"], env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        long = client.chat.completions.create(model="m", messages=ASK, max_tokens=5000,
                                              stream=True, extra_body={"ignore_eos": True})
        short = client.chat.completions.create(model="m", messages=ASK, max_tokens=20,
                                               stream=True, extra_body={"ignore_eos": True})
        next(long), next(short)
        with pytest.raises(openai.RateLimitError) as full:  # 2 in flight: the bound
            client.chat.completions.create(model="m", messages=ASK, max_tokens=2)
        assert full.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.RateLimitError):
            anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(
                model="m", messages=ASK, max_tokens=2)
        process.send_signal(signal.SIGTERM)
        finished = [c for c in short]
        assert finished[-1].choices[0].finish_reason == "length"  # drained to its end
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in long:  # aborted when the drain ran out: a final error event
                pass
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == -signal.SIGTERM
        assert "engine shut down" in stderr and "Traceback" not in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_one_greedy_request_answers_alike_through_every_api(fresh_cache_dir):
    """On a fresh cache folder, with the default policy (which learns costs from each
    request): the same chat through the OpenAI client, plain and streamed, and through
    the Anthropic client, plain and streamed, gets the same text and kept tokens. On
    115a5ba what the engine had learned from the first request changed the next ones."""
    served = Served(Engine(), ServerConfig(api_key=KEY))
    try:
        messages, _ = case(served, 44, 2500)
        openai_client, anthropic_client = served.openai(), served.anthropic()
        texts, kept = [], []
        for stream in (False, True):
            if stream:
                chunks = list(openai_client.chat.completions.create(
                    model="m", messages=messages, max_tokens=10, temperature=0, stream=True))
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks
                                     if c.choices))
            else:
                reply = openai_client.chat.completions.create(
                    model="m", messages=messages, max_tokens=10, temperature=0)
                texts.append(reply.choices[0].message.content)
                kept.append(reply.model_extra["specprefill"]["kept_tokens"])
            options = dict(model="m", messages=messages, max_tokens=10,
                           extra_body={"temperature": 0})
            if stream:
                with anthropic_client.messages.stream(**options) as events:
                    texts.append(events.get_final_text())
            else:
                reply = anthropic_client.messages.create(**options)
                texts.append(reply.content[0].text)
        direct = served.engine.generate_sync(messages, max_tokens=10)
    finally:
        served.stop()
    assert texts == [direct.text] * 4, texts
    assert kept == [direct.specprefill.kept_tokens]


def test_a_librarys_value_or_type_error_is_the_servers_500_and_a_check_is_a_400():
    """A request the engine's checks refuse is a 400 naming the parameter; a ValueError or
    TypeError a library raises inside the server is its own failure, a 500 (an llguidance
    that took one end token answered every tool request with a 400 the client could not
    fix, and clients and the replay took it for their own fault)."""
    from specprefill_engine.engine.options import RequestOptions
    from specprefill_server.errors import classify

    try:
        RequestOptions(keep=2.0)
    except ValueError as error:
        check = classify(error, ("keep",))
    try:
        json.loads(5)
    except TypeError as error:
        library = classify(error)
    assert check.status == 400 and check.param == "keep"
    assert library.status == 500 and "TypeError" in library.message


def test_a_request_the_device_ran_out_of_memory_for_is_a_retryable_503():
    """A forward that ran out of device memory (32 agent sessions on an H100) failed its
    request as a 500 api_error, which clients do not take for a passing overload."""
    from specprefill_server.errors import anthropic_body, classify

    from specprefill_engine.engine import RequestFailedError

    error = classify(RequestFailedError("request 'msg_1' failed: RuntimeError('cudaMallocAsync"
                                        "(&data, size, stream) failed: out of memory')"))
    metal = classify(RequestFailedError("request 'r' failed: RuntimeError('[METAL] Command "
                                        "buffer execution failed: Insufficient Memory')"))
    other = classify(RequestFailedError("request 'r' failed: RuntimeError('boom')"))
    assert error.status == 503 and error.code == "out_of_memory"
    assert anthropic_body(error)["error"]["type"] == "overloaded_error"
    assert "--kv-cache-gb" in error.message
    assert metal.status == 503 and other.status == 500
