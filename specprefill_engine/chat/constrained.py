"""Constrained decoding: a request's `response_format` as a per-row logits mask.

Built on llguidance (grammar engine: JSON schema, Lark, regex). The mask for the
next token is computed on the host by llguidance into a packed bitmask (one bit per
token), unpacked on the host (numpy) and applied with one `mx.where`, so it runs on
every MLX backend (CPU, CUDA, Metal); no custom kernels.

Three entry points, as the engine uses them:

- `check_response_format(response_format) -> dict`, on the caller's thread:
  validates and normalizes (raises ValueError / TypeError naming `response_format`).
- `resolve_response_format(normalized, tokenizer, think, max_tokens) -> dict`, on the
  caller's thread once the prompt is rendered: fixes the tool-call format and the
  reasoning part, and builds the grammar, so a format or tool that cannot be
  constrained fails before anything runs.
- `make_constraint(tokenizer, response_format)`, on the worker: returns a logits
  processor `processor(generated, logits) -> logits` for ONE row. `generated` holds
  the tokens that row has generated so far (empty on the first call), `logits` is
  (1, V); V may exceed the tokenizer's vocabulary (padded embedding rows stay
  disallowed). Once the grammar is complete only EOS remains allowed.

Formats:

- `{"type": "json_object"}`: any JSON object. `"schema": {...}` may be added, then
  the object must match it (used by LangChain's json_mode with a schema).
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` (OpenAI
  style), or `{"type": "json_schema", "schema": {...}}`.
- `{"type": "tool_call", "tools": [OpenAI tool dicts], "tool_choice": ...,
  "parallel_tool_calls": False, "format": None}`: calls in the markup of the
  tokenizer's tool-call format (`format`, default: the tokenizer's mlx-lm parser):
  `json_tools` (Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`),
  `qwen3_coder` (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
  </function>\n</tool_call>`) or `glm47` (`<tool_call>NAME<arg_key>KEY</arg_key>
  <arg_value>VALUE</arg_value></tool_call>`); the arguments match the tool's
  parameters as the matching mlx-lm parser reads them back. Any other format raises
  `ToolsNotSupportedError`. tool_choice "auto" (free text, and any call the model
  starts is a valid one), "required" (alias "any": one or more calls, nothing else),
  or a tool by name (`{"type": "function", "function": {"name": ...}}` or the bare
  name): exactly that call.
- `{"type": "lark", "lark": "..."}` and `{"type": "regex", "regex": "..."}`.

Every format takes `"reasoning"` and `"reasoning_budget"`. With reasoning "open" (the
default when the prompt ends inside a think block) the output starts as free
thinking, `</think>` is forced after `reasoning_budget` tokens (default: half of
max_tokens) unless the model closes it first, and the format constrains what
follows. "optional" lets the model open a think block itself first (the default for
tokenizers with think tokens whose prompt has none); "none" constrains from the
first token.

Objects in JSON schemas and tool parameters that do not say `additionalProperties`
are closed (only the listed properties), as in OpenAI's strict mode. A turn that may
hold several calls holds at most `MAX_PARALLEL_CALLS`. Tool parameters may use JSON
schema keywords llguidance does not implement (`propertyNames`, `if` / `then`, `not`,
`uniqueItems`, an unknown `format`, a look-around `pattern`, ...): those keywords are
left out of the call grammar, with a warning naming the tool and the keyword, and the
parser checks each call against the full schema (`chat/tool_calls.py`). A response_format's
own schema is compiled as given: what does not compile is a ValueError. A string
parameter of the XML formats is free text up to its closing tag; its `enum` and
`maxLength` are enforced, other string keywords are not.
"""

import copy
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

from .tool_calls import (
    TOOL_FORMATS, ToolsNotSupportedError, check_tool_choice, think_markers, tool_format,
)

