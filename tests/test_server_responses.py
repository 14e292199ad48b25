"""The Responses API (`POST /v1/responses`) through the official `openai` client against
a real uvicorn on 127.0.0.1 (test_server.py's served demo pair): every text is checked
against the engine's own greedy output, and every JSON against the client's own types
(validated, not just constructed)."""

import json

import openai
import pytest
from pydantic import BaseModel, TypeAdapter

from openai.types.responses import Response, ResponseStreamEvent
from test_server import (  # noqa: F401  (served: the fixture)
    ASK, WEATHER, _events_before_first_token, case, served,
)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather.",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "add", "description": "Add two numbers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}}}}]
EVENTS = TypeAdapter(ResponseStreamEvent)


def created(client, **request) -> Response:
    """A non-streamed response, its JSON validated as the client's `Response`."""
    raw = client.responses.with_raw_response.create(model="m", **request)
    return Response.model_validate(raw.http_response.json())


def streamed(client, **request) -> list:
    """A streamed response's events, each validated as the client's event type."""
    events = [EVENTS.validate_python(event.to_dict())
              for event in client.responses.create(model="m", stream=True, **request)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def joined(events: list, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def expected_status(result) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def test_text_is_the_engines_streamed_or_not_with_usage_and_instructions(served):
    messages, _ = case(served, 21, 600)
    direct = served.engine.generate_sync(messages, max_tokens=8)
    client = served.openai()
    reply = created(client, input=messages[0]["content"], max_output_tokens=8)
    assert reply.output_text == direct.text and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.status == expected_status(direct)
    assert reply.usage.input_tokens == direct.usage.prompt_tokens
    assert reply.usage.output_tokens == len(direct.token_ids)
    assert reply.usage.total_tokens == direct.usage.prompt_tokens + len(direct.token_ids)
    assert reply.usage.input_tokens_details.cached_tokens >= 256  # the direct run's prefix
    assert reply.model_extra["specprefill"]["total_tokens"] == direct.usage.prompt_tokens
    events = streamed(client, input=messages, max_output_tokens=8)
    assert joined(events, "response.output_text.delta") == direct.text
    assert [e.type for e in events if "output_text" in e.type][-1] == "response.output_text.done"
    last = events[-1]
    assert last.type == f"response.{expected_status(direct)}"
    assert last.response.output_text == direct.text
    assert last.response.usage.output_tokens == len(direct.token_ids)
    with client.responses.stream(model="m", input=messages, max_output_tokens=8) as stream:
        assert stream.get_final_response().output_text == direct.text  # the SDK's own assembly
    # the next turn, the reply's own items in its input: the chat the engine would see
    again = [{"role": "user", "content": "Say it again."}]
    turn = messages + [{"role": "assistant", "content": direct.text}] + again
    second = created(client, input=messages + [item.model_dump(exclude_none=True)
                                               for item in reply.output] + again,
                     max_output_tokens=4)
    assert second.output_text == served.engine.generate_sync(turn, max_tokens=4).text
    system = [{"role": "system", "content": "Answer in one word."}] + ASK
    instructed = created(client, instructions=system[0]["content"], input=ASK[0]["content"],
                         max_output_tokens=8)
    assert instructed.output_text == served.engine.generate_sync(system, max_tokens=8).text
    assert instructed.instructions == system[0]["content"]


def test_a_cut_reply_is_incomplete(served):
    client = served.openai()
    cut = created(client, input=ASK, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[-1].status == "incomplete" and cut.usage.output_tokens == 3
    events = streamed(client, input=ASK, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_function_calls_forced_streamed_and_the_next_turn(served):
    messages, _ = case(served, 22, 600)
    client = served.openai()
    forced = created(client, input=messages, tools=TOOLS, max_output_tokens=64,
                     parallel_tool_calls=False,
                     tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in forced.output] == ["function_call"]
    call = forced.output[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["location"], str)
    assert forced.tool_choice.name == "get_weather" and len(forced.tools) == 2
    events = streamed(client, input=messages, tools=TOOLS, max_output_tokens=64,
                      tool_choice="required", parallel_tool_calls=False)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    assert joined(events, "response.function_call_arguments.delta") == done[0].arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done[0].arguments
    assert isinstance(json.loads(done[0].arguments), dict)
    # the call and its output go back as input items; the first turn's prompt is cached
    turn = messages + [call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "Sunny, 22 C."}]
    after = created(client, input=turn, tools=TOOLS, max_output_tokens=8)
    assert after.usage.input_tokens > forced.usage.input_tokens + 10
    assert after.usage.input_tokens_details.cached_tokens >= 256


class Answer(BaseModel):
    passkey: int


def test_text_format_json_schema_and_reasoning(served):
    messages, _ = case(served, 23)
    client = served.openai()
    schema = {"type": "json_schema", "name": "answer", "schema": Answer.model_json_schema(),
              "strict": True}
    shaped = created(client, input=messages, max_output_tokens=40, text={"format": schema})
    assert isinstance(Answer.model_validate_json(shaped.output_text).passkey, int)
    parsed = client.responses.parse(model="m", input=messages, max_output_tokens=40,
                                    text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer)
    loose = created(client, input=messages, max_output_tokens=40,
                    text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(loose.output_text), dict)
    # an open think block: a reasoning item (the demo model never closes it)
    thought = created(client, input=ASK, max_output_tokens=6, reasoning={"effort": "high"})
    assert [item.type for item in thought.output] == ["reasoning"]
    assert thought.output[0].content[0].text
    assert 0 < thought.usage.output_tokens_details.reasoning_tokens <= 6
    events = streamed(client, input=ASK, max_output_tokens=6, reasoning={"effort": "high"})
    assert joined(events, "response.reasoning_text.delta") == thought.output[0].content[0].text


def test_errors_are_the_clients_own_exceptions(served):
    client = served.openai()
    refused = {"tools": {"tools": [{"type": "namespace", "name": "ns"}]},
               "previous_response_id": {"previous_response_id": "resp_1"},
               "conversation": {"conversation": "conv_1"},
               "background": {"background": True},
               "include": {"include": ["message.output_text.logprobs"]},
               "temperature": {"temperature": 5},
               "reasoning": {"reasoning": {"effort": 5}},
               "text": {"text": {"format": {"type": "grammar"}}},
               "input": {"input": [{"type": "item_reference", "id": "msg_1"}]},
               "tool_choice": {"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}}
    for param, request in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(**{"model": "m", "input": ASK, "max_output_tokens": 2,
                                       **request})
        assert bad.value.status_code == 400 and bad.value.body["param"] == param, param
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(model="m", input=ASK, previous_response_id="resp_1")
    long = "1 " * 17000
    for stream in (False, True):  # a refused stream is a JSON 400, not a 200 stream
        with pytest.raises(openai.BadRequestError, match=r"prompt is \d+ tokens, longer than "
                           r"the model's context of 16384"):
            client.responses.create(model="m", input=long, max_output_tokens=4, stream=stream)
    with pytest.raises(openai.AuthenticationError):
        served.openai(key="wrong").responses.create(model="m", input=ASK, max_output_tokens=2)
    assert created(client, input=ASK, max_output_tokens=2, store=True).output  # nothing stored


def test_keepalives_a_client_that_leaves_and_a_failure_mid_stream(served):
    messages, _ = case(served, 24, 1200)
    before, lines = _events_before_first_token(served, "/v1/responses", {
        "model": "m", "input": messages, "max_output_tokens": 2, "stream": True,
        "specprefill": False})
    assert before[0] == "event: response.created" and ": keep-alive" in before
    assert lines[-2] in ("event: response.completed", "event: response.incomplete")
    # a client that leaves mid-stream aborts its request
    with served.openai().responses.create(model="m", input=ASK, max_output_tokens=2000,
                                          stream=True, extra_body={"ignore_eos": True}) as left:
        for event in left:
            if event.type == "response.output_text.delta":
                break
    assert served.settled(), served.engine.active_request_ids
    # the engine stops a request mid-stream: an error event, then response.failed
    client = served.openai()
    stream = client.responses.create(model="m", input=ASK, max_output_tokens=2000, stream=True,
                                     extra_body={"ignore_eos": True})
    events = []
    for event in stream:
        events.append(EVENTS.validate_python(event.to_dict()))
        if event.type == "response.output_text.delta":
            served.engine.abort(events[0].response.id)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and "aborted" in events[-2].message
    assert served.settled()
