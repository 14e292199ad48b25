"""Decoding helpers for tests: greedy decoding under one constraint, what a constraint
allows next, the Lark text of a tool-call grammar, and a whole output read by the
OutputParser."""

import json
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from specprefill_engine.chat.constrained import (
    GrammarConstraint, _Grammar, _Markers, _tool_answer,
)
from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent
from specprefill_engine.chat.tool_calls import OutputParser


def constrained_decode(model, tokenizer, processor, ids: list, max_tokens: int) -> list:
    """The tokens greedy decoding writes after `ids`, the processor fed only those."""
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens,
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                                  logits_processors=[lambda t, l: processor(t[len(ids):], l)]):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def allowed_tokens(processor: GrammarConstraint) -> list:
    """Token ids the processor allows next."""
    words = processor.mask_words().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0].tolist()


def tool_call_lark(normalized: dict, tokenizer=None) -> str:
    """The Lark grammar of a normalized tool_call format (no reasoning part)."""
    markers = _Markers(tokenizer)
    grammar = _Grammar()
    answer = _tool_answer(grammar, normalized, markers)
    return "\n".join(["%llguidance {}", f"start: {answer}", *grammar.lines])


def split_tool_calls(text: str, tokenizer, tools: Optional[list] = None) -> tuple[str, list, list]:
    """A whole output read by OutputParser: (content without the calls, tool_calls,
    invalid_tool_calls), as LangChain's message fields."""
    parser = OutputParser(tokenizer, parse_tools=True, tools=tools)
    content, calls, invalid = [], [], []
    for value in parser.feed(text) + parser.finish():
        if isinstance(value, TextEvent):
            content.append(value.text)
        elif isinstance(value, ReasoningEvent):
            content.append(f"{parser.think_start}{value.text}{parser.think_end}")
        elif value.error is None:
            calls.append({"name": value.name, "args": json.loads(value.args), "id": value.id,
                          "type": "tool_call"})
        else:
            invalid.append({"name": value.name, "args": value.args, "id": value.id,
                            "error": value.error, "type": "invalid_tool_call"})
    return "".join(content).strip(), calls, invalid