logger = logging.getLogger(__name__)
_FORMATS = ("json_object", "json_schema", "tool_call", "lark", "regex")
REASONING = ("open", "optional", "none")
REASONING_SHARE = 0.5  # of max_tokens: the default reasoning budget
MAX_SEPARATOR = 4  # whitespace characters allowed between </think> and the answer
MAX_PARALLEL_CALLS = 16  # calls one turn may hold when several are allowed


def _fail(message: str, error=ValueError):
    raise error(f"response_format: {message}")


def _require_llguidance():
    try:
        import llguidance  # noqa: F401
    except ImportError:  # pragma: no cover - a dependency of the extras that need it
        raise ImportError(
            "response_format needs llguidance: pip install 'specprefill-engine[constrained]'"
        ) from None
    return llguidance


# validation -----------------------------------------------------------------------


def _check_schema(schema, where: str) -> dict:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        _fail(f"{where} must be a JSON schema (a dict), got {type(schema).__name__}", TypeError)
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as error:
        _fail(f"{where} is not JSON-serializable: {error}", TypeError)
    return schema


def _check_tools(tools) -> list:
    if not isinstance(tools, (list, tuple)) or not tools:
        _fail("tool_call needs a non-empty list of tools")
    checked, names = [], set()
    for tool in tools:
        if not isinstance(tool, dict):
            _fail(f"each tool must be a dict, got {type(tool).__name__}", TypeError)
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            _fail("each tool must be {'type': 'function', 'function': {'name': ..., "
                  "'parameters': {...}}}")
        name = function["name"]
        if name in names:
            _fail(f"tool {name!r} is given twice")
        names.add(name)
        parameters = _check_schema(function.get("parameters") or {"type": "object"},
                                   f"parameters of tool {name!r}")
        checked.append({"type": "function", "function": {
            "name": name, "description": function.get("description", ""),
            "parameters": parameters}})
    return checked


def _check_tool_choice(choice, names: list):
    """`tool_calls.check_tool_choice`'s choice as the grammar takes it (a name as a
    function object); "none" constrains nothing, so it has no grammar."""
    try:
        checked = check_tool_choice(choice, names)
    except ValueError as error:
        _fail(str(error))
    if checked == "none":
        _fail("tool_choice 'none' has no grammar: leave response_format out")
    if checked in ("auto", "required"):
        return checked
    return {"type": "function", "function": {"name": checked}}


def _check_reasoning(response_format) -> dict:
    """The optional reasoning keys, checked."""
    out = {}
    reasoning = response_format.get("reasoning")
    if reasoning is not None:
        if reasoning not in REASONING:
            _fail(f"reasoning must be one of {list(REASONING)} or None, got {reasoning!r}")
        out["reasoning"] = reasoning
    budget = response_format.get("reasoning_budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            _fail(f"reasoning_budget must be an integer >= 0, got {budget!r}")
        out["reasoning_budget"] = budget
    return out


def check_response_format(response_format) -> dict:
    """Validate a response_format and return its normalized form (see module doc)."""
    if not isinstance(response_format, dict):
        _fail(f"must be a dict like {{'type': 'json_object'}}, got "
              f"{type(response_format).__name__}", TypeError)
    kind = response_format.get("type")
    if kind not in _FORMATS:
        _fail(f"type must be one of {list(_FORMATS)}, got {kind!r}")
    reasoning = _check_reasoning(response_format)
    if kind == "json_object":
        normalized = {"type": "json_object"}
        if response_format.get("schema") is not None:
            normalized["schema"] = _check_schema(response_format["schema"], "schema")
        return {**normalized, **reasoning}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None and "schema" in response_format:
            spec = {"name": response_format.get("name", "response"),
                    "schema": response_format["schema"]}
        if not isinstance(spec, dict) or "schema" not in spec:
            _fail("json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return {"type": "json_schema", "json_schema": {
            "name": str(spec.get("name") or "response"),
            "schema": _check_schema(spec["schema"], "json_schema.schema")}, **reasoning}
    if kind == "tool_call":
        tools = _check_tools(response_format.get("tools"))
        names = [t["function"]["name"] for t in tools]
        parallel = response_format.get("parallel_tool_calls", False)
        if not isinstance(parallel, bool):
            _fail("parallel_tool_calls must be True or False", TypeError)
        normalized = {"type": "tool_call", "tools": tools, "parallel_tool_calls": parallel,
                      "tool_choice": _check_tool_choice(response_format.get("tool_choice"), names)}
        form = response_format.get("format")
        if form is not None:
            normalized["format"] = _check_tool_format(form)
        return {**normalized, **reasoning}
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        _fail(f"{kind} needs a non-empty string under {kind!r}", TypeError)
    llguidance = _require_llguidance()
    grammar = (llguidance.LLMatcher.grammar_from_lark(text) if kind == "lark"
               else llguidance.LLMatcher.grammar_from_regex(text))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        _fail(f"invalid {kind}: {error}")
    return {"type": kind, kind: text, **reasoning}


