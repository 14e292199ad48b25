"""OpenAI's Responses API (`POST /v1/responses`), without server-side state.

A request is translated into a chat completions request (`openai_api.ChatRequest`) and
runs as one: the same messages, tools, tool choice, formats and engine options.
`instructions` becomes a system message first; `input` items map to chat messages:
messages (text parts) by role, `function_call` items to the assistant's tool calls,
`function_call_output` to tool messages, a `reasoning` item's text to the assistant's
`reasoning_content`. Nothing is stored: `previous_response_id` and `conversation` are
refused (send the whole conversation each turn), `store` is accepted and changes
nothing. Unknown fields are accepted and ignored (`chat.note_ignored`).

Tools, as Codex sends them: `function` tools; `namespace` tools flattened into their
function tools (the model sees each by its own name, `NAMESPACE__NAME` where two
would clash, and its calls come back as `function_call` items with the `namespace`);
`custom` (freeform) tools as a function of one string `input`, their calls as
`custom_tool_call` items. Hosted tools (`web_search`, `file_search`,
`code_interpreter`, `image_generation`, `mcp`, ...) run on OpenAI's side: they are left
out with a warning, as are the items they leave in the input (`web_search_call`, ...).

Output items come back in the order the model wrote them (`reasoning`, `message`,
`function_call`). A stream sends `response.created` and `response.in_progress` once the
engine has the request, keep-alive comments during the prefill, each item as added /
deltas / done, then `response.completed` (`response.incomplete` when max_output_tokens
cut it); a failure mid-stream is an `error` event and `response.failed`. Usage's
`reasoning_tokens` is the think text re-tokenized. Extensions as in `openai_api.py`;
the engine's report under `specprefill` and `timings`.
"""

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from specprefill_engine.chat.parser_events import ReasoningEvent, ToolCallEvent
from specprefill_engine.engine.results import Progress

from .calls import Call, Extensions, Loose, content_text, note_ignored, report, served, warn_once
from .errors import APIError
from .openai_api import (
    CalledFunction, ChatMessage, ChatRequest, ChatTool, Function, ToolCall, chat_call,
    response_format,
)
from .streaming import (
    KEEP_ALIVE, End, EventStream, KeepAlive, Opened, output_events, sse_event, whole_result,
)

router = APIRouter()
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the one `include` served (a no-op)
REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation "
                            "as input",
    "conversation": "this server keeps no conversations: send the whole conversation as input",
    "prompt": "stored prompt templates are not served: send instructions and input",
    "max_tool_calls": "is not served: use parallel_tool_calls=false for one call",
    "context_management": "server-side compaction is not served",
}


class FunctionTool(Loose):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class CustomTool(Loose):
    type: Literal["custom"]
    name: str
    description: Optional[str] = None
    format: Optional[dict] = None  # its grammar is not enforced: the input is free text


class InputMessage(Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[dict]]


class FunctionCall(Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Optional[str] = None


class CustomToolCall(Loose):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


class FunctionCallOutput(Loose):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: Union[str, list[dict]]


class Reasoning(Loose):
    type: Literal["reasoning"]
    content: Optional[list[dict]] = None


class TextConfig(Loose):
    format: Optional[dict] = None
    verbosity: Optional[str] = None  # accepted; the model has no such control


class ReasoningConfig(Loose):
    effort: Optional[str] = None  # "none" / "minimal": thinking off, others on
    summary: Optional[str] = None  # accepted; no summaries are written


ITEMS = {"message": InputMessage, "function_call": FunctionCall,
         "function_call_output": FunctionCallOutput, "custom_tool_call": CustomToolCall,
         "custom_tool_call_output": FunctionCallOutput, "reasoning": Reasoning}
CUSTOM_INPUT = "input"  # a custom tool's one argument, as the model sees it


class ResponsesRequest(Extensions):
    model_config = ConfigDict(extra="allow")

    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    include: Optional[list[str]] = None
    top_k: Optional[int] = None  # extensions, as in chat completions
    seed: Optional[int] = None
    chat_template_kwargs: Optional[dict] = None
    # accepted; nothing to do on a local engine (store: nothing is stored)
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[dict] = None
    client_metadata: Optional[dict] = None  # Codex's session metadata
    # refused when given
    background: Optional[bool] = None
    top_logprobs: Optional[int] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[int] = None
    context_management: Optional[Any] = None


CHAT_FIELDS = set(Extensions.model_fields) | {"temperature", "top_p", "top_k", "seed",
                                              "chat_template_kwargs", "parallel_tool_calls"}


# requests --------------------------------------------------------------------------


def _refuse_unserved(body: ResponsesRequest) -> None:
    for name, why in REFUSED.items():
        if getattr(body, name) is not None:
            raise APIError(400, f"{name}: {why}", name)
    if body.background:
        raise APIError(400, "background: background responses are not served (nothing is "
                       "stored to poll): stream instead", "background")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs is not served (the engine returns no "
                       "log-probabilities)", "top_logprobs")
    unserved = sorted(set(body.include or ()) - {ENCRYPTED_REASONING})
    if unserved:
        raise APIError(400, f"include: {unserved} not served (reasoning comes back as plain "
                       "text in the reasoning item's content)", "include")


def _validated(model: type[BaseModel], raw, where: str, param: str):
    if not isinstance(raw, dict):
        raise APIError(400, f"{where} must be an object, got {type(raw).__name__}", param)
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(part) for part in problem["loc"])
        raise APIError(400, f"{where}.{field}: {problem['msg']}", param) from None


