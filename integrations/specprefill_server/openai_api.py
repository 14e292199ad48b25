"""OpenAI's chat completions (`POST /v1/chat/completions`) and completions
(`POST /v1/completions`).

Request bodies are pydantic models: the fields they know are validated (a bad value is
a 400 naming it), the ones they do not are accepted and ignored (`chat.note_ignored`:
a log warning, the `x-specprefill-ignored-fields` header). Fields of the API that
change nothing on a local engine (`user`, `metadata`, `store`, ...) are accepted;
fields whose effect is not served (`n` > 1, `logprobs`, audio, ...) are refused with a
400 naming them. A `max_tokens` past the context is clamped to what fits (the reply's
`warnings` say so). Extensions, sent in the body (the clients'
`extra_body`): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `keep`,
`specprefill`, `threshold`, `chat_template_kwargs`, `progress` (prefill progress
events instead of bare keep-alives). Responses carry the engine's report under
`specprefill` and its `timings`.
"""

import json
import time
import uuid
from dataclasses import asdict
from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from mlx_lm.sample_utils import make_logits_processors
from pydantic import ConfigDict, Field
from starlette.responses import JSONResponse

from .chat import Call, Extensions, Loose, given_options, note_ignored, prepare, read_events, report
from .errors import APIError, openai_body
from .streaming import EventStream, output_events, whole_result

router = APIRouter()
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINISH = {"stop": "stop", "length": "length"}


class Function(Loose):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


class Tool(Loose):
    type: Literal["function"] = "function"
    function: Function


class CalledFunction(Loose):
    name: str
    arguments: str = "{}"


class ToolCall(Loose):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class StreamOptions(Loose):
    include_usage: bool = False


class Common(Extensions):
    """What chat completions and completions share (unknown fields: `note_ignored`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    top_k: Optional[int] = None  # an extension here


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True
    response_format: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Optional[dict] = None
    # accepted; nothing to do on a local engine
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict] = None
    safety_identifier: Optional[str] = None
    verbosity: Optional[str] = None
    modalities: Optional[list[str]] = None
    # refused when given
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    moderation: Optional[Any] = None


class CompletionRequest(Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


NOT_SERVED = ("audio", "prediction", "web_search_options", "functions", "function_call",
              "moderation")


def _refuse_unserved(body: Common) -> None:
    for name in NOT_SERVED:
        if getattr(body, name, None) is not None:
            raise APIError(400, f"{name} is not served by this server (a local text model)",
                           name)
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
    if getattr(body, "modalities", None) not in (None, ["text"]):
        raise APIError(400, "modalities: only ['text'] is served", "modalities")
    if getattr(body, "logprobs", None) or getattr(body, "top_logprobs", None):
        name = "top_logprobs" if getattr(body, "top_logprobs", None) else "logprobs"
        raise APIError(400, f"{name} is not served (the engine returns no log-probabilities)",
                       name)
    if getattr(body, "echo", None) or getattr(body, "suffix", None):
        raise APIError(400, "echo and suffix are not served", "echo" if body.echo else "suffix")
    if getattr(body, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of must be 1", "best_of")


def _processors(body: Common, vocab_size: int, max_tokens: int) -> list:
    """mlx-lm's logit bias and presence / frequency penalties, over this reply."""
    bias = None
    if body.logit_bias:
        try:
            bias = {int(token): value for token, value in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
        if any(not 0 <= token < vocab_size for token in bias) or \
                any(not -100 <= value <= 100 for value in bias.values()):
            raise APIError(400, f"logit_bias: token ids must be in [0, {vocab_size}) and "
                           "biases in [-100, 100]", "logit_bias")
    return make_logits_processors(
        logit_bias=bias, presence_penalty=body.presence_penalty or None,
        presence_context_size=max_tokens, frequency_penalty=body.frequency_penalty or None,
        frequency_context_size=max_tokens)


def engine_options(body: Common, info, max_tokens: Optional[int]) -> dict:
    """The engine's keyword arguments for the sampling fields; no max_tokens given
    means the rest of the context (as OpenAI does), clamped to fit."""
    _refuse_unserved(body)
    options = given_options(body)
    if max_tokens is not None:  # past the context: clamped, with a warning
        options.update(max_tokens=max_tokens, clamp_max_tokens=True)
    elif info.context_length:
        options.update(max_tokens=info.context_length, clamp_max_tokens=True)
    if body.stop:
        options["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    processors = _processors(body, info.vocab_size, options.get("max_tokens", 256))
    if processors:
        options["logits_processors"] = processors
    return options


# chat completions ------------------------------------------------------------------


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            parts.append(part.get("text") or "")
        elif kind != "refusal":
            raise APIError(400, f"{where}[{index}] is a {kind!r} part; this server serves a "
                           "text-only model: send text parts", "messages")
    return "".join(parts)


def chat_messages(messages: list, developer_role: bool) -> list:
    """OpenAI messages -> the dicts chat templates take."""
    chat = []
    for index, message in enumerate(messages):
        role = message.role
        if role == "developer" and not developer_role:
            role = "system"  # templates that know no developer role show it as system
        entry = {"role": role, "content": _text(message.content, f"messages[{index}].content")}
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content:
            entry["reasoning_content"] = message.reasoning_content
        chat.append(entry)
    return chat


def response_format(format_: Optional[dict], name: str = "response_format") -> Optional[dict]:
    """The engine's response_format for an OpenAI format (`name`: the field it came in)."""
    if format_ is None or format_.get("type") == "text":
        return None
    if format_.get("type") not in ("json_object", "json_schema"):
        raise APIError(400, f"{name} type must be 'text', 'json_object' or 'json_schema', "
                       f"got {format_.get('type')!r}", name.split(".")[0])
    return format_


def _template_kwargs(body: ChatRequest) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = body.reasoning_effort not in ("none", "minimal")
    return kwargs


async def chat_call(state, body: ChatRequest) -> Call:
    info = state.engine.info
    options = engine_options(body, info, body.max_completion_tokens or body.max_tokens)
    template = getattr(info.tokenizer, "chat_template", None) or ""
    chat = chat_messages(body.messages, "developer" in template)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
    return await prepare(
        state.engine, chat, options, tools=tools, choice=body.tool_choice,
        parallel=body.parallel_tool_calls,
        response_format=response_format(body.response_format),
        template_kwargs=_template_kwargs(body))


def usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _call_json(call) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.args}}


