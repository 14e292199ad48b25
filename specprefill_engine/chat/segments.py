"""Which tokens of a chat prompt SpecPrefill must never drop.

An agent's prompt is system prompt, tool definitions, documents, turns and tool
results. Dropping a piece of a tool schema or a role marker breaks the agent, so
these are kept whole: the tool definitions the template renders, every special token
of the template together with the role name after it, a leading system (or
developer) message of up to `system_cap` tokens, and, when earlier turns exist, the
newest user or tool message (its last `recent_cap` tokens) with the generation
prompt. A longer system message holds documents (RAG pipelines and agent frameworks
put retrieved text there): its instructions, its first and last `system_cap / 2`
tokens, are kept, `keep` applies to its middle, and the newest user message, then
the request itself, is kept as after earlier turns. Sparsification applies to the
rest: documents, older tool outputs and turns. A single-turn prompt's one user
message is the content itself; there the selection's own tail keeps the question.

Where messages start comes from the chat template's one render (`chat.render_chat`);
a boundary the template does not render stably is unknown (None), and what depends
on it is not protected: with none known, only the special tokens and the tail are.
"""

import threading
import weakref
from typing import Optional

import numpy as np

ROLE_TOKENS_AFTER_SPECIAL = 2  # "<|im_start|>" + "assistant" + "\n"-style markers

_special: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_special_lock = threading.Lock()


def special_ids(tokenizer) -> np.ndarray:
    """The tokenizer's special and added token ids (cached per tokenizer)."""
    with _special_lock:
        cached = _special.get(tokenizer)
    if cached is not None:
        return cached
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    ids = set(getattr(hf, "all_special_ids", []) or [])
    ids |= set((getattr(hf, "get_added_vocab", lambda: {})() or {}).values())
    found = np.array(sorted(ids), dtype=np.int64)
    with _special_lock:
        _special[tokenizer] = found
    return found


def system_ends(end: int, tool_span: Optional[tuple], cap: int) -> Optional[np.ndarray]:
    """The system message's own tokens in [0, end) (the tool definitions left out)
    when they number more than `cap`: its first and last `cap / 2`, as a mask. None
    when it is short enough to keep whole."""
    own = np.ones(end, dtype=bool)
    if tool_span is not None:
        own[tool_span[0] : tool_span[1]] = False
    where = np.flatnonzero(own)
    if where.size <= cap:
        return None
    head = cap // 2
    mask = np.zeros(end, dtype=bool)
    mask[where[:head]] = True
    mask[where[where.size - (cap - head):]] = True
    return mask


def protect(ids: np.ndarray, special: np.ndarray, roles: list, bounds: list,
            tool_span: Optional[tuple], recent_cap: int, system_cap: int) -> np.ndarray:
    """A boolean mask over `ids` of tokens never to drop. `bounds[i]` is the token
    where message i starts (None: unknown); `bounds[len(roles)]` where the generation
    prompt starts; `tool_span` the tokens of the rendered tool definitions."""
    keep = np.zeros(ids.size, dtype=bool)
    marks = np.isin(ids, special)
    for offset in range(ROLE_TOKENS_AFTER_SPECIAL + 1):
        keep[offset:] |= marks[: ids.size - offset]
    documents_first = False  # a long system message: it holds the content
    if roles and roles[0] in ("system", "developer") and bounds[1] is not None:
        ends = system_ends(bounds[1], tool_span, system_cap)
        if ends is None:
            keep[: bounds[1]] = True
        else:
            keep[: bounds[1]] |= ends
            documents_first = True
    last = max((i for i, role in enumerate(roles) if role in ("user", "tool")), default=None)
    is_request = last is not None and (documents_first or any(
        role in ("user", "assistant", "tool") for role in roles[:last]))
    if is_request and bounds[last] is not None:  # alone, the newest is the content itself
        keep[max(bounds[last], ids.size - recent_cap):] = True
    if tool_span is not None:
        keep[tool_span[0] : tool_span[1]] = True
    return keep