def _text(content, where: str) -> str:
    return content_text(content, where, "input", texts=("input_text", "output_text"),
                        skip=("refusal",))


def _item(raw, where: str):
    """The item, validated; None for an item a hosted tool left (`web_search_call`, ...)."""
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if kind == "item_reference":
        raise APIError(400, f"{where} is an 'item_reference' item: this server keeps no "
                       "items: send the item itself", "input")
    if isinstance(raw, dict) and kind not in ITEMS:
        warn_once(("item", kind), "left out %r input items: the server runs no hosted tools "
                  "and reads the items %s", kind, list(ITEMS))
        return None
    return _validated(ITEMS.get(kind, InputMessage), raw, where, "input")


@dataclass
class ToolNames:
    """What the model calls each tool, and what the client calls it back: model name
    -> (namespace or None, the tool's own name, "function" or "custom")."""

    origin: dict = field(default_factory=dict)

    def model_name(self, name: str, namespace: Optional[str] = None) -> str:
        for flat, (space, own, _) in self.origin.items():
            if own == name and space == namespace:
                return flat
        return name


def chat_messages(body: ResponsesRequest, names: ToolNames) -> list:
    """`instructions` and `input` -> chat completions messages. An assistant turn (its
    reasoning, text and calls) lasts until the next user, system or tool message."""
    messages = ([ChatMessage(role="system", content=body.instructions)]
                if body.instructions else [])
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    for index, raw in enumerate(items):
        where = f"input[{index}]"
        item = _item(raw, where)
        if item is None:
            continue
        turn = messages[-1] if messages and messages[-1].role == "assistant" else None
        if isinstance(item, FunctionCallOutput):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, f"{where}.output")))
        elif isinstance(item, InputMessage) and item.role != "assistant":
            messages.append(ChatMessage(role=item.role,
                                        content=_text(item.content, f"{where}.content")))
        elif isinstance(item, (FunctionCall, CustomToolCall)):
            if turn is None:
                turn = ChatMessage(role="assistant", content="")
                messages.append(turn)
            if isinstance(item, FunctionCall):
                name, arguments = names.model_name(item.name, item.namespace), item.arguments
            else:
                name = names.model_name(item.name)
                arguments = json.dumps({CUSTOM_INPUT: item.input}, ensure_ascii=False)
            turn.tool_calls = (turn.tool_calls or []) + [ToolCall(
                id=item.call_id, function=CalledFunction(name=name, arguments=arguments))]
        else:
            if turn is None or turn.content or turn.tool_calls:
                turn = ChatMessage(role="assistant", content="")
                messages.append(turn)
            if isinstance(item, Reasoning):
                turn.reasoning_content = (turn.reasoning_content or "") + "".join(
                    part.get("text") or "" for part in item.content or []
                    if part.get("type") == "reasoning_text")
            else:
                turn.content = _text(item.content, f"{where}.content")
    if not messages:
        raise APIError(400, "input is empty", "input")
    return messages


def _client_tools(tools: Optional[list]) -> list:
    """(namespace, raw tool dict, where) of every tool the client runs itself: function
    and custom tools, those inside namespaces included; hosted tools are left out."""
    out = []
    for index, raw in enumerate(tools or []):
        where = f"tools[{index}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in ("function", "custom"):
            out.append((None, raw, where))
        elif kind == "namespace":
            space = raw.get("name")
            if not isinstance(space, str) or not isinstance(raw.get("tools"), list):
                raise APIError(400, f"{where}: a namespace tool needs a name and a list of "
                               "tools", "tools")
            for inner, tool in enumerate(raw["tools"]):
                if isinstance(tool, dict) and tool.get("type") in ("function", "custom"):
                    out.append((space, tool, f"{where}.tools[{inner}]"))
        else:
            warn_once(("tool", kind), "left out the %r tool: hosted tools are not served "
                      "(this server runs no tools of its own)", kind)
    return out