def _check_tool_format(form) -> str:
    if form not in TOOL_FORMATS:
        raise ToolsNotSupportedError(
            f"response_format: constrained tool calls are not available for the tool-call "
            f"format {form!r}; they are for {list(TOOL_FORMATS)} (mlx-lm's parser names)")
    return form


def tool_call_format(tokenizer) -> str:
    """The tokenizer's tool-call format, if calls in it can be constrained."""
    form = tool_format(tokenizer)
    if form is None:
        raise ToolsNotSupportedError(
            "response_format: the tokenizer has no tool-call format (mlx-lm found no "
            "tool parser for its chat template), so calls could not be read back")
    return _check_tool_format(form)


def resolve_response_format(response_format: dict, tokenizer, think: Optional[str],
                            max_tokens: int) -> dict:
    """A normalized response_format made definite for one request: the tool-call
    format (the tokenizer's unless given), the reasoning part (`think` is what the
    rendered prompt allows, see `chat.Rendered.think`) and its budget, and the
    grammar itself, built here so that what cannot be constrained fails on the
    caller's side."""
    resolved = dict(check_response_format(response_format))
    if resolved["type"] == "tool_call" and "format" not in resolved:
        resolved["format"] = tool_call_format(tokenizer)
    reasoning = resolved.get("reasoning") or think or "none"
    resolved["reasoning"] = reasoning
    if reasoning != "none" and "reasoning_budget" not in resolved:
        resolved["reasoning_budget"] = max(1, int(max_tokens * REASONING_SHARE))
    resolved["grammar"] = grammar_for(resolved, tokenizer)
    return resolved


# grammars -------------------------------------------------------------------------


