"""What the chat APIs share: one engine call from a request's messages, tools and
formats, and the reading of its output (content, reasoning, tool calls).

Tool choice is enforced as `ChatSpecPrefill` does it, by the same functions
(`engine/tool_calls.py`): a forced choice ("required" or a tool's name) becomes the
engine's constrained `tool_call` format in the model's own call markup (Hermes JSON,
Qwen3-Coder XML, GLM 4.7); "auto" is constrained too in those formats (free text, and
any call the model starts is a valid one), parsed only in others; "none" shows the
tools and parses no calls. An explicit `response_format` wins over the tool format.
`prepare` renders the chat template once (`engine/chat.py`: the prompt's tokens and
whether it opens a think block) in a thread, since tokenizing a long prompt takes
milliseconds; the engine compiles the grammar when it takes the request, and refuses
one that does not compile with a ValueError naming response_format (a 400 here).
"""

import asyncio
import difflib
import logging
import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict

from specprefill_engine.engine.chat import Rendered, tool_request
from specprefill_engine.engine.tool_calls import OutputParser

from .errors import APIError


logger = logging.getLogger(__name__)
IGNORED_HEADER = "x-specprefill-ignored-fields"  # a response header: the fields left unread
WARNED_CAP = 1024  # distinct ignored field names logged, at most
_warned: set = set()


class Loose(BaseModel):
    """A request part that may carry fields this server does not read."""

    model_config = ConfigDict(extra="allow")


def warn_once(key: tuple, message: str, *args) -> None:
    """A log warning the first time `key` comes (a client sends the same every turn)."""
    if key in _warned or len(_warned) >= WARNED_CAP:
        return
    _warned.add(key)
    logger.warning(message, *args)


def note_ignored(request, body: BaseModel) -> None:
    """Accept and ignore the top-level fields of a request body this server does not
    know: each is named once in a log warning (with the known name nearest to it, for
    a misspelling), and the response's `IGNORED_HEADER` lists them (`app.py`)."""
    names = sorted(body.model_extra or ())
    api = request.url.path
    for name in names:
        close = difflib.get_close_matches(name, list(type(body).model_fields), n=1)
        warn_once(("field", api, name), "%s: ignored the field %r, which this server does "
                  "not know%s", api, name, f" (did you mean {close[0]!r}?)" if close else "")
    if names:
        request.state.ignored_fields = names


_MID_SYSTEM_MARK = "mid_system_probe_3b9d"
_mid_system: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_mid_system_lock = threading.Lock()


def renders_mid_system(tokenizer) -> bool:
    """Whether the chat template shows a system message that follows a user turn,
    where it stands (probed once per tokenizer: some templates refuse one, some drop it)."""
    with _mid_system_lock:
        known = _mid_system.get(tokenizer)
    if known is None:
        probe = [{"role": "user", "content": "hi"},
                 {"role": "system", "content": _MID_SYSTEM_MARK}]
        try:
            text = tokenizer.apply_chat_template(probe, add_generation_prompt=True,
                                                 tokenize=False)
            known = isinstance(text, str) and text.find(_MID_SYSTEM_MARK) > text.find("hi") >= 0
        except Exception:
            known = False
        with _mid_system_lock:
            _mid_system[tokenizer] = known
    return known


def place_system_messages(chat: list, in_place: bool) -> list:
    """Chat messages whose system messages after the first one stand where they were
    written (`in_place`), or else join the user message before them (the next one when
    none comes before): the text before them renders as it did, so the prefix cache
    of the earlier turns still holds. The leading system message stays first."""
    if in_place:
        return chat
    out: list = []
    waiting: list = []  # system text with no user message before it yet
    for index, message in enumerate(chat):
        if message["role"] != "system" or index == 0:
            if waiting and message["role"] == "user":
                message = dict(message, content="\n\n".join(waiting + [message["content"]]))
                waiting = []
            out.append(message)
        elif out and out[-1]["role"] == "user":
            out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n\n{message['content']}")
        else:
            waiting.append(message["content"])
    if waiting:
        out.append({"role": "user", "content": "\n\n".join(waiting)})
    return out