def _tools(tools: Optional[list]) -> tuple:
    """(chat completions tools, ToolNames) for the request's tools."""
    found = _client_tools(tools)
    own_names = [raw.get("name") for _, raw, _ in found]
    out, names = [], ToolNames()
    for space, raw, where in found:
        if raw["type"] == "function":
            tool = _validated(FunctionTool, raw, where, "tools")
            parameters = tool.parameters
        else:
            tool = _validated(CustomTool, raw, where, "tools")
            parameters = {"type": "object", "properties": {CUSTOM_INPUT: {
                "type": "string", "description": "the tool's whole input, as free text"}},
                "required": [CUSTOM_INPUT]}
        flat = tool.name if space is None or own_names.count(tool.name) == 1 \
            else f"{space}__{tool.name}"
        names.origin[flat] = (space, tool.name, raw["type"])
        out.append(ChatTool(function=Function(name=flat, description=tool.description,
                                              parameters=parameters)))
    return out or None, names


def _tool_choice(choice, names: ToolNames):
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") not in ("function", "custom") or \
            not isinstance(choice.get("name"), str):
        raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': "
                       f"'function', 'name': ...}}, got {choice!r}", "tool_choice")
    name = names.model_name(choice["name"], choice.get("namespace"))
    return {"type": "function", "function": {"name": name}}


def chat_request(body: ResponsesRequest) -> tuple:
    """(the chat completions request this one runs as, its ToolNames)."""
    _refuse_unserved(body)
    format_ = response_format(body.text and body.text.format, "text.format")
    tools, names = _tools(body.tools)
    return ChatRequest(
        model=body.model, messages=chat_messages(body, names), tools=tools,
        tool_choice=_tool_choice(body.tool_choice, names), response_format=format_,
        max_completion_tokens=body.max_output_tokens,
        reasoning_effort=body.reasoning and body.reasoning.effort,
        **body.model_dump(include=CHAT_FIELDS)), names


# responses -------------------------------------------------------------------------


class Items:
    """Output items from the `served` output events, in the order the model wrote them.
    Each step returns the stream events (type, fields) it makes; `done` holds the
    finished items, the response's `output`."""

    def __init__(self, names: Optional[ToolNames] = None):
        self.done: list = []
        self.open: Optional[dict] = None  # the reasoning or message item being written
        self.text = ""
        self.names = names or ToolNames()

    def _ids(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": len(self.done)}

    def _part(self, text: str) -> dict:
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def feed(self, event) -> list:
        """Take a `served` output event."""
        if isinstance(event, ToolCallEvent):
            return self.close() + self._call(event)
        wanted = "reasoning" if isinstance(event, ReasoningEvent) else "message"
        events = []
        if self.open is None or self.open["type"] != wanted:
            events = self.close() + self._start(wanted)
        self.text += event.text
        delta = "reasoning_text" if wanted == "reasoning" else "output_text"
        fields = dict(self._ids(self.open), content_index=0, delta=event.text)
        if wanted == "message":
            fields["logprobs"] = []
        return events + [(f"response.{delta}.delta", fields)]

    def _start(self, kind: str) -> list:
        prefix, body = ("rs", {"summary": [], "content": []}) if kind == "reasoning" \
            else ("msg", {"role": "assistant", "content": []})
        self.open = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind,
                     "status": "in_progress", **body}
        self.text = ""
        ids = self._ids(self.open)
        return [("response.output_item.added", {"output_index": ids["output_index"],
                                                "item": self.open}),
                ("response.content_part.added", dict(ids, content_index=0,
                                                     part=self._part("")))]

    def close(self, status: str = "completed") -> list:
        """Finish the open item (`status` "incomplete": the reply was cut)."""
        if self.open is None:
            return []
        item, ids, part = self.open, self._ids(self.open), self._part(self.text)
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        text_done = dict(ids, content_index=0, text=self.text)
        if kind == "output_text":
            text_done["logprobs"] = []
        finished = dict(item, status=status, content=[part])
        events = [(f"response.{kind}.done", text_done),
                  ("response.content_part.done", dict(ids, content_index=0, part=part)),
                  ("response.output_item.done", {"output_index": ids["output_index"],
                                                 "item": finished})]
        self.done.append(finished)
        self.open = None
        return events

    def _call(self, call) -> list:
        space, name, kind = self.names.origin.get(call.name, (None, call.name, "function"))
        if kind == "custom":
            text = json.loads(call.args).get(CUSTOM_INPUT, "")
            item = {"id": f"ctc_{uuid.uuid4().hex}", "type": "custom_tool_call",
                    "status": "in_progress", "call_id": call.id, "name": name, "input": ""}
            finished = dict(item, status="completed", input=text)
            events = ("response.custom_tool_call_input", "input", text)
        else:
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                    "status": "in_progress", "call_id": call.id, "name": name,
                    "arguments": ""}
            if space is not None:
                item["namespace"] = space
            finished = dict(item, status="completed", arguments=call.args)
            events = ("response.function_call_arguments", "arguments", call.args)
        ids = self._ids(item)
        self.done.append(finished)
        prefix, key, value = events
        return [("response.output_item.added", {"output_index": ids["output_index"],
                                                "item": item}),
                (f"{prefix}.delta", dict(ids, delta=value)),
                (f"{prefix}.done", dict(ids, **{key: value})),
                ("response.output_item.done", {"output_index": ids["output_index"],
                                               "item": finished})]

    def end(self, final) -> list:
        return self.close("incomplete" if final.finish_reason == "length" else "completed")