SAFE_INTEGER = 2**53 - 1
# Compact JSON with Python's json.dumps separators; no free whitespace for a model
# to fill.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _closed(schema):
    """A copy where objects that list properties admit no others unless they say so,
    and integers without bounds stay within +-(2**53 - 1), the range in which JSON
    numbers interoperate (RFC 7493): a model cannot write digits forever."""
    if isinstance(schema, dict):
        out = {k: (v if k in ("const", "enum", "default", "examples") else _closed(v))
               for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        if out.get("type") == "integer":
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = SAFE_INTEGER
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = -SAFE_INTEGER
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _json(schema: dict) -> str:
    """A Lark `%json` item for a schema, compact and closed."""
    return "%json " + json.dumps({**_closed(copy.deepcopy(schema)), "x-guidance": JSON_OPTIONS})


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _regex_text(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_META else c for c in text)


def _without(text: str) -> str:
    """A Lark regex for any text not containing `text`."""
    return f"/(?s:.*)/ & ~/(?s:.*){_regex_text(text)}(?s:.*)/"


class _Markers:
    """How marker strings are written in a grammar: a special token by its id (text
    never spells it), anything else as a literal."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def special(self, text: str) -> bool:
        if self.tokenizer is None:
            return False
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and llg_tokenizer(self.tokenizer).is_special_token(ids[0])

    def item(self, text: str) -> str:
        if self.special(text):
            return f"<[{self.tokenizer.encode(text, add_special_tokens=False)[0]}]>"
        return _lark_string(text)


def _parameters(function: dict) -> tuple:
    parameters = function["parameters"]
    return dict(parameters.get("properties") or {}), set(parameters.get("required") or [])


def _string_schema(schema: dict) -> Optional[dict]:
    """The string branch when a value of this schema is a string or null, else None."""
    if schema.get("type") == "string":
        return schema
    branches = schema.get("anyOf") or schema.get("oneOf")
    if "type" not in schema and branches:
        strings = [b for b in branches if b.get("type") == "string"]
        if len(strings) == 1 and all(b is strings[0] or b.get("type") == "null" for b in branches):
            return strings[0]
    return None


class _Grammar:
    """Lark rules, named by position so any tool or parameter name is safe."""

    def __init__(self):
        self.lines: list = []
        self.count = 0

    def rule(self, body: str, attrs: str = "") -> str:
        self.count += 1
        name = f"r{self.count}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name

    def token(self, regex: str) -> str:
        self.count += 1
        name = f"T{self.count}"
        self.lines.append(f"{name}: {regex}")
        return name


def _free_value(grammar: _Grammar, schema: dict, tag: str, closer: str, trim: bool = False,
                nullable: Optional[bool] = None) -> str:
    """A string value written as raw text and ended by `closer`: one of its enum, or
    text within its maxLength that holds no closing `tag`. `trim`: no surrounding
    whitespace (the parser strips it). `nullable` (Qwen3-Coder's reading, where the
    text "null" is None): True, no JSON container either (the parser reads one for a
    schema without a type); False, never the text "null"."""
    if schema.get("enum"):
        options = " | ".join(_lark_string(str(v)) for v in schema["enum"])
        return grammar.rule(f"({options}) {_lark_string(closer)}")
    text = "(?s:\\S|\\S.*\\S)?" if trim else "(?s:.*)"
    regex = f"/{text}/ & ~/(?s:.*){_regex_text(tag)}(?s:.*)/"
    if schema.get("maxLength") is not None:
        regex += f" & /(?s:.{{0,{int(schema['maxLength'])}}})/"
    if nullable:
        regex += " & ~/[ \\t\\r\\n]*[\\[{](?s:.*)/"
    elif nullable is False:
        regex += " & ~/(?i:null)/"
    return grammar.rule(f"{grammar.token(regex)} {_lark_string(closer)}", "[lazy]")


def _xml_call(grammar: _Grammar, function: dict) -> str:
    """Qwen3-Coder: `\\n<function=NAME>\\n` then `<parameter=KEY>\\nVALUE\\n</parameter>\\n`
    per argument, in the schema's order, then `</function>\\n`."""
    name = function["name"]
    if not name or any(c.isspace() or c in "<>" for c in name):
        _fail(f"tool {name!r}: qwen3_coder calls need a name without spaces or '<>'")
    properties, required = _parameters(function)
    closer = "\n</parameter>\n"
    items = []
    for key, schema in properties.items():
        if not key or any(c.isspace() or c in "<>" for c in key):
            _fail(f"tool {name!r} parameter {key!r}: qwen3_coder needs names without "
                  "spaces or '<>'")
        head = _lark_string(f"<parameter={key}>\n")
        text = _string_schema(schema)
        kind = schema.get("type")
        if text is not None:
            value = _free_value(grammar, text, "</parameter>", closer,
                                nullable=text is not schema)
        elif kind in ("integer", "number", "boolean", "object", "array"):
            value = grammar.rule(f"{_json(schema)} {_lark_string(closer)}")
        elif key in required:
            _fail(f"tool {name!r} parameter {key!r}: mlx-lm's qwen3_coder parser cannot read "
                  f"a value of schema {json.dumps(schema)} back; give it one JSON type")
        else:
            continue  # optional and unreadable: left to its default
        item = grammar.rule(f"{head} {value}")
        items.append(item if key in required else f"{item}?")
    body = " ".join([_lark_string(f"<function={name}>\n"), *items, _lark_string("</function>\n")])
    return grammar.rule(body)


def _arg_key_call(grammar: _Grammar, function: dict) -> str:
    """GLM 4.7: `NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per
    argument; string parameters as text (the parser strips it), others as JSON."""
    name = function["name"]
    if not name or any(c.isspace() for c in name) or "<" in name:
        _fail(f"tool {name!r}: glm47 calls need a name without spaces or '<'")
    properties, required = _parameters(function)
    items = []
    for key, schema in properties.items():
        if not key or key != key.strip() or "</arg_key>" in key:
            _fail(f"tool {name!r} parameter {key!r}: glm47 needs names without surrounding "
                  "spaces or '</arg_key>'")
        head = _lark_string(f"<arg_key>{key}</arg_key><arg_value>")
        if schema.get("type") == "string":
            value = _free_value(grammar, schema, "</arg_value>", "</arg_value>", trim=True)
        else:
            value = grammar.rule(f"{_json(schema)} {_lark_string('</arg_value>')}")
        item = grammar.rule(f"{head} {value}")
        items.append(item if key in required else f"{item}?")
    return grammar.rule(" ".join([_lark_string(name), *items]))


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_loosened: "OrderedDict[str, dict]" = OrderedDict()  # parameters JSON -> what compiles
_loosened_lock = threading.Lock()
LOOSENED_CACHE = 256


def _drop(schema, unwanted: Callable[[str, Any], bool]):
    """A copy without the keywords for which `unwanted(keyword, value)` holds (property
    names and literal values are never taken for keywords)."""
    if isinstance(schema, list):
        return [_drop(v, unwanted) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if unwanted(key, value):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _drop(v, unwanted) for name, v in value.items()}
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        else:
            out[key] = _drop(value, unwanted)
    return out


def _bad_pattern(key: str, value) -> bool:
    if key != "pattern" or not isinstance(value, str):
        return False
    llguidance = _require_llguidance()
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": value})
    return bool(llguidance.LLMatcher.validate_grammar(grammar))


def _compiles(schema: dict) -> str:
    """llguidance's complaint about a schema ('' when it compiles)."""
    llguidance = _require_llguidance()
    Matcher = llguidance.LLMatcher
    problem = Matcher.validate_grammar(Matcher.grammar_from_json_schema(_closed(schema)))
    return "" if problem.startswith("WARNING") else problem


def _loosen(schema: dict) -> tuple:
    """(schema, dropped keywords): the schema less what llguidance does not implement."""
    dropped: list = []
    for _ in range(8):  # each round removes one kind of problem
        problem = _compiles(schema)
        keys = _UNIMPLEMENTED.search(problem)
        fmt = _UNKNOWN_FORMAT.search(problem)
        if keys:
            names = set(json.loads(f"[{keys.group(1)}]"))
            schema = _drop(schema, lambda key, value: key in names)
            dropped += sorted(names)
        elif fmt:
            schema = _drop(schema, lambda key, value: key == "format" and value == fmt.group(1))
            dropped.append(f"format {fmt.group(1)!r}")
        elif "regex parse error" in problem:
            schema = _drop(schema, _bad_pattern)
            dropped.append("pattern (look-around or other regex llguidance does not parse)")
        else:
            break  # compiles, or a problem the grammar itself reports
    return schema, dropped


def grammar_parameters(tool: dict) -> dict:
    """A tool with parameters the call grammar can compile (see the module doc); the
    keywords left out are logged once per distinct schema."""
    function = tool["function"]
    key = json.dumps(function["parameters"], sort_keys=True)
    with _loosened_lock:
        cached = _loosened.get(key)
        if cached is not None:
            _loosened.move_to_end(key)
    if cached is None:
        cached, dropped = _loosen(function["parameters"])
        if dropped:
            logger.warning("tool %r: the call grammar leaves out %s (not implemented by "
                           "llguidance); its calls are checked against the full schema once "
                           "parsed", function["name"], ", ".join(dropped))
        with _loosened_lock:
            _loosened[key] = cached
            while len(_loosened) > LOOSENED_CACHE:
                _loosened.popitem(last=False)
    if cached == function["parameters"]:
        return tool
    return {**tool, "function": {**function, "parameters": cached}}


def _call_schema(tools: list) -> dict:
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = _closed(copy.deepcopy(function["parameters"]))
        parameters.setdefault("type", "object")
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False,
        })
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def _call_body(grammar: _Grammar, normalized: dict, markers: _Markers) -> str:
    """The rule for what follows the start marker, through the end marker."""
    choice = normalized["tool_choice"]
    tools = normalized["tools"]
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    end = markers.item(TOOL_MARKERS[1])
    form = normalized.get("format", "json_tools")
    if form == "json_tools":
        return grammar.rule(f'"\\n" %json {json.dumps(_call_schema(tools))} "\\n" {end}')
    build = _xml_call if form == "qwen3_coder" else _arg_key_call
    options = " | ".join(build(grammar, t["function"]) for t in tools)
    lead = '"\\n" ' if form == "qwen3_coder" else ""
    return grammar.rule(f"{lead}({options}) {end}")


