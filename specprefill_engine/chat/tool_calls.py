"""Split a model's streamed text into content, reasoning and tool calls (shared by the
LangChain chat model and the HTTP server).

mlx-lm's tokenizer wrapper knows the model family's tool-call markers
(`tool_call_start` / `tool_call_end`) and a `tool_parser` for what lies between
them; think markers come from the wrapper too (`<think>` / `</think>` otherwise).
`OutputParser` is fed text as it streams and returns events (`chat/parser_events.py`) as soon as
they are certain: content and reasoning text (a possible partial marker at the end is
held back), and each tool call once its end marker arrives. Markup never reaches the
content; whitespace next to a removed block is dropped, other text is kept exactly.
Every entry point (invoke, stream, ...) runs the same parser, so they agree. A call
that does not parse, names no bound tool, or is cut before its end marker is an
invalid call whose `error` says why.

Models also write calls without the markers: a fenced block (```json, ```tool_call or
a bare ```) or bare JSON at the start of a line, holding one call, several, or a list
of them, each `{"name": ..., "arguments": {...}}` (or `"parameters"`, the arguments as
a JSON string, or OpenAI's `{"type": "function", "function": {...}}`). With tools
given, such a block is read as its calls when every one names a given tool with
arguments its parameters accept (`schema_problem`); otherwise, and always without
tools, it is content, unchanged. From its opening fence or `{"` until that is known
the block is held back; text that cannot open one is released as it comes. Nothing
is recovered inside a code block of another kind (```python), a think block, or from
the middle of a line.

The tool-call format is the name of the tokenizer's mlx-lm parser module
(`tool_format`), never guessed from the start marker: Hermes JSON, Qwen3-Coder XML
and GLM 4.7 all open with `<tool_call>`. `check_tool_choice` and `tool_choice_format`
turn a request's tool choice into the constrained format that enforces it, the same
for every integration.
"""

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .parser_events import ReasoningEvent, TextEvent, ToolCallEvent

THINK_START, THINK_END = "<think>", "</think>"
TOOL_FORMATS = ("json_tools", "qwen3_coder", "glm47")  # formats with a call grammar
FENCE_WORDS = ("", "json", "tool_call", "tool_calls")  # fenced blocks that may hold calls
_OPENER = re.compile(r"^[ \t]*(```|[{\[])", re.M)  # what may open a call without markers
_FENCE = re.compile(r"^[ \t]*(```)", re.M)
_PARTIAL_FENCE = re.compile(r"^[ \t]*(`{1,2})\Z", re.M)
_WORD = re.compile(r"[A-Za-z_]*")
_SPACE = re.compile(r"\s*")
_STRUCTURE = re.compile(r'["{}\[\]]')  # what counts in JSON outside strings
_IN_STRING = re.compile(r'["\\]')  # and inside them
_CALL_KEYS = {"name", "arguments", "parameters", "id", "type"}
_TEXT = {"content": TextEvent, "reasoning": ReasoningEvent}  # a channel's event type


class ToolsNotSupportedError(ValueError):
    """Tools cannot be shown to this model, or its tool-call format cannot be
    constrained or read back."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def think_markers(tokenizer) -> tuple:
    """(start, end) of a think block: the tokenizer's own, else `<think>` / `</think>`."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    return THINK_START, THINK_END


def tool_format(tokenizer) -> Optional[str]:
    """The tool-call format: the mlx-lm parser module the tokenizer was loaded with
    (`json_tools`, `qwen3_coder`, `glm47`, ...), None without one."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def check_tool_choice(choice, names: list) -> str:
    """A tool choice as the OpenAI API, Anthropic's (mapped) or LangChain gives it ->
    "auto", "none", "required" or the name of one of the tools `names`."""
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none" or choice is False:
        return "none"
    if choice in ("any", "required") or choice is True:
        return "required"
    name = choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be 'auto', 'any', 'required', 'none' or a tool "
                         f"name; got {choice!r}")
    if name not in names:
        raise ValueError(f"tool_choice {name!r} is not one of the bound tools {names}")
    return name


def tool_choice_format(tokenizer, tools: list, choice: str, parallel: bool) -> Optional[dict]:
    """The constrained response_format that enforces `choice` (from `check_tool_choice`),
    in the markup of the tokenizer's tool parser. None: "none", or "auto" in a format
    without a call grammar (the model's calls are then parsed, not constrained)."""
    if choice == "none":
        return None
    form = tool_format(tokenizer)
    if form not in TOOL_FORMATS:
        if choice == "auto":
            return None
        raise ToolsNotSupportedError(
            f"tool_choice {choice!r} needs constrained tool calls, which exist for the "
            f"formats {list(TOOL_FORMATS)}; this model's tool-call format (mlx-lm parser) "
            f"is {form!r}")
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"type": "tool_call", "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": bool(parallel), "format": form}


