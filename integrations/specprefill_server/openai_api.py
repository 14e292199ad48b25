"""OpenAI's chat completions (`POST /v1/chat/completions`) and completions
(`POST /v1/completions`).

Request bodies are pydantic models: the fields they know are validated (a bad value is
a 400 naming it), the ones they do not are accepted and ignored (`chat.note_ignored`:
a log warning, the `x-specprefill-ignored-fields` header). Fields of the API that
change nothing on a local engine (`user`, `metadata`, `store`, ...) are accepted;
fields whose effect is not served (audio, `prediction`, ...) are refused with a 400
naming them. A `max_tokens` past the context is clamped to what fits (the reply's
`warnings` say so). Extensions, sent in the body (the clients'
`extra_body`): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `keep`,
`specprefill`, `threshold`, `chat_template_kwargs`, `progress` (prefill progress
events instead of bare keep-alives). Responses carry the engine's report under
`specprefill` and its `timings`.

`n` choices run as n requests decoding together in the engine's batch (row i seeded
`seed` + i); `logprobs` are the engine's `TokenLogprob`s (log_softmax of the model's
logits, before processors, penalties and temperature).
"""

import json
import time
import uuid
from dataclasses import asdict, replace
from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from mlx_lm.sample_utils import make_logits_processors
from pydantic import ConfigDict, Field
from starlette.responses import JSONResponse

from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent, ToolCallEvent
from specprefill_engine.engine.results import Progress
from specprefill_engine.engine.sampling import MAX_LOGPROBS, SamplingParams

from .calls import (
    Call, Extensions, Loose, content_text, fold, given_options, note_ignored, prepare, report,
    served,
)
from .errors import APIError, openai_body
from .streaming import (
    KEEP_ALIVE, End, EventStream, KeepAlive, Logprobs, Opened, merged, output_events, sse_event,
    whole_results,
)

router = APIRouter()
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINISH = {"stop": "stop", "length": "length"}
MAX_N = 128  # choices per request (OpenAI's bound)


class Function(Loose):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


class ChatTool(Loose):
    type: Literal["function"] = "function"
    function: Function


class CalledFunction(Loose):
    name: str
    arguments: str = "{}"


class ToolCall(Loose):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Loose):
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
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    top_k: Optional[int] = None  # an extension here