def _finish(reason: str, calls: bool) -> str:
    return "tool_calls" if calls and reason == "stop" else FINISH.get(reason, reason)


def stream_error(error: APIError) -> bytes:
    return b"data: " + json.dumps(openai_body(error)).encode() + b"\n\n"


async def sse(state, body: Common, call: Call, response_id: str, object_: str, choice,
              opening: Optional[str] = None):
    """The SSE frame both endpoints share: the `opening` choice (None: a comment) once
    the engine has the request, keep-alives and progress while the prefill runs,
    `choice(kind, value)` -> the choice JSON text of one output event, the engine's
    report after the last one, the usage chunk, `[DONE]`."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = ('data: {"id":"%s","object":"%s","created":%d,"model":%s,'
            % (response_id, object_, int(time.time()), json.dumps(state.model_name)))
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    async for kind, value in output_events(state.engine, state.gate, call, response_id,
                                           state.config.keepalive, body.progress):
        if kind == "ping" or (kind == "open" and opening is None):
            yield b": keep-alive\n\n"
        elif kind == "open":
            yield f'{head}"choices":[{opening}]{tail}'.encode()
        elif kind == "progress":
            yield f'{head}"choices":[],"progress":{json.dumps(asdict(value))}{tail}'.encode()
        elif kind != "end":
            yield f'{head}"choices":[{choice(kind, value)}]{tail}'.encode()
        else:
            extra = json.dumps(report(value))[1:-1]
            yield f'{head}"choices":[{choice(kind, value)}],{extra}{tail}'.encode()
            if include_usage:
                yield f'{head}"choices":[],"usage":{json.dumps(usage(value.usage))}}}\n\n'.encode()
    yield b"data: [DONE]\n\n"


def _delta(text: str, finish: str = "null") -> str:
    return f'{{"index":0,"delta":{text},"logprobs":null,"finish_reason":{finish}}}'


ROLE_DELTA = _delta('{"role":"assistant","content":""}')  # opens a reply, as OpenAI's does


def chat_choices():
    """Output events -> chat.completion.chunk choices (the last one says "tool_calls"
    when the reply made calls)."""
    called = False

    def choice(kind: str, value) -> str:
        nonlocal called
        if kind == "content" or (kind == "tool_call" and value.error is not None):
            return _delta('{"content":%s}' % json.dumps(value if kind == "content" else value.args))
        if kind == "reasoning":
            return _delta('{"reasoning_content":%s}' % json.dumps(value))
        if kind == "tool_call":
            called = True
            return _delta(json.dumps({"tool_calls": [dict(_call_json(value), index=value.index)]}))
        return _delta("{}", json.dumps(_finish(value.finish_reason, called)))

    return choice


def chat_reply(state, call: Call, response_id: str, result) -> JSONResponse:
    output = read_events(call.reply(state.engine.tokenizer, result))
    message = {"role": "assistant", "content": output.content or
               (None if output.calls else ""), "refusal": None}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.calls:
        message["tool_calls"] = [_call_json(c) for c in output.calls]
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": int(time.time()),
        "model": state.model_name,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish(result.finish_reason, bool(output.calls))}],
        "usage": usage(result.usage), **report(result), "warnings": result.warnings})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    call = await chat_call(state, body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return EventStream(sse(state, body, call, response_id, "chat.completion.chunk",
                               chat_choices(), ROLE_DELTA), stream_error,
                           ChatRequest.model_fields)
    return chat_reply(state, call, response_id, await whole_result(request, call, response_id))


# completions -----------------------------------------------------------------------


def _prompt(prompt) -> Union[str, list]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    return prompt


def text_choice(kind: str, value) -> str:
    """Output events -> text_completion choices."""
    text, finish = (value, None) if kind == "content" else ("", FINISH.get(
        value.finish_reason, value.finish_reason))
    return (f'{{"text":{json.dumps(text)},"index":0,"logprobs":null,'
            f'"finish_reason":{json.dumps(finish)}}}')


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    options = engine_options(body, state.engine.info, body.max_tokens or COMPLETION_MAX_TOKENS)
    call = Call(_prompt(body.prompt), options, stops=tuple(options.get("stop") or ()), raw=True)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return EventStream(sse(state, body, call, response_id, "text_completion", text_choice),
                           stream_error, CompletionRequest.model_fields)
    result = await whole_result(request, call, response_id)
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": int(time.time()),
        "model": state.model_name,
        "choices": [{"text": result.text, "index": 0, "logprobs": None,
                     "finish_reason": FINISH.get(result.finish_reason, result.finish_reason)}],
        "usage": usage(result.usage), **report(result), "warnings": result.warnings})