TOOL_MARKERS = ("<tool_call>", "</tool_call>")  # every constrained format opens with these


def _tool_answer(grammar: _Grammar, normalized: dict, markers: _Markers) -> str:
    normalized = dict(normalized, tools=[grammar_parameters(t) for t in normalized["tools"]])
    choice = normalized["tool_choice"]
    start_text = TOOL_MARKERS[0]
    start = markers.item(start_text)
    body = _call_body(grammar, normalized, markers)
    if choice == "auto":
        # Any text; once the model writes the start marker, a valid call must follow.
        text = grammar.token("/(.|\\n)*/")
        if markers.special(start_text):
            head = grammar.rule(f"{text} {start}")
            free = grammar.token("/(.|\\n)*/")
        else:
            head = grammar.rule(f"{text} {start}", "[lazy]")
            free = grammar.token(_without(start_text))
        if normalized["parallel_tool_calls"]:
            return grammar.rule(f"({head} {body}){{0,{MAX_PARALLEL_CALLS}}} {free}")
        return grammar.rule(f"{free} | {head} {body}")
    call = grammar.rule(f"{start} {body}")
    if normalized["parallel_tool_calls"] and not isinstance(choice, dict):
        return grammar.rule(f'{call} ("\\n" {call}){{0,{MAX_PARALLEL_CALLS - 1}}}')
    return call


