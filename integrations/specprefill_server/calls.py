"""What the APIs share beyond the engine's call (`chat/call.py`): reading a request
(its unknown fields, system messages, text parts, engine settings) and reading the
output as these APIs serve it (`served`, `fold`).

`prepare` builds the engine's call in a thread (rendering a long prompt takes
milliseconds); the engine compiles the grammar when it takes the request, and refuses
one that does not compile with a ValueError naming response_format (a 400 here).
"""

import asyncio
import difflib
import logging
import re
import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specprefill_engine.chat.call import Call, build_call
from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent, ToolCallEvent

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


def part_text(part: dict, where: str, param: str, texts: tuple = ("text",),
              unit: str = "part") -> str:
    """The text of a content part of one of the types `texts`; any other is a 400 naming
    it: the model reads text only."""
    if part.get("type") not in texts:
        raise APIError(400, f"{where} is a {part.get('type')!r} {unit}; this server serves a "
                       f"text-only model: send {texts[0]} {unit}s", param)
    return part.get("text") or ""


def content_text(content, where: str, param: str, texts: tuple = ("text",), skip: tuple = (),
                 unit: str = "part", sep: str = "") -> str:
    """A message's content as text: a string, or its parts' texts (`part_text`) joined by
    `sep`; parts of the types `skip` carry none."""
    if content is None or isinstance(content, str):
        return content or ""
    return sep.join(part_text(part, f"{where}[{index}]", param, texts, unit)
                    for index, part in enumerate(content) if part.get("type") not in skip)


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


def served(events: list) -> list:
    """The events as these APIs serve them: a call the output ended inside is dropped
    (it has no place in them, nor in the text), one that did not parse comes back as
    the text the model wrote (the APIs have no place for an invalid call)."""
    out = []
    for event in events:
        if isinstance(event, ToolCallEvent) and event.error is not None:
            if not event.cut:
                out.append(TextEvent(event.args))
        else:
            out.append(event)
    return out


@dataclass
class Output:
    """A whole reply, read: what the non-streaming responses are built from."""

    content: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)  # ToolCallEvent, valid ones


def fold(events: list) -> Output:
    """`served` events folded into an Output."""
    output = Output()
    for event in events:
        if isinstance(event, TextEvent):
            output.content += event.text
        elif isinstance(event, ReasoningEvent):
            output.reasoning += event.text
        else:
            output.calls.append(event)
    return output


def without_metadata(chat: list, pattern: str) -> list:
    """Chat messages whose system and developer messages lack the lines that match
    `pattern` (`ServerConfig.metadata_lines`): the same request renders the same prompt
    whatever such a line says, so a line that changes per request does not cut the
    prefix cache short at the system prompt."""
    if not pattern:
        return chat
    matches = re.compile(pattern).search
    out = []
    for message in chat:
        content = message.get("content")
        if message["role"] in ("system", "developer") and isinstance(content, str):
            lines = content.split("\n")
            kept = [line for line in lines if not matches(line)]
            if len(kept) < len(lines):
                content = "\n".join(kept).strip("\n")
                if not content:
                    continue  # it held only metadata: gone, as if never sent
                message = dict(message, content=content)
        out.append(message)
    return out


async def prepare(state, chat: list, options: dict, *, tools: Optional[list] = None,
                  choice="auto", **how) -> Call:
    """`build_call` in a thread (it renders and tokenizes the prompt), on the chat
    without its metadata lines."""
    if not tools and choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice is {choice!r} but no tools are given", "tool_choice")
    chat = without_metadata(chat, state.config.metadata_lines)
    return await asyncio.to_thread(build_call, state.engine, chat, options, tools=tools,
                                   tool_choice=choice, **how)


def matched_stop(tokenizer, token_ids: list, stops: tuple) -> Optional[str]:
    """Which stop string ended a reply that finished with "stop" (None: EOS did). The
    engine drops the stop string from the text but keeps its tokens, and it stops at
    the first one, so a stop string in the decoded tokens is the one that hit."""
    if not stops:
        return None
    full = tokenizer.decode(token_ids)
    hits = [(full.find(stop), stop) for stop in stops if stop in full]
    return min(hits)[1] if hits else None