class ChatRequest(Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True
    response_format: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
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
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
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
    if getattr(body, "modalities", None) not in (None, ["text"]):
        raise APIError(400, "modalities: only ['text'] is served", "modalities")
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


def logprobs_asked(body: Common) -> Optional[int]:
    """The engine's `logprobs` (alternatives per token; None: none): chat's `logprobs`
    with `top_logprobs`, completions' `logprobs` count."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


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
    processors = _processors(body, info.vocab_size,
                             options.get("max_tokens", SamplingParams.max_tokens))
    if processors:
        options["logits_processors"] = processors
    logprobs = logprobs_asked(body)
    if logprobs is not None:
        options["logprobs"] = logprobs
    return options


def choice_rows(state, body: Common, call: Call, response_id: str) -> list:
    """The request's `n` choices as (Call, request id): row i seeded with `seed` + i, so
    it is what a single request with that seed gives (unseeded rows sample apart)."""
    n = body.n or 1
    limit = state.gate.limit
    if limit is not None and n > limit:
        raise APIError(400, f"n is {n}, more than the {limit} requests this server takes at "
                       "once", "n")
    if n == 1:
        return [(call, response_id)]
    seed = call.options.get("seed")
    return [(call if seed is None else replace(call, options=dict(call.options, seed=seed + i)),
             f"{response_id}-{i}") for i in range(n)]


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # OpenAI's value for "very unlikely"; JSON has no -Infinity


def chat_logprobs(tokenizer, logprobs: Optional[list]) -> Optional[dict]:
    """TokenLogprobs -> a chat choice's `logprobs` ({"content": [...]})."""
    if logprobs is None:
        return None

    def entry(token: int, value: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode())}

    return {"content": [dict(entry(lp.token, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in logprobs],
            "refusal": None}


def completion_logprobs(tokenizer, logprobs: Optional[list], offset: int = 0) -> Optional[dict]:
    """TokenLogprobs -> a completion choice's `logprobs` (tokens, token_logprobs,
    top_logprobs: the alternatives and the chosen token, text_offset from `offset`)."""
    if logprobs is None:
        return None
    shaped = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        text = tokenizer.decode([lp.token])
        top = {tokenizer.decode([t]): _logprob(v) for t, v in lp.top}
        top.setdefault(text, _logprob(lp.logprob))
        for name, value in zip(shaped, (text, _logprob(lp.logprob), top, offset)):
            shaped[name].append(value)
        offset += len(text)
    return shaped


def summed_usage(results: list):
    """n choices' usage as OpenAI counts it: the prompt once, every choice's tokens."""
    return replace(results[0].usage,
                   completion_tokens=sum(r.usage.completion_tokens for r in results))


def warnings_of(results: list) -> list:
    return list(dict.fromkeys(w for r in results for w in r.warnings))


# chat completions ------------------------------------------------------------------


def chat_messages(messages: list, developer_role: bool) -> list:
    """OpenAI messages -> the dicts chat templates take."""
    chat = []
    for index, message in enumerate(messages):
        role = message.role
        if role == "developer" and not developer_role:
            role = "system"  # templates that know no developer role show it as system
        entry = {"role": role, "content": content_text(
            message.content, f"messages[{index}].content", "messages", skip=("refusal",))}
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
        state, chat, options, tools=tools, choice=body.tool_choice,
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
    return sse_event(None, openai_body(error))


async def sse(state, body: Common, rows: list, response_id: str, object_: str, make_choice,
              opening=None):
    """The SSE frame both endpoints share, over the `rows` (Call, request id) of the `n`
    choices: `opening(index)` (None: a comment) once the engine has a row, keep-alives and
    progress while the prefill runs, `choice(event, logprobs)` -> the choice JSON text of
    one output event or `End` (`make_choice(index)` makes one per row; `logprobs`: the
    row's TokenLogprobs since its last choice, None unasked), the engine's report after a
    row's last one, the usage chunk (every row's summed), `[DONE]`."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # a frame per token is the server's hot path: its fixed head and tail are made once
    # and the choice comes as JSON text, rather than `sse_event` dumping a dict per token
    head = ('data: {"id":"%s","object":"%s","created":%d,"model":%s,'
            % (response_id, object_, int(time.time()), json.dumps(state.model_name)))
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    choices = [make_choice(index) for index in range(len(rows))]
    unsent = [None] * len(rows)  # per row: its TokenLogprobs not yet in a choice
    finals = []
    streams = [output_events(state.engine, state.gate, call, request_id, state.config.keepalive,
                             body.progress) for call, request_id in rows]
    async for index, event in merged(streams):
        if isinstance(event, Logprobs):
            unsent[index] = (unsent[index] or []) + event.values
        elif isinstance(event, KeepAlive) or (isinstance(event, Opened) and opening is None):
            yield KEEP_ALIVE
        elif isinstance(event, Opened):
            yield f'{head}"choices":[{opening(index)}]{tail}'.encode()
        elif isinstance(event, Progress):
            yield f'{head}"choices":[],"progress":{json.dumps(asdict(event))}{tail}'.encode()
        else:
            logprobs, unsent[index] = unsent[index], None if unsent[index] is None else []
            text = choices[index](event, logprobs)
            if not isinstance(event, End):
                yield f'{head}"choices":[{text}]{tail}'.encode()
                continue
            extra = json.dumps(report(event.final))[1:-1]
            yield f'{head}"choices":[{text}],{extra}{tail}'.encode()
            finals.append(event.final)
    if include_usage:
        yield f'{head}"choices":[],"usage":{json.dumps(usage(summed_usage(finals)))}}}\n\n'.encode()
    yield b"data: [DONE]\n\n"


def _delta(text: str, finish: str = "null", index: int = 0, logprobs: str = "null") -> str:
    return f'{{"index":{index},"delta":{text},"logprobs":{logprobs},"finish_reason":{finish}}}'


def role_delta(index: int) -> str:
    return _delta('{"role":"assistant","content":""}', index=index)  # opens a reply, as OpenAI's


def chat_choices(tokenizer):
    """`make_choice` for chat: output events -> chat.completion.chunk choices (the last
    one says "tool_calls" when the reply made calls)."""

    def make_choice(index: int):
        called = False

        def choice(event, logprobs=None) -> str:
            nonlocal called
            finish = "null"
            if isinstance(event, TextEvent):
                text = '{"content":%s}' % json.dumps(event.text)
            elif isinstance(event, ReasoningEvent):
                text = '{"reasoning_content":%s}' % json.dumps(event.text)
            elif isinstance(event, ToolCallEvent):
                called = True
                text = json.dumps({"tool_calls": [dict(_call_json(event), index=event.index)]})
            else:
                text, finish = "{}", json.dumps(_finish(event.final.finish_reason, called))
            return _delta(text, finish, index, json.dumps(chat_logprobs(tokenizer, logprobs)))

        return choice

    return make_choice


def chat_reply(state, call: Call, response_id: str, results: list) -> JSONResponse:
    tokenizer = state.engine.tokenizer
    choices = []
    for index, result in enumerate(results):
        output = fold(served(call.reply(tokenizer, result)))
        message = {"role": "assistant", "content": output.content or
                   (None if output.calls else ""), "refusal": None}
        if output.reasoning:
            message["reasoning_content"] = output.reasoning
        if output.calls:
            message["tool_calls"] = [_call_json(c) for c in output.calls]
        choices.append({"index": index, "message": message,
                        "logprobs": chat_logprobs(tokenizer, result.logprobs),
                        "finish_reason": _finish(result.finish_reason, bool(output.calls))})
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": int(time.time()),
        "model": state.model_name, "choices": choices, "usage": usage(summed_usage(results)),
        **report(results[0]), "warnings": warnings_of(results)})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    call = await chat_call(state, body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    rows = choice_rows(state, body, call, response_id)
    if body.stream:
        return EventStream(sse(state, body, rows, response_id, "chat.completion.chunk",
                               chat_choices(state.engine.tokenizer), role_delta), stream_error,
                           ChatRequest.model_fields)
    return chat_reply(state, call, response_id, await whole_results(request, *zip(*rows)))


# completions -----------------------------------------------------------------------


def _prompt(prompt) -> Union[str, list]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    return prompt


def text_choices(tokenizer):
    """`make_choice` for completions: output events -> text_completion choices."""

    def make_choice(index: int):
        offset = 0  # the text so far, for logprobs' text_offset

        def choice(event, logprobs=None) -> str:
            nonlocal offset
            if isinstance(event, TextEvent):
                text, finish = event.text, None
            else:
                text, finish = "", FINISH.get(event.final.finish_reason, event.final.finish_reason)
            lp = completion_logprobs(tokenizer, logprobs, offset)
            offset += sum(len(token) for token in lp["tokens"]) if lp else 0
            return (f'{{"text":{json.dumps(text)},"index":{index},"logprobs":{json.dumps(lp)},'
                    f'"finish_reason":{json.dumps(finish)}}}')

        return choice

    return make_choice


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    tokenizer = state.engine.tokenizer
    options = engine_options(body, state.engine.info, body.max_tokens or COMPLETION_MAX_TOKENS)
    call = Call(_prompt(body.prompt), options)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    rows = choice_rows(state, body, call, response_id)
    if body.stream:
        return EventStream(sse(state, body, rows, response_id, "text_completion",
                               text_choices(tokenizer)),
                           stream_error, CompletionRequest.model_fields)
    results = await whole_results(request, *zip(*rows))
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": int(time.time()),
        "model": state.model_name,
        "choices": [{"text": result.text, "index": index,
                     "logprobs": completion_logprobs(tokenizer, result.logprobs),
                     "finish_reason": FINISH.get(result.finish_reason, result.finish_reason)}
                    for index, result in enumerate(results)],
        "usage": usage(summed_usage(results)), **report(results[0]),
        "warnings": warnings_of(results)})
