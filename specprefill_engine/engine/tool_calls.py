"""Split a model's streamed text into content, reasoning and tool calls (shared by the
LangChain chat model and the HTTP server).

mlx-lm's tokenizer wrapper knows the model family's tool-call markers
(`tool_call_start` / `tool_call_end`) and a `tool_parser` for what lies between
them; think markers come from the wrapper too (`<think>` / `</think>` otherwise).
`OutputParser` is fed text as it streams and returns events as soon as they are
certain: content and reasoning text (a possible partial marker at the end is held
back), and each tool call once its end marker arrives. Markup never reaches the
content; whitespace next to a removed block is dropped, other text is kept exactly.
Every entry point (invoke, stream, ...) runs the same parser, so they agree. A call
that does not parse, names no bound tool, or is cut before its end marker is an
invalid call whose `error` says why.

The tool-call format is the name of the tokenizer's mlx-lm parser module
(`tool_format`), never guessed from the start marker: Hermes JSON, Qwen3-Coder XML
and GLM 4.7 all open with `<tool_call>`. `check_tool_choice` and `tool_choice_format`
turn a request's tool choice into the constrained format that enforces it, the same
for every integration.
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"
TOOL_FORMATS = ("json_tools", "qwen3_coder", "glm47")  # formats with a call grammar


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
    the schema itself is not one a validator reads). Constrained calls match the
    grammar, which may leave out keywords llguidance does not implement
    (`constrained.py`): this is where those are checked."""
    if not isinstance(schema, dict) or not schema:
        return None
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
        error = jsonschema.exceptions.best_match(validator(schema).iter_errors(arguments))
    except Exception:  # not a valid schema, or a $ref that does not resolve: unchecked
        return None
    return None if error is None else f"{error.json_path}: {error.message}"


@dataclass
class ToolCallEvent:
    """A complete (or, at the end of the output, unterminated) tool call."""

    index: int
    id: str
    name: Optional[str]
    args: str  # JSON text of the arguments; not JSON when the call was malformed
    error: Optional[str] = None
    cut: bool = False  # the output ended inside the call (max_tokens, a stop string, ...)


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

    # events: ("content", text) | ("reasoning", text) | ("tool_call", ToolCallEvent)

    def _emit(self, kind: str, text: str, out: list) -> None:
        text = self.channels[kind].feed(text)
        if text:
            out.append((kind, text))

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
            out.append(("tool_call", ToolCallEvent(index, new_call_id(), None, body.strip(),
                                                   reason, cut=bool(cut))))
            self.n_calls = index + 1
            return
        for name, arguments in calls:
            out.append(("tool_call", ToolCallEvent(self.n_calls, new_call_id(), name,
                                                   json.dumps(arguments, ensure_ascii=False))))
            self.n_calls += 1

    def feed(self, text: str) -> list:
        out: list = []
        self.pending += text
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
                continue
            if self.state == "reasoning":
                markers = [self.think_end]
            else:
                markers = [self.think_start] + ([self.call_start] if self.call_start else [])
            hits = [(self.pending.find(m), m) for m in markers if m in self.pending]
            if hits:
                position, marker = min(hits)
                self._emit(self.state, self.pending[:position], out)
                self.channels[self.state].cut()
                self.pending = self.pending[position + len(marker):]
                if marker == self.think_end:
                    self.state = "content"
                    self.channels["content"].cut()
                elif marker == self.think_start:
                    self.state = "reasoning"
                else:
                    self.state = "call"
                continue
            keep = self._partial_suffix(self.pending, markers)
            safe, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            self._emit(self.state, safe, out)
            break
        return out

    def finish(self, finish_reason: Optional[str] = None) -> list:
        """End of output: what was held back. An unterminated call is parsed as is;
        when it does not parse, its error names `finish_reason` ("length": max_tokens)."""
        out: list = []
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
                    out.append((kind, tail))
        return out

