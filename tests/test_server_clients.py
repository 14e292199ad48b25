"""The agent CLIs' own requests, replayed: request bodies captured from the real Claude
Code, Codex, OpenCode, aider, `llm` and the OpenAI Agents SDK (`tests/fixtures/clients/`,
captured by `tests/clients/clients.sh` through `tests/clients/capture.py`; README there),
each sent as it was to a real uvicorn serving a tiny random-weight model with a 64K
window (`models.save_long_context_model`: Claude Code's ~28K-token prompt does not fit
the demo pair's 16K). Each must give a 200, a stream in its API's event grammar (every
event validated as the official SDK's own type) and the text a direct engine call
gives. A three-turn Claude Code session must read each turn's prompt from the prefix
cache. Also: what the replays rely on, one by one (unknown fields, a template without
mid-conversation system messages, tool schemas llguidance cannot compile, namespaced
and custom Responses tools, the forced parallel-call bound).
"""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseCustomToolCall, ResponseStreamEvent
from pydantic import TypeAdapter

from chat_templates import DEMO_TEMPLATE, demo_variant
from models import save_long_context_model
from specprefill_engine import Engine
from specprefill_engine.chat.constrained import MAX_PARALLEL_CALLS
from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent, ToolCallEvent
from specprefill_engine.chat.tool_calls import OutputParser
from specprefill_server import ServerConfig
from specprefill_server.anthropic_api import MessagesRequest, messages_call
from specprefill_server.calls import served as served_events
from specprefill_server.openai_api import ChatRequest, chat_call
from specprefill_server.responses_api import Items, ResponsesRequest, _tools, chat_request
from test_server import ASK, KEY, Served

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
ANTHROPIC_EVENTS = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENTS = TypeAdapter(ResponseStreamEvent)
GENERATING = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


def records(client: str) -> list:
    """The captured requests of one client that ask for a reply, in the order sent."""
    found = [json.loads(path.read_text()) for path in sorted((FIXTURES / client).glob("*.json"))]
    return [r for r in found if r["method"] == "POST" and r["path"].split("?")[0] in GENERATING]


CASES = [(client, index) for client in sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
         for index in range(len(records(client)))]


@pytest.fixture(scope="module")
def long_served(tmp_path_factory):
    folder = save_long_context_model(tmp_path_factory.mktemp("long") / "model")
    served = Served(Engine(model=str(folder), draft=None), ServerConfig(api_key=KEY))
    yield served
    served.stop()


