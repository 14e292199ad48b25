"""What both chat APIs share: one engine call from a request's messages, tools and
formats, and the reading of its output (content, reasoning, tool calls).

Tool choice is enforced as `ChatSpecPrefill` does it: a forced choice ("required" or a
tool's name) becomes the engine's constrained `tool_call` format (Hermes `<tool_call>`
JSON, the only markup the grammar writes); "auto" is constrained too on such models
(free text, and any call the model starts is a valid one), parsed only on others;
"none" shows the tools and parses no calls. An explicit `response_format` wins over the
tool format. `prepare` builds the call on the event loop (rendering a chat template
to text costs tens of microseconds), or in a thread when a grammar must be checked.
"""

import asyncio
import json
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict

from specprefill_engine.engine.tool_calls import THINK_START, OutputParser

from .errors import APIError

HERMES_CALL_START = "<tool_call>"


class Loose(BaseModel):
    """A request part that may carry fields this server does not read."""

    model_config = ConfigDict(extra="allow")


class Extensions(BaseModel):
    """Request fields both APIs take beyond their own: engine sampling settings,
    SpecPrefill per request, and `progress` (prefill progress in place of keep-alives)."""

    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    keep: Optional[float] = None
    specprefill: Optional[bool] = None
    threshold: Optional[int] = None
    progress: bool = False


def report(final) -> dict:
    """The engine's report and timings: the responses' extension fields."""
    return {"specprefill": asdict(final.specprefill), "timings": asdict(final.timings)}


@dataclass
class Call:
    """One engine request: the prompt, the engine's keyword arguments, how to read it."""

    prompt: Union[str, list]
    options: dict
    tools: Optional[list] = None
    parse_tools: bool = False
    in_reasoning: bool = False
    stops: tuple = ()
    raw: bool = False  # plain completions: the text as written, no markup read

    def parser(self, tokenizer) -> Optional[OutputParser]:
        if self.raw:
            return None
        return OutputParser(tokenizer, parse_tools=self.parse_tools, tools=self.tools,
                            in_reasoning=self.in_reasoning)

    def read(self, parser: Optional[OutputParser], text: str, last: bool) -> list:
        """Events of a piece of output (`last`: the end, flush what was held)."""
        if parser is None:
            return [("content", text)] if text else []
        return parser.feed(text) + parser.finish() if last else parser.feed(text)


@dataclass
class Output:
    """A whole reply, read: what the non-streaming responses are built from."""

    content: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)  # ToolCallEvent, valid ones


def read_events(events: list, output: Optional[Output] = None) -> Output:
    """Fold parser events into an Output. A call that did not parse (a malformed or
    truncated one) comes back as text: the APIs have no place for an invalid call."""
    output = output or Output()
    for kind, value in events:
        if kind == "content":
            output.content += value
        elif kind == "reasoning":
            output.reasoning += value
        elif value.error is None:
            output.calls.append(value)
        else:
            output.content += value.args
    return output


def check_grammar(response_format: dict) -> dict:
    """Refuse a format whose grammar does not compile, here on the caller's side: a
    schema the engine's check lets through (e.g. `{"type": "foo"}`) fails when its
    request starts on the worker, and there it stops the whole engine."""
    import llguidance
    from specprefill_engine.engine.constrained import check_response_format, grammar_for

    normalized = check_response_format(response_format)
    error = llguidance.LLMatcher.validate_grammar(grammar_for(normalized))
    if error and not error.startswith("WARNING"):
        raise APIError(400, f"response_format: {error.strip()}", "response_format")
    return normalized


def tool_format(tokenizer, tools: list, choice: str, parallel: bool) -> Optional[dict]:
    """The constrained format for a tool choice ("auto", "required" or a tool name)."""
    if getattr(tokenizer, "tool_call_start", None) != HERMES_CALL_START:
        if choice == "auto":
            return None  # parsed, not constrained
        raise APIError(400, f"tool_choice {choice!r} needs constrained tool calls, which are "
                       f"written as {HERMES_CALL_START} JSON; this model writes calls as "
                       f"{getattr(tokenizer, 'tool_call_start', None)!r}", "tool_choice")
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"type": "tool_call", "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel}


def opens_think(tokenizer, chat: list, tools: Optional[list], template_kwargs: dict) -> bool:
    """Whether the rendered prompt ends inside an open think block (the model's first
    words are then reasoning)."""
    start = tokenizer.think_start if getattr(tokenizer, "has_thinking", False) else THINK_START
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or start not in template:
        return False
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                         **extra, **template_kwargs)
    return isinstance(text, str) and text.rstrip().endswith(start)


def build_call(tokenizer, chat: list, options: dict, *, tools: Optional[list] = None,
               choice: str = "auto", parallel: bool = True,
               response_format: Optional[dict] = None,
               template_kwargs: Optional[dict] = None) -> Call:
    """An engine call for chat messages (OpenAI-style dicts), with tools already in
    OpenAI's function form and `choice` one of "auto", "none", "required", a name."""
    options = dict(options)
    template_kwargs = dict(template_kwargs or {})
    if template_kwargs:
        options["chat_template_kwargs"] = template_kwargs
    parse_tools = False
    if tools:
        if not getattr(tokenizer, "has_tool_calling", False):
            raise APIError(400, "tools: this model has no tool-call format that its "
                           "tokenizer knows (mlx-lm finds no tool_call_start / tool_parser)",
                           "tools")
        names = [tool["function"]["name"] for tool in tools]
        if choice not in ("auto", "none", "required") and choice not in names:
            raise APIError(400, f"tool_choice names {choice!r}, which is not among the "
                           f"tools {names}", "tool_choice")
        options["tools"] = tools
        parse_tools = choice != "none"
        if parse_tools and response_format is None:
            response_format = tool_format(tokenizer, tools, choice, parallel)
    elif choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice is {choice!r} but no tools are given", "tool_choice")
    if response_format is not None:
        options["response_format"] = check_grammar(response_format)
    return Call(chat, options, tools, parse_tools,
                opens_think(tokenizer, chat, tools, template_kwargs),
                tuple(options.get("stop") or ()))


async def prepare(tokenizer, chat: list, options: dict, **how) -> Call:
    """`build_call`, off the event loop when it compiles a grammar."""
    grammar = how.get("response_format") is not None or (
        how.get("tools") and how.get("choice", "auto") != "none")
    if grammar:
        return await asyncio.to_thread(build_call, tokenizer, chat, options, **how)
    return build_call(tokenizer, chat, options, **how)


def arguments(text: str):
    """A call's arguments as chat templates take them: an object when the JSON text
    is one (templates render it with `tojson`), else the text as given."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text


def matched_stop(tokenizer, token_ids: list, stops: tuple) -> Optional[str]:
    """Which stop string ended a reply that finished with "stop" (None: EOS did). The
    engine drops the stop string from the text but keeps its tokens, and it stops at
    the first one, so a stop string in the decoded tokens is the one that hit."""
    if not stops:
        return None
    full = tokenizer.decode(token_ids)
    hits = [(full.find(stop), stop) for stop in stops if stop in full]
    return min(hits)[1] if hits else None
