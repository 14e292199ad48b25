"""Render a chat through its template once, and derive everything else from that render.

A request needs the prompt's token ids, the tokens SpecPrefill must keep (system
prompt, tool definitions, the newest message: `chat/segments.py`), the token where each
message starts (prefix-cache checkpoints) and whether the prompt leaves the model
inside a think block (the output parser's first state, the grammar's reasoning part).
Tokenizing a 32K-token prompt costs tens of milliseconds; rendering the template as
text costs far less. So the text is rendered once with the generation prompt and
tokenized once (by the fast tokenizer's batch call, which releases the GIL), message
boundaries come from rendering prefixes of the conversation as text, and characters
map to tokens through the tokenizer's offsets. A template that does not render
messages[:i] as a prefix of the whole prompt leaves message i's start unknown (None);
a tokenizer without offsets (a slow one) leaves every start unknown.

A prefix render costs about what the whole render costs (a template's cost is per
message), so starts for every message cost n renders of up to n messages, quadratic
in a long agent chat (measured by a one-off benchmark, now in git's history).
By default only the starts that are used are rendered: the end of a leading system
message, the newest user or tool message (protected segments), the newest user
message's extent (the draft's query), the generation prompt, and the last `window`
messages; the others are None.

Tool-call arguments in history reach the template as it expects them: a template
that prints `arguments` raw takes JSON strings, every other (those that iterate over
them or apply `tojson`) takes objects; a probe render decides once per tokenizer.
`tools_problem` says, also once per tokenizer, whether its template shows tools to the
model at all and mlx-lm can read its calls back.
"""

import copy
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .segments import protect, special_ids
from .tool_calls import (
    ToolsNotSupportedError, check_tool_choice, think_markers, tool_choice_format, tool_format,
)

logger = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_RECENT_CAP = 512  # tokens of the newest message kept (the engine's recent_message_cap)
DEFAULT_SYSTEM_CAP = 512  # a longer system message keeps its ends (system_message_cap)
STARTS_WINDOW = 4  # trailing messages whose starts are rendered by default

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> facts
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class Rendered:
    """One chat, rendered: a prompt the Engine takes as it is (`engine.generate(rendered)`).

    `message_starts[i]`: the token where message i starts (None where the template is
    not prefix-stable there, or outside the rendered window); `generation_start`:
    where the generation prompt starts; `protected`: tokens SpecPrefill must keep; `think`: "open" (the prompt ends inside
    a think block), "optional" (the model may open one: its tokenizer has think
    tokens, thinking is not switched off and the generation prompt holds none) or None;
    `question`: positions of the newest user message's text where messages follow it
    (the draft's query: a tool call and its result follow the question), else None.
    """

    text: str
    tokens: np.ndarray
    message_starts: list
    generation_start: Optional[int]
    protected: Optional[np.ndarray]
    think: Optional[str]
    question: Optional[np.ndarray] = None

    @property
    def think_open(self) -> bool:
        return self.think == "open"


def check_text(text: str, name: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid text ({error.reason} at {error.start})") from None
    return text


def check_messages(messages: list) -> list:
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content", None)
        if role not in ROLES:
            raise ValueError(f"messages[{index}]['role'] must be one of {ROLES}, got {role!r}")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{index}]['content'] is missing or None")
        if isinstance(content, str):
            check_text(content, f"messages[{index}]['content']")
        elif content is not None and not isinstance(content, list):
            raise TypeError(f"messages[{index}]['content'] must be a string or a list of parts, "
                            f"got {type(content).__name__}")
    return messages


# per-tokenizer facts ------------------------------------------------------------------


def _facts(tokenizer) -> dict:
    with _cache_lock:
        facts = _cache.get(tokenizer)
        if facts is None:
            facts = _cache[tokenizer] = {}
        return facts


def _backend(tokenizer):
    """The fast tokenizer's backend without truncation or padding, None for a slow one."""
    facts = _facts(tokenizer)
    if "backend" not in facts:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None and (backend.truncation or backend.padding):
            backend = copy.copy(backend)
            backend.no_truncation()
            backend.no_padding()
        facts["backend"] = backend
    return facts["backend"]


_PROBE_KEY = "probe_key_5c1e"


def _probe(arguments) -> list:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_probe", "type": "function",
                "function": {"name": "probe_tool", "arguments": arguments}}]}]


