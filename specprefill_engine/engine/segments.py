"""Which tokens of a chat prompt SpecPrefill must never drop, from the chat template.

An agent's prompt is system prompt, tool definitions, documents, turns and tool
results. Dropping a piece of a tool schema or a role marker breaks the agent, so
these are kept whole: system (and developer) messages, the tool definitions the
template renders, every special token of the template together with the role name
after it, and, when earlier turns exist, the newest user or tool message (its last
`recent_cap` tokens) with the generation prompt. Sparsification applies to the rest:
documents, older tool outputs and turns. A single-turn prompt's one user message is
the content itself; there the selection's own tail keeps the question.

Message spans come from rendering prefixes of the conversation: a template that
renders messages[:i] as a prefix of the whole prompt gives message i's start. When a
template is not prefix-stable, only the special tokens and the tail are protected.
"""

import logging
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)
ROLE_TOKENS_AFTER_SPECIAL = 2  # "<|im_start|>" + "assistant" + "\n"-style markers


def _render(tokenizer, messages, tools, kwargs, generation_prompt=False) -> list:
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                              **extra))


def _starts(tokenizer, messages, tools, kwargs, ids: np.ndarray, indices) -> dict:
    """Start position of message i (rendering messages[:i]) for each i in indices."""
    starts = {0: 0}
    for index in indices:
        if index in starts:
            continue
        prefix = _render(tokenizer, messages[:index], tools, kwargs)
        if len(prefix) > ids.size or not np.array_equal(ids[: len(prefix)], prefix):
            return {}
        starts[index] = len(prefix)
    return starts


def _tool_span(tokenizer, messages, tools, kwargs, ids: np.ndarray) -> Optional[tuple]:
    """Where the template inserted the tool definitions: compare the first message
    rendered with and without tools."""
    with_tools = _render(tokenizer, messages[:1], tools, kwargs)
    without = _render(tokenizer, messages[:1], None, kwargs)
    extra = len(with_tools) - len(without)
    if extra <= 0 or not np.array_equal(ids[: len(with_tools)], with_tools):
        return None
    diverge = next((i for i, (a, b) in enumerate(zip(with_tools, without)) if a != b),
                   len(without))
    return diverge, diverge + extra


def special_ids(tokenizer) -> np.ndarray:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    ids = set(getattr(hf, "all_special_ids", []) or [])
    ids |= set((getattr(hf, "get_added_vocab", lambda: {})() or {}).values())
    return np.array(sorted(ids), dtype=np.int64)


def protected_tokens(tokenizer, messages: list, ids: np.ndarray, tools: Optional[list] = None,
                     chat_template_kwargs: Optional[dict] = None,
                     recent_cap: int = 1024) -> np.ndarray:
    """A boolean mask over `ids` (the rendered prompt) of tokens never to drop."""
    keep = np.zeros(ids.size, dtype=bool)
    special = np.isin(ids, special_ids(tokenizer))
    for offset in range(ROLE_TOKENS_AFTER_SPECIAL + 1):
        keep[offset:] |= special[: ids.size - offset]
    try:
        last = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "tool")),
                   default=None)
        wanted = {1} | ({last} if last is not None else set())
        starts = _starts(tokenizer, messages, tools, chat_template_kwargs, ids,
                         sorted(i for i in wanted if i <= len(messages)))
        if starts and messages[0].get("role") in ("system", "developer"):
            keep[: starts[1]] = True
        earlier_turns = last is not None and any(
            m.get("role") in ("user", "assistant", "tool") for m in messages[:last])
        if starts and earlier_turns:  # alone, the newest message is the content itself
            keep[max(starts[last], ids.size - recent_cap):] = True
        if tools:
            span = _tool_span(tokenizer, messages, tools, chat_template_kwargs, ids)
            if span is not None:
                keep[span[0] : span[1]] = True
    except Exception as error:  # a template we cannot take apart: special tokens only
        logger.info("chat segments unavailable: %r", error)
    return keep