def sse_events(response) -> list:
    """(event name or None, data) of an SSE stream; OpenAI's `[DONE]` as ("done", None)."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append(("done", None) if data == "[DONE]" else (name, json.loads(data)))
            name = None
    return events


def anthropic_text(events: list) -> tuple:
    """(text, thinking, tool_use names, final usage), after checking the grammar: one
    message_start first, blocks opened, filled and closed in index order, message_delta
    then message_stop last."""
    kinds = [data["type"] for _, data in events if data["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_index, next_index, text, thinking, tools = None, 0, "", "", []
    for name, data in events:
        assert name == data["type"]
        if data["type"] == "ping":
            continue
        ANTHROPIC_EVENTS.validate_python(data)
        if data["type"] == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
            if data["content_block"]["type"] == "tool_use":
                tools.append(data["content_block"]["name"])
                assert data["content_block"]["id"].startswith("toolu_")
        elif data["type"] == "content_block_delta":
            assert data["index"] == open_index
            text += data["delta"].get("text", "")
            thinking += data["delta"].get("thinking", "")
        elif data["type"] == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    return text, thinking, tools, events[-2][1]["usage"]


def responses_text(events: list) -> tuple:
    """(output text, reasoning text, call names, final response), after the grammar."""
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    parsed = [RESPONSES_EVENTS.validate_python(data) for _, data in events]
    assert [e.type for e in parsed[:2]] == ["response.created", "response.in_progress"]
    assert parsed[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    calls = [e.item.name for e in parsed if e.type == "response.output_item.done"
             and e.item.type in ("function_call", "custom_tool_call")]
    return text, thought, calls, parsed[-1].response


def chat_text(events: list) -> tuple:
    """(content, reasoning, call names, usage or None), after the grammar."""
    assert events[-1] == ("done", None)
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in events[:-1]]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    text = "".join(d.content or "" for d in deltas)
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    calls = [t.function.name for d in deltas for t in d.tool_calls or []]
    return text, thought, calls, chunks[-1].usage


READERS = {"/v1/messages": anthropic_text, "/v1/responses": responses_text,
           "/v1/chat/completions": chat_text}


def direct(served, path: str, body: dict) -> tuple:
    """(content, reasoning, call names) of the engine itself on the prompt the server
    renders for this body."""
    state = served.app.state.server
    if path == "/v1/messages":
        call = asyncio.run(messages_call(state, MessagesRequest.model_validate(body)))
    elif path == "/v1/responses":
        call = asyncio.run(chat_call(state, chat_request(ResponsesRequest.model_validate(body))[0]))
    else:
        call = asyncio.run(chat_call(state, ChatRequest.model_validate(body)))
    result = served.engine.generate_sync(call.prompt, **call.options)
    events = served_events(call.reply(served.engine.tokenizer, result))
    return ("".join(e.text for e in events if isinstance(e, TextEvent)),
            "".join(e.text for e in events if isinstance(e, ReasoningEvent)),
            [e.name for e in events if isinstance(e, ToolCallEvent)])


def replay(served, record: dict) -> tuple:
    path = record["path"].split("?")[0]
    body = dict(record["body"], stream=True)
    with httpx.stream("POST", served.base + record["path"], json=body, timeout=900,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200, response.read()
        return path, body, READERS[path](sse_events(response))


@pytest.mark.parametrize("client, index", CASES)
def test_a_captured_request_gives_a_valid_stream_and_the_engines_text(long_served, client,
                                                                       index):
    record = records(client)[index]
    path, body, (text, thought, calls, _) = replay(long_served, record)
    assert (text, thought, calls) == direct(long_served, path, body)


def test_a_claude_code_session_reads_each_turn_from_the_prefix_cache(long_served):
    """Three turns of one Claude Code session (tools on): from turn 2, the cached tokens
    are >= 90% of the previous turn's prompt."""
    turns = [r for r in records("claude-code-turns") if r["body"].get("tools")]
    assert len(turns) >= 3
    prompts = []
    for number, record in enumerate(turns):
        _, _, (_, _, _, usage) = replay(long_served, record)
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        if number:
            assert usage["cache_read_input_tokens"] >= 0.9 * prompts[-1], (number, usage)
        prompts.append(prompt)
    assert prompts[0] > 16384  # past the demo pair's window


# what the replays rely on ----------------------------------------------------------