def _reasoning(grammar: _Grammar, normalized: dict, markers: _Markers) -> Optional[str]:
    """The rule for the thinking before the answer, None when there is none."""
    mode = normalized.get("reasoning") or "none"
    if mode == "none":
        return None
    opener, closer = think_markers(markers.tokenizer)
    budget = normalized.get("reasoning_budget", 0)
    separator = grammar.token(f"/[ \\t\\r\\n]{{0,{MAX_SEPARATOR}}}/")
    parts = [markers.item(closer), separator]
    if budget > 0:
        parts.insert(0, grammar.rule(_without(closer), f"[max_tokens={budget}]"))
    thought = grammar.rule(" ".join(parts))
    if mode == "open":
        return thought
    return grammar.rule(f"({markers.item(opener)} {thought})?")


def grammar_for(response_format, tokenizer=None) -> str:
    """The llguidance grammar (serialized) for a response_format. The tokenizer picks
    the tool-call format when the format does not say, and the think markers."""
    llguidance = _require_llguidance()
    normalized = check_response_format(response_format)
    kind = normalized["type"]
    Matcher = llguidance.LLMatcher
    if kind == "tool_call" and "format" not in normalized:
        normalized["format"] = tool_call_format(tokenizer) if tokenizer is not None \
            else "json_tools"
    markers = _Markers(tokenizer)
    grammar = _Grammar()
    thought = _reasoning(grammar, normalized, markers)
    nested = None
    if kind in ("json_object", "json_schema"):
        schema = normalized.get("schema") or {"type": "object"} if kind == "json_object" \
            else normalized["json_schema"]["schema"]
        if thought is None:
            return Matcher.grammar_from_json_schema(_closed(schema), overrides=JSON_OPTIONS)
        answer = grammar.rule(_json(schema))
    elif kind == "tool_call":
        answer = _tool_answer(grammar, normalized, markers)
    else:
        text = normalized[kind]
        user = text if kind == "lark" else \
            json.loads(Matcher.grammar_from_regex(text))["grammars"][0]["lark_grammar"]
        if thought is None:
            return Matcher.grammar_from_lark(user)
        nested = {"name": "answer", "lark_grammar": user}
        answer = "@answer"
    start = f"start: {thought} {answer}" if thought else f"start: {answer}"
    lark = "\n".join(["%llguidance {}", start, *grammar.lines])
    if nested is None:
        return Matcher.grammar_from_lark(lark)
    return json.dumps({"grammars": [{"lark_grammar": lark}, nested]})