def wants_object_arguments(tokenizer) -> bool:
    """Does the template take tool-call arguments as objects (else JSON strings)?"""
    facts = _facts(tokenizer)
    if "objects" not in facts:
        try:
            text = tokenizer.apply_chat_template(_probe({_PROBE_KEY: "v"}), tokenize=False)
            # a template that prints arguments raw shows the dict's Python repr
            facts["objects"] = f"{{'{_PROBE_KEY}'" not in text
        except Exception:
            try:
                tokenizer.apply_chat_template(_probe(json.dumps({_PROBE_KEY: "v"})),
                                              tokenize=False)
                facts["objects"] = False
            except Exception:  # neither renders: HF's convention, objects
                facts["objects"] = True
    return facts["objects"]


def _with_arguments(messages: list, objects: bool) -> list:
    """Messages whose tool-call arguments are objects or JSON strings, as asked."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        converted = []
        for call in calls:
            function = call.get("function", call)
            arguments = function.get("arguments")
            if objects and isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                arguments = parsed if isinstance(parsed, dict) else arguments
            elif not objects and arguments is not None and not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            function = {**function, "arguments": arguments}
            converted.append({**call, "function": function} if "function" in call else function)
        out.append({**message, "tool_calls": converted})
    return out


_TOOL_PROBE = {"type": "function", "function": {
    "name": "probe_tool_7f3a", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def tools_problem(tokenizer) -> Optional[str]:
    """Why tools cannot work with this tokenizer (None: they can): its template must
    show them to the model, and mlx-lm must know how to read its calls back."""
    facts = _facts(tokenizer)
    if "tools_problem" not in facts:
        probe = [{"role": "user", "content": "hi"}]
        problem = None
        try:
            plain = _text(tokenizer, probe, {}, True)
            with_tools = _text(tokenizer, probe, {"tools": [_TOOL_PROBE]}, True)
        except Exception as error:
            problem = f"the chat template failed to render tools: {error}"
        else:
            if plain == with_tools or _TOOL_PROBE["function"]["name"] not in with_tools:
                problem = ("its chat template does not render tools, so the model would never "
                           "see them; use a model whose template supports tools")
            elif tool_format(tokenizer) is None:
                problem = ("mlx-lm knows no tool-call format for this tokenizer (no tool "
                           "parser), so calls could not be read back")
        facts["tools_problem"] = problem
    return facts["tools_problem"]


# rendering ------------------------------------------------------------------------------


def tool_request(tokenizer, tools: list, choice, parallel: bool,
                 response_format: Optional[dict] = None) -> tuple[str, Optional[dict]]:
    """A request with `tools` (OpenAI's function form): its choice (`check_tool_choice`'s)
    and the response_format that enforces it (the caller's own, when it gives one).
    Raises ValueError for a bad choice and ToolsNotSupportedError when this template
    cannot take tools or this call format cannot be constrained."""
    choice = check_tool_choice(choice, [tool["function"]["name"] for tool in tools])
    problem = tools_problem(tokenizer)
    if problem is not None:
        raise ToolsNotSupportedError(f"tools: this model cannot take tools: {problem}")
    if response_format is None:
        response_format = tool_choice_format(tokenizer, tools, choice, parallel)
    return choice, response_format


def _text(tokenizer, messages: list, extra: dict, generation: bool):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                         tokenize=False, **extra)


def _prefix_end(tokenizer, messages: list, extra: dict, text: str) -> Optional[int]:
    """Where the render of `messages` (no generation prompt) ends in `text`, if it is
    a prefix of it."""
    try:
        prefix = _text(tokenizer, messages, extra, False)
    except Exception as error:  # a template that refuses this prefix
        logger.debug("chat prefix of %d messages does not render: %r", len(messages), error)
        return None
    return len(prefix) if isinstance(prefix, str) and text.startswith(prefix) else None


class _Offsets:
    """Characters of the rendered text -> tokens, through the encoding's offsets."""

    def __init__(self, encoding, n_chars: int, n_tokens: int):
        self.encoding, self.n_chars, self.n_tokens = encoding, n_chars, n_tokens

    def token(self, char: Optional[int]) -> Optional[int]:
        """The token holding `char` (the first after it when none does)."""
        if char is None or self.encoding is None:
            return None
        while char < self.n_chars:
            token = self.encoding.char_to_token(char)
            if token is not None:
                return token
            char += 1
        return self.n_tokens


def _think(tokenizer, text: str, generation: Optional[int], kwargs: dict) -> Optional[str]:
    opener, closer = think_markers(tokenizer)
    if generation is None:  # the generation prompt's extent is unknown: its end decides
        return "open" if text.rstrip().endswith(opener) else None
    prompt = text[generation:]
    if prompt.rfind(opener) > prompt.rfind(closer):
        return "open"
    switched_off = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is False
    if opener in prompt or closer in prompt or switched_off:
        return None
    return "optional" if getattr(tokenizer, "has_thinking", False) else None


def render_chat(tokenizer, messages: list, tools: Optional[list] = None,
                chat_template_kwargs: Optional[dict] = None,
                recent_cap: int = DEFAULT_RECENT_CAP,
                window: Optional[int] = STARTS_WINDOW,
                system_cap: int = DEFAULT_SYSTEM_CAP) -> Rendered:
    """Render `messages` (with `tools` and `chat_template_kwargs`) and the generation
    prompt once; see the module doc. `window`: how many trailing messages get their
    start (None: all); `recent_cap`, `system_cap`: `segments.protect`'s. Raises
    ValueError / TypeError for bad messages."""
    messages = check_messages(list(messages))
    if not messages:
        raise ValueError("messages is empty")
    kwargs = dict(chat_template_kwargs or {})
    messages = _with_arguments(messages, wants_object_arguments(tokenizer))
    extra = {**kwargs, **({"tools": tools} if tools else {})}
    text = _text(tokenizer, messages, extra, True)
    backend = _backend(tokenizer) if isinstance(text, str) else None
    if backend is None:  # a slow tokenizer or a renderer that tokenizes: no offsets
        ids = np.asarray(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       **extra), dtype=np.int32)
        encoding = None
        text = text if isinstance(text, str) else ""
    else:
        encoding = backend.encode_batch([text], add_special_tokens=False)[0]
        ids = np.asarray(encoding.ids, dtype=np.int32)
    n = len(messages)
    roles = [m["role"] for m in messages]
    last = max((i for i, role in enumerate(roles) if role in ("user", "tool")), default=0)
    asked = max((i for i, role in enumerate(roles) if role == "user"), default=0)
    wanted = set(range(1, n + 1)) if window is None else \
        {1, last, asked, asked + 1, n, *range(max(1, n - window), n)}
    chars = [0] + [_prefix_end(tokenizer, messages[:i], extra, text) if i in wanted else None
                   for i in range(1, n + 1)]
    offsets = _Offsets(encoding, len(text), ids.size)
    bounds = [offsets.token(c) for c in chars]
    tool_span = None
    if tools and chars[1] is not None and encoding is not None:
        tool_span = _tool_span(tokenizer, messages, kwargs, text[: chars[1]], offsets)
    protected = protect(ids, special_ids(tokenizer), roles, bounds, tool_span, recent_cap,
                        system_cap)
    asked_span = (chars[asked], chars[asked + 1]) if roles[asked] == "user" and asked < n - 1 \
        else None
    return Rendered(text, ids, bounds[:-1], bounds[-1], protected,
                    _think(tokenizer, text, chars[-1], kwargs),
                    _question(messages[asked], text, asked_span, offsets))