class Extensions(BaseModel):
    """Request fields every API takes beyond its own: engine sampling settings,
    SpecPrefill per request, and `progress` (prefill progress in place of keep-alives)."""

    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    keep: Optional[float] = None
    specprefill: Optional[bool] = None
    threshold: Optional[int] = None
    progress: bool = False


ENGINE_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty",
                 "ignore_eos", "keep", "specprefill", "threshold")


def given_options(body) -> dict:
    """The request's engine settings (`ENGINE_FIELDS`) that it sets."""
    return {name: getattr(body, name) for name in ENGINE_FIELDS if getattr(body, name) is not None}


def report(final) -> dict:
    """The engine's report and timings: the responses' extension fields."""
    return {"specprefill": asdict(final.specprefill), "timings": asdict(final.timings)}


@dataclass
class Call:
    """One engine request: the prompt, the engine's keyword arguments, how to read it."""

    prompt: Union[str, list, Rendered]
    options: dict
    tools: Optional[list] = None
    parse_tools: bool = False
    stops: tuple = ()
    raw: bool = False  # plain completions: the text as written, no markup read

    def parser(self, tokenizer) -> Optional[OutputParser]:
        if self.raw:
            return None
        in_reasoning = isinstance(self.prompt, Rendered) and self.prompt.think_open
        return OutputParser(tokenizer, parse_tools=self.parse_tools, tools=self.tools,
                            in_reasoning=in_reasoning)

    def read(self, parser: Optional[OutputParser], text: str,
             finish_reason: Optional[str]) -> list:
        """Events of a piece of output (a `finish_reason`: the end, flush what was held)."""
        if parser is None:
            return [("content", text)] if text else []
        events = parser.feed(text)
        if finish_reason is not None:
            events += parser.finish(finish_reason)
        # a call the output ended inside has no place in these APIs, nor in the text
        return [(kind, value) for kind, value in events
                if kind != "tool_call" or not value.cut]

    def reply(self, tokenizer, result) -> list:
        """Events of a whole reply (a Result)."""
        return self.read(self.parser(tokenizer), result.text, result.finish_reason)


@dataclass
class Output:
    """A whole reply, read: what the non-streaming responses are built from."""

    content: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)  # ToolCallEvent, valid ones


def read_events(events: list) -> Output:
    """Fold parser events into an Output. A call that did not parse (a malformed one)
    comes back as text: the APIs have no place for an invalid call (one the output
    ended inside is dropped by `Call.read`)."""
    output = Output()
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


def build_call(engine, chat: list, options: dict, *, tools: Optional[list] = None,
               choice="auto", parallel: bool = True, response_format: Optional[dict] = None,
               template_kwargs: Optional[dict] = None) -> Call:
    """An engine call for chat messages (OpenAI-style dicts), with tools already in
    OpenAI's function form and `choice` as `check_tool_choice` takes it."""
    tokenizer = engine.tokenizer
    options = dict(options)
    parse_tools = False
    if tools:
        choice, response_format = tool_request(tokenizer, tools, choice, parallel,
                                               response_format)  # its errors name the field
        parse_tools = choice != "none"
    elif choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice is {choice!r} but no tools are given", "tool_choice")
    if response_format is not None:
        options["response_format"] = response_format
    rendered = engine.render(chat, tools, template_kwargs)
    return Call(rendered, options, tools, parse_tools, tuple(options.get("stop") or ()))


async def prepare(engine, chat: list, options: dict, **how) -> Call:
    """`build_call` in a thread (it renders and tokenizes the prompt)."""
    return await asyncio.to_thread(build_call, engine, chat, options, **how)


def matched_stop(tokenizer, token_ids: list, stops: tuple) -> Optional[str]:
    """Which stop string ended a reply that finished with "stop" (None: EOS did). The
    engine drops the stop string from the text but keeps its tokens, and it stops at
    the first one, so a stop string in the decoded tokens is the one that hit."""
    if not stops:
        return None
    full = tokenizer.decode(token_ids)
    hits = [(full.find(stop), stop) for stop in stops if stop in full]
    return min(hits)[1] if hits else None