# tokenizers -----------------------------------------------------------------------

_llg_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_llg_lock = threading.Lock()


def llg_tokenizer(tokenizer):
    """llguidance's tokenizer for an mlx-lm TokenizerWrapper (or HF tokenizer), cached."""
    llguidance = _require_llguidance()
    with _llg_lock:
        cached = _llg_tokenizers.get(tokenizer)
        if cached is not None:
            return cached
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("constrained decoding needs a fast (tokenizers-backed) tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            built = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
        except TypeError:  # an llguidance that takes one end token: the tokenizer's own
            one = hf.eos_token_id if hf.eos_token_id in eos else eos[0]
            built = llguidance.LLTokenizer(backend.to_str(), eos_token=one)
        _llg_tokenizers[tokenizer] = built
        return built


# the processor --------------------------------------------------------------------


class GrammarConstraint:
    """Logits processor for one row: masks every token the grammar does not allow."""

    def __init__(self, tokenizer, grammar: str):
        llguidance = _require_llguidance()
        self.llg = llg_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"response_format: {self.matcher.get_error()}")
        self.eos = list(self.llg.eos_tokens) if hasattr(self.llg, "eos_tokens") \
            else [self.llg.eos_token]
        import numpy as np

        self._np = np
        self._words = (self.llg.vocab_size + 31) // 32
        self._bitmask = np.zeros((1, self._words), dtype=np.int32)
        self._allowed = None  # one byte per logit column, reused step to step
        self.consumed = 0

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def _advance(self, generated) -> None:
        n = int(generated.size)
        if n <= self.consumed:
            return
        for token in generated[self.consumed:].tolist():
            if token in self.eos:
                break
            if not self.matcher.consume_token(int(token)):
                raise ValueError(f"response_format: token {token} breaks the grammar: "
                                 f"{self.matcher.get_error()}")
        self.consumed = n

    def mask_words(self):
        """The packed allowed-token mask (int32 words) for the next token."""
        np = self._np
        if self.matcher.is_stopped():
            self._bitmask[:] = 0
            words = self._bitmask.view(np.uint32)
            for token in self.eos:
                words[0, token >> 5] |= np.uint32(1 << (token & 31))
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            if self.matcher.is_error():
                raise ValueError(f"response_format: {self.matcher.get_error()}")
        return self._bitmask[0]

    def __call__(self, generated, logits):
        import mlx.core as mx

        np = self._np
        self._advance(generated)
        bits = np.unpackbits(self.mask_words().view(np.uint8), bitorder="little")
        vocab = logits.shape[-1]
        if self._allowed is None or self._allowed.size != vocab:
            self._allowed = np.zeros(vocab, dtype=np.uint8)  # padding columns stay 0
        n = min(vocab, bits.size)
        self._allowed[:n] = bits[:n]
        allowed = mx.array(self._allowed.view(np.bool_))
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def make_constraint(tokenizer, response_format) -> Callable[[Any, Any], Any]:
    """A fresh logits processor for one request (row); see the module doc."""
    grammar = response_format.get("grammar") or grammar_for(response_format, tokenizer)
    return GrammarConstraint(tokenizer, grammar)