def _question(message: dict, text: str, span: Optional[tuple],
              offsets: _Offsets) -> Optional[np.ndarray]:
    """The tokens of `message`'s text (its last text part) where it is rendered in
    `text[span[0]:span[1]]`; None where `span` is unknown or the text is not there as it is."""
    if span is None or None in span:
        return None
    content = message.get("content")
    if isinstance(content, list):
        content = next((part.get("text") for part in reversed(content)
                        if isinstance(part, dict) and part.get("type") == "text"), None)
    content = content.strip() if isinstance(content, str) else ""
    at = text.find(content, *span) if content else -1
    if at < 0:
        return None
    start, end = offsets.token(at), offsets.token(at + len(content) - 1)
    return None if start is None or end is None else np.arange(start, end + 1)


def _tool_span(tokenizer, messages: list, kwargs: dict, with_tools: str,
               offsets: _Offsets) -> Optional[tuple]:
    """Tokens of the tool definitions: where the first message rendered with tools
    departs from it rendered without."""
    try:
        without = _text(tokenizer, messages[:1], kwargs, False)
    except Exception:
        return None
    extra = len(with_tools) - len(without)
    if not isinstance(without, str) or extra <= 0:
        return None
    start = next((i for i, (a, b) in enumerate(zip(with_tools, without)) if a != b),
                 len(without))
    return offsets.token(start), offsets.token(start + extra - 1) + 1