def schema_problem(arguments: dict, schema: Optional[dict]) -> Optional[str]:
    """Why a call's arguments break its tool's JSON schema; None when they match (or
    the schema itself is not one a validator reads, or jsonschema, in the extras that
    take tools, is not installed). Constrained calls match the grammar, which may leave
    out keywords llguidance does not implement (`chat/constrained.py`): this is where those
    are checked."""
    if not isinstance(schema, dict) or not schema:
        return None
    try:
        import jsonschema
    except ImportError:
        return None

    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
        error = jsonschema.exceptions.best_match(validator(schema).iter_errors(arguments))
    except Exception:  # not a valid schema, or a $ref that does not resolve: unchecked
        return None
    return None if error is None else f"{error.json_path}: {error.message}"


class _Channel:
    """Text of one kind; drops whitespace next to removed markup, keeps the rest."""

    def __init__(self, strip_start: bool = False):
        self.held = ""  # trailing whitespace, released when more text follows
        self.strip_next = strip_start

    def feed(self, text: str) -> str:
        if self.strip_next:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_next = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body

    def cut(self) -> None:
        """Markup follows: drop held whitespace; strip what comes after it."""
        self.held = ""
        self.strip_next = True

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclass
class OutputParser:
    tokenizer: object = None
    parse_tools: bool = False
    tools: Optional[list] = None
    in_reasoning: bool = False
    events: list = field(default_factory=list)

    def __post_init__(self):
        tok = self.tokenizer
        self.think_start, self.think_end = think_markers(tok)
        self.call_start = getattr(tok, "tool_call_start", None) if self.parse_tools else None
        self.call_end = (getattr(tok, "tool_call_end", None) or "") if self.call_start else ""
        self.parser = getattr(tok, "tool_parser", None)
        functions = [t.get("function") or t for t in self.tools or []]
        self._names = {f.get("name") for f in functions}
        self._schemas = {f.get("name"): f.get("parameters") for f in functions}
        self.pending = ""
        self.state = "reasoning" if self.in_reasoning else "content"
        self.channels = {"content": _Channel(), "reasoning": _Channel(strip_start=True)}
        self.n_calls = 0
        self.recover = self.parse_tools and any(isinstance(n, str) for n in self._names)
        self.line_start = True  # the content so far ends at the start of a line
        self.in_code = False  # inside a fenced block that holds no calls
        self.scanned = None  # how far _json_end read the held text: (start, at, depth, in string)

    def _emit(self, kind: str, text: str, out: list) -> None:
        if kind == "content" and text:
            _, newline, line = text.rpartition("\n")
            self.line_start = not line.strip(" \t") and (bool(newline) or self.line_start)
        text = self.channels[kind].feed(text)
        if text:
            out.append(_TEXT[kind](text))

    @staticmethod
    def _partial_suffix(text: str, markers) -> int:
        """Length of the longest end of `text` that begins one of the markers."""
        keep = 0
        for marker in markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    keep = max(keep, n)
                    break
        return keep

    def _parse(self, body: str) -> list:
        """[(name, arguments dict)] of one call's body; raises when it is not a call."""
        if self.parser is None:
            raise ValueError("the tokenizer has no tool-call parser")
        parsed = self.parser(body, self.tools)
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            arguments = item.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(item.get("name"), str) or not isinstance(arguments, dict):
                raise ValueError("a tool call needs a name and an arguments object")
            if self.tools and item["name"] not in self._names:
                raise ValueError(f"no bound tool is named {item['name']!r}")
            problem = schema_problem(arguments, self._schemas.get(item["name"]))
            if problem is not None:
                raise ValueError(f"the arguments do not match {item['name']!r}'s parameters: "
                                 f"{problem}")
            calls.append((item["name"], arguments))
        return calls

    def _call(self, body: str, out: list, cut: Optional[str] = None) -> None:
        """Events of one call; `cut` says why its end marker never came."""
        index = self.n_calls
        try:
            calls = self._parse(body)
        except Exception as error:  # malformed call: reported as an invalid tool call
            reason = f"{type(error).__name__}: {error}"
            if cut:
                reason = f"the call was cut before {self.call_end!r} ({cut}); {reason}"
            out.append(ToolCallEvent(index, new_call_id(), None, body.strip(), reason,
                                     cut=bool(cut)))
            self.n_calls = index + 1
            return
        self._calls(calls, out)

    def _calls(self, calls: list, out: list) -> None:
        for name, arguments in calls:
            out.append(ToolCallEvent(self.n_calls, new_call_id(), name,
                                     json.dumps(arguments, ensure_ascii=False)))
            self.n_calls += 1

    # calls written without markers (see the module doc)

    def _recovered(self, values: list) -> Optional[list]:
        """[(name, arguments dict)] when every one of the JSON values is a call of a
        given tool whose arguments match its parameters; None otherwise."""
        items = [item for value in values
                 for item in (value if isinstance(value, list) else [value])]
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            if isinstance(item.get("function"), dict) and set(item) <= {"type", "function", "id"}:
                item = item["function"]
            if set(item) - _CALL_KEYS or item.get("type", "function") != "function" \
                    or ("arguments" in item) == ("parameters" in item):
                return None
            name = item.get("name")
            arguments = item.get("arguments", item.get("parameters"))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(name, str) or name not in self._names \
                    or not isinstance(arguments, dict) \
                    or schema_problem(arguments, self._schemas.get(name)) is not None:
                return None
            calls.append((name, arguments))
        return calls or None

    def _json_end(self, text: str, start: int) -> Optional[int]:
        """Where the JSON object or array at `text[start]` ends (by its brackets, outside
        strings); None when the text ends first. Held text only grows, so a later look
        at the same start goes on from where this one stopped."""
        at, depth, in_string = start, 0, False
        if self.scanned is not None and self.scanned[0] == start:
            _, at, depth, in_string = self.scanned
        while True:
            match = (_IN_STRING if in_string else _STRUCTURE).search(text, at)
            if match is None:
                self.scanned = (start, len(text), depth, in_string)
                return None
            char, at = match.group(), match.end()
            if in_string and char == "\\":
                if at == len(text):  # the escaped character is still to come
                    self.scanned = (start, at - 1, depth, True)
                    return None
                at += 1
            elif char == '"':
                in_string = not in_string
            elif char in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return at

    def _opener(self) -> Optional[int]:
        """Where the first fence or JSON opener at the start of a line is in `pending`
        (in a code block only its closing fence counts)."""
        pattern = _FENCE if self.in_code else _OPENER
        for match in pattern.finditer(self.pending):
            if match.start() > 0 or self.line_start:
                return match.start(1)
        return None

    def _partial_fence(self) -> int:
        """Length of the end of `pending` that may grow into a fence."""
        match = _PARTIAL_FENCE.search(self.pending)
        if match is None or (match.start() == 0 and not self.line_start):
            return 0
        return len(self.pending) - match.start(1)

    def _candidate(self, text: str, final: bool) -> Optional[tuple]:
        """How the text from an opener reads: None while unknown, else (n, calls, code):
        the first n characters are the calls (a list) or, with calls None, text; `code`
        says the text leaves a code block open. `final`: no more text comes."""
        more = None if not final else (len(text), None, False)
        if text.startswith("```"):
            if self.in_code:
                return 3, None, False
            word = _WORD.match(text, 3).group()
            i = 3 + len(word)
            if i == len(text) and any(w.startswith(word.lower()) for w in FENCE_WORDS):
                return more
            if word.lower() not in FENCE_WORDS:
                return i, None, True
            i = _SPACE.match(text, i).end()
            if i == len(text):
                return more
            if text[i] not in "{[":
                return i, None, True
            values = []
            while True:
                end = self._json_end(text, i)
                if end is None:
                    return more
                try:
                    values.append(json.loads(text[i:end]))
                except ValueError:
                    return end, None, True
                i = _SPACE.match(text, end).end()
                if text.startswith("```", i):
                    i += 3
                    break
                if i < len(text) and text[i] in "{[":
                    continue
                if not "```".startswith(text[i:]):
                    return i, None, True
                if not final:
                    return None
                i = len(text)  # the output ended before the closing fence
                break
            return i, self._recovered(values), False
        i = 0
        for expected in ('[{"' if text[0] == "[" else '{"'):
            i = _SPACE.match(text, i).end()
            if i == len(text):
                return more
            if text[i] != expected:
                return 1, None, False
            i += 1
        end = self._json_end(text, 0)
        if end is None:
            return more
        try:
            value = json.loads(text[:end])
        except ValueError:
            return end, None, False
        return end, self._recovered([value]), False

    def _take_candidate(self, out: list, final: bool) -> bool:
        """Read the opener at the start of `pending`; False while it is unknown."""
        read = self._candidate(self.pending, final)
        if read is None:
            return False
        n, calls, code = read
        text, self.pending = self.pending[:n], self.pending[n:]
        self.scanned = None
        if calls is None:
            self._emit("content", text, out)
            self.in_code = code
            return True
        self.channels["content"].cut()
        self._calls(calls, out)
        self.channels["content"].cut()
        self.line_start = True
        return True

    def feed(self, text: str) -> list:
        out: list = []
        self.pending += text
        self._scan(out, final=False)
        return out

    def _scan(self, out: list, final: bool) -> None:
        """Events of `pending`; what may still change meaning stays in it."""
        while self.pending:
            if self.state == "call":
                end = self.pending.find(self.call_end) if self.call_end else -1
                if end < 0:
                    break
                body = self.pending[:end]
                self.pending = self.pending[end + len(self.call_end):]
                self._call(body, out)
                self.state = "content"
                self.channels["content"].cut()
                self.line_start = True
                continue
            if self.state == "reasoning":
                markers = [self.think_end]
            else:
                markers = [self.think_start] + ([self.call_start] if self.call_start else [])
            hits = [(self.pending.find(m), m) for m in markers if m in self.pending]
            recover = self.recover and self.state == "content"
            opener = self._opener() if recover else None
            if opener is not None and (not hits or opener < min(hits)[0]):
                self._emit("content", self.pending[:opener], out)
                self.pending = self.pending[opener:]
                if not self._take_candidate(out, final):
                    break
                continue
            if hits:
                position, marker = min(hits)
                self._emit(self.state, self.pending[:position], out)
                self.channels[self.state].cut()
                self.pending = self.pending[position + len(marker):]
                if marker == self.think_end:
                    self.state = "content"
                    self.channels["content"].cut()
                    self.line_start = True
                elif marker == self.think_start:
                    self.state = "reasoning"
                else:
                    self.state = "call"
                continue
            keep = self._partial_suffix(self.pending, markers)
            if recover:
                keep = max(keep, self._partial_fence())
            safe, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            self._emit(self.state, safe, out)
            break

    def finish(self, finish_reason: Optional[str] = None) -> list:
        """End of output: what was held back. An unterminated call is parsed as is;
        when it does not parse, its error names `finish_reason` ("length": max_tokens)."""
        out: list = []
        if self.state == "content":
            self._scan(out, final=True)  # a held opener: calls or text, now
        rest, self.pending = self.pending, ""
        if self.state == "call":
            cut = ("max_tokens reached, finish_reason 'length'" if finish_reason == "length"
                   else f"finish_reason {finish_reason!r}" if finish_reason else "end of output")
            self._call(rest, out, cut)
        elif rest:
            self._emit(self.state, rest, out)
        for kind in ("reasoning", "content"):
            if self.state == kind:
                tail = self.channels[kind].flush()
                if tail:
                    out.append(_TEXT[kind](tail))
        return out

