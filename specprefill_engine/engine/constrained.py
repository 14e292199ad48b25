"""Constrained decoding: a request's `response_format` as a per-row logits mask.

Built on llguidance (grammar engine: JSON schema, Lark, regex). The mask for the
next token is computed on the host by llguidance into a packed bitmask (one bit per
token), unpacked on the host (numpy, ~0.1 ms at a 152K vocabulary) and applied with
one `mx.where`, so it runs on every MLX backend (CPU, CUDA, Metal); no custom kernels.

Two entry points, as the engine uses them:

- `check_response_format(response_format) -> dict`, on the caller's thread:
  validates and normalizes (raises ValueError / TypeError naming `response_format`).
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
  "parallel_tool_calls": False}`: Qwen / Hermes markup,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the arguments
  matching the tool's parameters. tool_choice "auto" (free text, and any call the
  model starts is a valid one), "required" (alias "any": one or more calls, nothing
  else), or a tool by name (`{"type": "function", "function": {"name": ...}}` or
  the bare name): exactly that call.
- `{"type": "lark", "lark": "..."}` and `{"type": "regex", "regex": "..."}`.

Objects in JSON schemas and tool parameters that do not say `additionalProperties`
are closed (only the listed properties), as in OpenAI's strict mode.
"""

import copy
import json
import threading
import weakref
from typing import Any, Callable, Optional

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FORMATS = ("json_object", "json_schema", "tool_call", "lark", "regex")


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
    if choice is None or choice == "auto":
        return "auto"
    if choice in ("required", "any") or choice is True:
        return "required"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else choice.get("name")
    elif isinstance(choice, str):
        name = choice
    else:
        _fail(f"tool_choice must be 'auto', 'required', or a tool name; got {choice!r}", TypeError)
    if name not in names:
        _fail(f"tool_choice names {name!r}, which is not among the tools {names}")
    return {"type": "function", "function": {"name": name}}


def check_response_format(response_format) -> dict:
    """Validate a response_format and return its normalized form (see module doc)."""
    if not isinstance(response_format, dict):
        _fail(f"must be a dict like {{'type': 'json_object'}}, got "
              f"{type(response_format).__name__}", TypeError)
    kind = response_format.get("type")
    if kind not in _FORMATS:
        _fail(f"type must be one of {list(_FORMATS)}, got {kind!r}")
    if kind == "json_object":
        normalized = {"type": "json_object"}
        if response_format.get("schema") is not None:
            normalized["schema"] = _check_schema(response_format["schema"], "schema")
        return normalized
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None and "schema" in response_format:
            spec = {"name": response_format.get("name", "response"),
                    "schema": response_format["schema"]}
        if not isinstance(spec, dict) or "schema" not in spec:
            _fail("json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return {"type": "json_schema", "json_schema": {
            "name": str(spec.get("name") or "response"),
            "schema": _check_schema(spec["schema"], "json_schema.schema")}}
    if kind == "tool_call":
        tools = _check_tools(response_format.get("tools"))
        names = [t["function"]["name"] for t in tools]
        parallel = response_format.get("parallel_tool_calls", False)
        if not isinstance(parallel, bool):
            _fail("parallel_tool_calls must be True or False", TypeError)
        return {"type": "tool_call", "tools": tools, "parallel_tool_calls": parallel,
                "tool_choice": _check_tool_choice(response_format.get("tool_choice"), names)}
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        _fail(f"{kind} needs a non-empty string under {kind!r}", TypeError)
    llguidance = _require_llguidance()
    grammar = (llguidance.LLMatcher.grammar_from_lark(text) if kind == "lark"
               else llguidance.LLMatcher.grammar_from_regex(text))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        _fail(f"invalid {kind}: {error}")
    return {"type": kind, kind: text}


# grammars -------------------------------------------------------------------------


SAFE_INTEGER = 2**53 - 1
# Compact JSON with Python's json.dumps separators; no free whitespace for a model
# to fill.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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


def _lark_string(text: str) -> str:
    return json.dumps(text)


def tool_call_lark(normalized: dict) -> str:
    """The Lark grammar of a normalized tool_call format."""
    choice = normalized["tool_choice"]
    tools = normalized["tools"]
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    body = json.dumps(_call_schema(tools))
    start, end = _lark_string(TOOL_CALL_START + "\n"), _lark_string("\n" + TOOL_CALL_END)
    lines = [
        "%llguidance {}",
        f"call: {start} body {end}",
        f"body: %json {body}",
    ]
    if choice == "auto":
        # Any text; once the model writes the start marker, a valid call must follow.
        lines += [
            f"head[lazy]: TEXT {_lark_string(TOOL_CALL_START)}",
            f"tail: \"\\n\" body {end}",
            "TEXT: /(.|\\n)*/",
            "FREE: /(?s:.*)/ & ~/(?s:.*)" + TOOL_CALL_START.replace("/", "\\/") + "(?s:.*)/",
        ]
        if normalized["parallel_tool_calls"]:
            lines.insert(1, "start: (head tail)* FREE")
        else:
            lines.insert(1, "start: FREE | head tail")
    elif normalized["parallel_tool_calls"] and not isinstance(choice, dict):
        lines.insert(1, 'start: call ("\\n" call)*')
    else:
        lines.insert(1, "start: call")
    return "\n".join(lines)


def grammar_for(response_format) -> str:
    """The llguidance grammar (serialized) for a response_format."""
    llguidance = _require_llguidance()
    normalized = check_response_format(response_format)
    kind = normalized["type"]
    Matcher = llguidance.LLMatcher
    if kind == "json_object":
        schema = _closed(normalized.get("schema") or {"type": "object"})
        return Matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        return Matcher.grammar_from_json_schema(_closed(normalized["json_schema"]["schema"]),
                                                overrides=JSON_OPTIONS)
    if kind == "tool_call":
        return Matcher.grammar_from_lark(tool_call_lark(normalized))
    if kind == "lark":
        return Matcher.grammar_from_lark(normalized["lark"])
    return Matcher.grammar_from_regex(normalized["regex"])


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
        built = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
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
    return GrammarConstraint(tokenizer, grammar_for(response_format))


def allowed_tokens(processor: GrammarConstraint) -> Optional[list]:
    """Token ids the processor allows next (for tests and debugging)."""
    np = processor._np
    words = processor.mask_words().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0].tolist()