def skeleton(state, body: ResponsesRequest, response_id: str) -> dict:
    """The response before any output: the request's settings echoed."""
    text = body.text.model_dump(exclude_none=True) if body.text else {}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "model": state.model_name, "output": [], "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
        "reasoning": body.reasoning and body.reasoning.model_dump(exclude_none=True),
        "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": {"type": "text"}, **text},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
        "user": body.user, "usage": None}


def usage(u, reasoning_tokens: int) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": 0},  # the engine counts none
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def finished(state, base: dict, items: Items, final) -> dict:
    """The whole response, once `items.end(final)` has run (it tokenizes the thinking
    text: call it in a thread)."""
    cut = final.finish_reason == "length"
    thought = "".join(item["content"][0]["text"] for item in items.done
                      if item["type"] == "reasoning")
    reasoning_tokens = len(state.engine.tokenizer.encode(thought, add_special_tokens=False)) \
        if thought else 0
    return dict(base, status="incomplete" if cut else "completed",
                completed_at=None if cut else int(time.time()),
                incomplete_details={"reason": "max_output_tokens"} if cut else None,
                output=items.done, usage=usage(final.usage, reasoning_tokens),
                **report(final), warnings=final.warnings)


class ResponseStream:
    """One response's SSE events, numbered in order; `error` ends it after a failure."""

    def __init__(self, state, body: ResponsesRequest, call: Call, base: dict, names: ToolNames):
        self.state, self.body, self.call, self.base = state, body, call, base
        self.items, self.number = Items(names), 0

    def sse(self, kind: str, fields: dict) -> bytes:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return sse_event(kind, data)

    def _all(self, events: list) -> bytes:
        return b"".join(self.sse(kind, fields) for kind, fields in events)

    async def events(self):
        state = self.state
        async for event in output_events(state.engine, state.gate, self.call, self.base["id"],
                                         state.config.keepalive, self.body.progress):
            if isinstance(event, Opened):
                yield self.sse("response.created", {"response": self.base}) + \
                    self.sse("response.in_progress", {"response": self.base})
            elif isinstance(event, KeepAlive):
                yield KEEP_ALIVE
            elif isinstance(event, Progress):
                yield self.sse("response.in_progress", {"response": self.base,
                                                        "progress": asdict(event)})
            elif isinstance(event, End):
                final = event.final
                events = self._all(self.items.end(final))
                response = await asyncio.to_thread(finished, state, self.base, self.items, final)
                done = "response.incomplete" if response["status"] == "incomplete" \
                    else "response.completed"
                yield events + self.sse(done, {"response": response})
            else:
                yield self._all(self.items.feed(event))

    def error(self, error: APIError) -> bytes:
        failed = dict(self.base, status="failed", output=self.items.done,
                      error={"code": "server_error", "message": error.message})
        return self.sse("error", {"code": error.code, "message": error.message,
                                  "param": error.param}) + \
            self.sse("response.failed", {"response": failed})


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    chat, names = chat_request(body)
    call = await chat_call(state, chat)
    base = skeleton(state, body, f"resp_{uuid.uuid4().hex}")
    if body.stream:
        stream = ResponseStream(state, body, call, base, names)
        return EventStream(stream.events(), stream.error, ResponsesRequest.model_fields)
    result = await whole_result(request, call, base["id"])
    items = Items(names)
    for event in served(call.reply(state.engine.tokenizer, result)):
        items.feed(event)
    items.end(result)
    return JSONResponse(await asyncio.to_thread(finished, state, base, items, result))