def test_unknown_fields_are_ignored_and_named_known_ones_still_checked(long_served):
    base = long_served.base
    headers = {"x-api-key": KEY}
    reply = httpx.post(base + "/v1/responses", headers=headers, json={
        "model": "m", "input": "hi", "max_output_tokens": 2, "client_metadata": {"a": "b"},
        "brand_new_field": 1})
    assert reply.status_code == 200 and Response.model_validate(reply.json())
    assert reply.headers["x-specprefill-ignored-fields"] == "brand_new_field"
    bad = httpx.post(base + "/v1/responses", headers=headers, json={
        "model": "m", "input": "hi", "max_output_tokens": 0, "brand_new_field": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_output_tokens"
    models = httpx.get(base + "/v1/models", headers=headers).json()["data"][0]
    assert models["context_length"] == models["max_model_len"] == 65536


def test_system_messages_anywhere_and_metadata_lines(tmp_path):
    """A template that refuses a system message after the first turn: it joins the user
    message before it, so the turns before keep their prefix-cache entry; Claude Code's
    billing-header block, or any `x-name: value` line of a system prompt, changes nothing
    in the prompt (`ServerConfig.metadata_lines`)."""
    strict = DEMO_TEMPLATE.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system messages go first') }}{% endif %}", 1)
    served = Served(Engine(demo_variant(tmp_path / "strict", strict, "json_tools"), draft=None),
                    ServerConfig())
    try:
        client = served.anthropic()
        billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.1;"}
        first = [{"role": "user", "content": "Hello there."},
                 {"role": "system", "content": "Agents: none."}]
        one = client.messages.create(model="m", max_tokens=4, messages=first,
                                     system=[billing, {"type": "text", "text": "Be brief."}])
        later = first + [{"role": "assistant", "content": one.content[0].text or "ok"},
                         {"role": "user", "content": "Again."}]
        billing["text"] = "x-anthropic-billing-header: cc_version=2.0.7;"
        two = client.messages.create(model="m", max_tokens=4, messages=later,
                                     system=[billing, {"type": "text", "text": "Be brief."}])
        first_prompt = one.usage.input_tokens + one.usage.cache_read_input_tokens
        assert two.usage.cache_read_input_tokens >= 0.9 * first_prompt
        rendered = served.engine.render([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello there.\n\nAgents: "
                                          "none."}])
        assert first_prompt == rendered.tokens.size
        # a system prompt that ends with a line changing on every request: the next turn
        # reads the whole previous prompt from cache, through chat completions and Responses
        openai_client = served.openai()

        def header(turn: int) -> str:
            return f"Be brief.\nx-request-context: cch={turn * 7919:05x}; request={turn}"
        chat = [{"role": "system", "content": header(1)}, {"role": "user", "content": "Hi."}]
        one = openai_client.chat.completions.create(model="m", max_tokens=4, messages=chat)
        chat = [{"role": "system", "content": header(2)}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
        two = openai_client.chat.completions.create(model="m", max_tokens=4, messages=chat)
        assert two.usage.prompt_tokens_details.cached_tokens >= 0.9 * one.usage.prompt_tokens
        one = openai_client.responses.create(model="m", max_output_tokens=4,
                                             instructions=header(3), input="Tell me.")
        two = openai_client.responses.create(
            model="m", max_output_tokens=4, instructions=header(4),
            input=[{"role": "user", "content": "Tell me."},
                   {"role": "assistant", "content": "Told."},
                   {"role": "user", "content": "Again."}])
        assert two.usage.input_tokens_details.cached_tokens >= 0.9 * one.usage.input_tokens
    finally:
        served.stop()
    keeping = Served(Engine(draft=None), ServerConfig(metadata_lines=""))
    try:  # metadata_lines="" keeps every line: the changing line reaches the prompt
        said = keeping.openai().chat.completions.create(
            model="m", max_tokens=1, messages=[{"role": "system", "content": "x-a: 1"},
                                               {"role": "user", "content": "Hi."}])
        assert said.usage.prompt_tokens == keeping.engine.render(
            [{"role": "system", "content": "x-a: 1"}, {"role": "user", "content": "Hi."}]
        ).tokens.size
    finally:
        keeping.stop()


CLAUDE_TASK_SCHEMA = {  # Claude Code's TaskCreate `metadata`: llguidance has no propertyNames
    "type": "object", "properties": {"subject": {"type": "string", "maxLength": 40},
                                     "metadata": {"type": "object",
                                                  "propertyNames": {"pattern": "^[a-z]+$"},
                                                  "additionalProperties": {"type": "string"}}},
    "required": ["subject", "metadata"], "additionalProperties": False}


def test_a_tool_schema_llguidance_cannot_compile_is_loosened_and_calls_checked(long_served,
                                                                               caplog):
    tools = [{"name": "TaskCreate", "input_schema": CLAUDE_TASK_SCHEMA}]
    use = long_served.anthropic().messages.create(
        model="m", max_tokens=200, messages=ASK, tools=tools,
        tool_choice={"type": "tool", "name": "TaskCreate", "disable_parallel_tool_use": True})
    assert use.stop_reason in ("tool_use", "max_tokens")
    assert "TaskCreate" in caplog.text and "propertyNames" in caplog.text
    function = [{"type": "function", "function": {"name": "TaskCreate",
                                                  "parameters": CLAUDE_TASK_SCHEMA}}]
    parser = OutputParser(long_served.engine.tokenizer, parse_tools=True, tools=function)
    bad = '<tool_call>\n{"name": "TaskCreate", "arguments": {"subject": "x", "metadata": ' \
          '{"NOT_LOWER": "v"}}}\n</tool_call>'
    call, = parser.feed(bad) + parser.finish("stop")
    assert isinstance(call, ToolCallEvent) and "does not match '^[a-z]+$'" in call.error


def test_namespace_custom_and_hosted_responses_tools(long_served):
    """Codex's tools: a namespace's functions are flattened and come back with their
    namespace; a custom tool comes back as a custom_tool_call; web_search is left out."""
    client = long_served.openai()
    spawn = {"type": "function", "name": "spawn_agent", "description": "Spawn.",
             "parameters": {"type": "object", "properties": {"task": {"type": "string",
                                                                       "maxLength": 12}},
                            "required": ["task"]}}
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
              "tools": [spawn]},
             {"type": "custom", "name": "apply_patch", "description": "Patch."},
             {"type": "web_search", "external_web_access": False}]
    raw = client.responses.with_raw_response.create(
        model="m", input="hi", tools=tools, max_output_tokens=60, parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"})
    call, = Response.model_validate(raw.http_response.json()).output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent",
                                                      "multi_agent_v1")
    # a custom tool's call, as the output items and stream events read it back
    names = _tools(tools)[1]
    items = Items(names)
    events = items.feed(ToolCallEvent(0, "call_1", "apply_patch",
                                      json.dumps({"input": "*** Begin Patch"})))
    for number, (kind, fields) in enumerate(events):
        RESPONSES_EVENTS.validate_python({"type": kind, "sequence_number": number, **fields})
    custom, = items.done
    assert ResponseCustomToolCall.model_validate(custom).input == "*** Begin Patch"
    history = [{"type": "message", "role": "user", "content": "hi"},
               {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent",
                "namespace": "multi_agent_v1", "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "done"},
               {"type": "web_search_call", "id": "ws_1", "status": "completed",
                "action": {"type": "search", "query": "x"}}]
    history += [{"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                 "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "call_1", "output": "applied"}]
    after = client.responses.create(model="m", input=history, tools=tools, max_output_tokens=4)
    alone = client.responses.create(model="m", input="hi", tools=tools, max_output_tokens=4)
    assert after.usage.input_tokens > alone.usage.input_tokens + 20


def test_forced_parallel_calls_stop_at_the_bound_and_a_cut_call_never_reaches_the_text():
    """The demo model, forced to call with parallel calls allowed, writes calls until the
    grammar's bound closes the turn; cut by max_tokens, the unfinished call is dropped."""
    served = Served(Engine(), ServerConfig())
    try:
        client = served.openai()
        tools = [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "maximum": 9},
                                             "b": {"type": "integer", "maximum": 9}},
            "required": ["a", "b"]}}}]
        whole = client.chat.completions.create(model="m", messages=ASK, tools=tools,
                                               tool_choice="required", max_tokens=2000)
        choice = whole.choices[0]
        assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        cut = client.chat.completions.create(model="m", messages=ASK, tools=tools,
                                             tool_choice="required", max_tokens=30)
        assert cut.choices[0].finish_reason == "length"
        assert not cut.choices[0].message.content  # no half call in the text
        streamed = [c.choices[0].delta for c in client.chat.completions.create(
            model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=30,
            stream=True) if c.choices]
        assert not "".join(d.content or "" for d in streamed)
    finally:
        served.stop()
