"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Content blocks map to chat-template messages: `text` to the turn's text (blocks joined
by newlines), `tool_result` to a tool message, `tool_use` to the assistant's tool
calls, `thinking` to its `reasoning_content`. A `system` message among `messages` (as
Claude Code sends) stands where it was written when the template renders one there,
else joins the user message before it (`chat.place_system_messages`); the system
prompt's `x-anthropic-billing-header` line (Claude Code's, which changes between
requests) is left out as every metadata line is (`calls.without_metadata`). Unknown fields
are ignored (`chat.ignored_fields`); `max_tokens` past the context is clamped to what
fits, with a warning (`warnings`). Tool ids have Anthropic's `toolu_` shape. Output comes back as `thinking`, `text`
and `tool_use` blocks in the order the model wrote them. `thinking` `enabled` /
`adaptive` sets the template's `enable_thinking` (the budget is not enforced),
`disabled` clears it; `output_config.format` (a JSON schema) is enforced by
constrained decoding. Usage: `input_tokens` counts the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` those that were; a stream's `message_start`
carries zeros (the engine reports usage at the end) and `message_delta` the totals.
Extensions as in `openai_api.py` (`keep`, `specprefill`, `progress`, ...).
"""

import asyncio
import json
import uuid
from dataclasses import asdict
from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent, ToolCallEvent
from specprefill_engine.engine.results import Progress

from .calls import (
    Call, Extensions, Loose, content_text, given_options, matched_stop, note_ignored, part_text,
    place_system_messages, prepare, renders_mid_system, report, served, warn_once,
)
from .errors import APIError, anthropic_body
from .streaming import End, EventStream, KeepAlive, Opened, output_events, sse_event, whole_result

router = APIRouter()
CLIENT_TOOL_TYPES = (None, "custom")
UNREAD_BLOCKS = ("redacted_thinking",)  # carry nothing a local model can read
SERVER_TOOL_BLOCKS = ("server_tool_use", "mcp_tool_use")  # and every "*_tool_result" but ours


class AnthropicTool(Loose):
    name: str
    description: Optional[str] = None
    input_schema: Optional[dict] = None
    type: Optional[str] = None


class AnthropicMessage(Loose):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict]]


class Prompt(BaseModel):
    """What a message and its token count share."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    output_config: Optional[dict] = None
    output_format: Optional[dict] = None  # the structured-outputs beta's name for the format
    chat_template_kwargs: Optional[dict] = None  # extension
    # accepted; nothing to do on a local engine
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict] = None
    container: Optional[Any] = None
    context_management: Optional[dict] = None
    speed: Optional[str] = None
    inference_geo: Optional[str] = None
    diagnostics: Optional[dict] = None
    mcp_servers: Optional[list] = None  # refused when not empty


class MessagesRequest(Prompt, Extensions):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None  # an extension here


# requests --------------------------------------------------------------------------


def _server_tool_trace(kind) -> bool:
    """A block a server tool left in the history (its call or result): not for us."""
    return kind in SERVER_TOOL_BLOCKS or (isinstance(kind, str) and kind != "tool_result"
                                           and kind.endswith("_tool_result"))


def _block_text(block: dict, where: str) -> str:
    return part_text(block, where, "messages", unit="block")


def _texts(blocks, where: str) -> str:
    return content_text(blocks, where, "messages", unit="block", sep="\n")


def _user(blocks: list, where: str, chat: list) -> None:
    texts = []
    for index, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}[{index}]"
        if kind == "tool_result":
            if texts:  # keep the order the client wrote
                chat.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            content = _texts(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                content = f"Error: {content}"
            chat.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                         "content": content})
        elif kind not in UNREAD_BLOCKS and not _server_tool_trace(kind):
            texts.append(_block_text(block, at))
    if texts:
        chat.append({"role": "user", "content": "\n".join(texts)})


def _assistant(blocks: list, where: str, chat: list) -> None:
    entry, texts, calls, reasoning = {"role": "assistant"}, [], [], []
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif kind not in UNREAD_BLOCKS and not _server_tool_trace(kind):
            texts.append(_block_text(block, f"{where}[{index}]"))
    entry["content"] = "\n".join(texts)
    if calls:
        entry["tool_calls"] = calls
    if reasoning:
        entry["reasoning_content"] = "\n".join(reasoning)
    chat.append(entry)


def chat_messages(body: Prompt, tokenizer) -> list:
    """Anthropic's system and messages -> the dicts chat templates take."""
    chat = []
    system = _texts(body.system, "system")
    if system:
        chat.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            _user(message.content, f"messages[{index}].content", chat)
        elif message.role == "system":
            chat.append({"role": "system",
                         "content": _texts(message.content, f"messages[{index}].content")})
        else:
            _assistant(message.content, f"messages[{index}].content", chat)
    last = next((m.role for m in reversed(body.messages) if m.role != "system"), None)
    if last != "user":
        raise APIError(400, "the last message that is not a system message must be a user "
                       "message: continuing an assistant turn (prefill) is not served",
                       "messages")
    return place_system_messages(chat, renders_mid_system(tokenizer))


def _tools(body: Prompt) -> Optional[list]:
    """Client tools in OpenAI's function form. Anthropic's server tools (web search, code
    execution, ...) run on Anthropic's side; here they are left out, with a warning, so
    a client that always declares one (a coding agent) still works."""
    tools = []
    for tool in body.tools or []:
        if tool.type not in CLIENT_TOOL_TYPES:
            warn_once(("tool", tool.type, tool.name), "left out the %r tool %r: server tools "
                      "are not served", tool.type, tool.name)
            continue
        tools.append({"type": "function", "function": {
            "name": tool.name, "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object"}}})
    return tools or None


def _tool_choice(choice: Optional[dict]) -> tuple:
    """(choice for build_call, parallel calls allowed)."""
    if choice is None:
        return "auto", True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice of type 'tool' needs a name", "tool_choice")
        return choice["name"], parallel
    if kind not in ("auto", "any", "none"):
        raise APIError(400, f"tool_choice type must be 'auto', 'any', 'tool' or 'none', got "
                       f"{kind!r}", "tool_choice")
    return {"any": "required"}.get(kind, kind), parallel


def _template_kwargs(body: Prompt) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None and "enable_thinking" not in kwargs:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise APIError(400, f"thinking type must be 'enabled', 'disabled' or 'adaptive', "
                           f"got {kind!r}", "thinking")
        kwargs["enable_thinking"] = kind != "disabled"
    return kwargs


def _response_format(body: Prompt) -> Optional[dict]:
    format_ = (body.output_config or {}).get("format") or body.output_format
    if format_ is None:
        return None
    if format_.get("type") != "json_schema" or not isinstance(format_.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': "
                       "{...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": format_["schema"]}}


def _check(body: Prompt) -> None:
    if body.mcp_servers:
        raise APIError(400, "mcp_servers are not served: connect MCP tools in the client",
                       "mcp_servers")


async def messages_call(state, body: MessagesRequest) -> Call:
    _check(body)
    options = given_options(body)
    options.update(max_tokens=body.max_tokens, clamp_max_tokens=True)
    if body.stop_sequences:
        options["stop"] = list(body.stop_sequences)
    choice, parallel = _tool_choice(body.tool_choice)
    return await prepare(
        state, chat_messages(body, state.engine.tokenizer), options, tools=_tools(body),
        choice=choice, parallel=parallel, response_format=_response_format(body),
        template_kwargs=_template_kwargs(body))


# responses -------------------------------------------------------------------------


def usage(u) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens}


def stop(state, call: Call, final, called: bool) -> dict:
    if final.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    sequence = matched_stop(state.engine.tokenizer, final.token_ids, call.stops)
    return {"stop_reason": "stop_sequence" if sequence else "end_turn", "stop_sequence": sequence}


def tool_use_id(call_id: str) -> str:
    """Anthropic's id shape for a call the parser named `call_...`."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(call) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": json.loads(call.args)}


def blocks(events: list) -> list:
    """Content blocks in the order written: runs of text or thinking, then each call."""
    out = []
    for event in events:
        if isinstance(event, ToolCallEvent):
            out.append(tool_use(event))
            continue
        block_type = "thinking" if isinstance(event, ReasoningEvent) else "text"
        if out and out[-1]["type"] == block_type:
            out[-1][block_type] += event.text
        else:
            out.append({"type": block_type, block_type: event.text} | (
                {"signature": ""} if block_type == "thinking" else {}))
    return out


def stream_error(error: APIError) -> bytes:
    return sse_event("error", anthropic_body(error))


PING = sse_event("ping", {"type": "ping"})


async def message_stream(state, body: MessagesRequest, call: Call, message_id: str):
    start = sse_event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}})
    index, open_type, called = -1, None, False

    def close() -> bytes:
        nonlocal open_type
        open_type = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})

    async for event in output_events(state.engine, state.gate, call, message_id,
                                     state.config.keepalive, body.progress):
        if isinstance(event, Opened):
            yield start
        elif isinstance(event, KeepAlive):
            yield PING
        elif isinstance(event, Progress):
            yield sse_event("ping", {"type": "ping", "progress": asdict(event)})
        elif isinstance(event, ToolCallEvent):
            called = True
            if open_type is not None:
                yield close()
            index += 1
            yield sse_event("content_block_start", {
                "type": "content_block_start", "index": index,
                "content_block": dict(tool_use(event), input={})})
            yield sse_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": event.args}})
            yield close()
        elif isinstance(event, (TextEvent, ReasoningEvent)):
            text = event.text
            block_type = "thinking" if isinstance(event, ReasoningEvent) else "text"
            if open_type != block_type:
                if open_type is not None:
                    yield close()
                index, open_type = index + 1, block_type
                block = {"type": "thinking", "thinking": "", "signature": ""} \
                    if block_type == "thinking" else {"type": "text", "text": ""}
                yield sse_event("content_block_start", {"type": "content_block_start",
                                                        "index": index, "content_block": block})
            delta = {"type": "thinking_delta", "thinking": text} if block_type == "thinking" \
                else {"type": "text_delta", "text": text}
            yield sse_event("content_block_delta", {"type": "content_block_delta",
                                                    "index": index, "delta": delta})
        elif isinstance(event, End):
            final = event.final
            if open_type is not None:
                yield close()
            yield sse_event("message_delta", {
                "type": "message_delta", "delta": stop(state, call, final, called),
                "usage": usage(final.usage), **report(final), "warnings": final.warnings})
            yield sse_event("message_stop", {"type": "message_stop"})


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = request.app.state.server
    note_ignored(request, body)
    call = await messages_call(state, body)
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return EventStream(message_stream(state, body, call, message_id), stream_error,
                           MessagesRequest.model_fields)
    result = await whole_result(request, call, message_id)
    content = blocks(served(call.reply(state.engine.tokenizer, result)))
    called = any(block["type"] == "tool_use" for block in content)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
        "content": content, **stop(state, call, result, called),
        "usage": usage(result.usage), **report(result), "warnings": result.warnings})


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: Prompt, request: Request):
    """The prompt's tokens as a request renders it (template, tools, thinking)."""
    note_ignored(request, body)
    _check(body)
    engine = request.app.state.server.engine
    chat = chat_messages(body, engine.tokenizer)
    rendered = await asyncio.to_thread(engine.render, chat, _tools(body),
                                       _template_kwargs(body))
    return {"input_tokens": int(rendered.tokens.size)}
