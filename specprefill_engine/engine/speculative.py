"""Speculative decoding with the SpecPrefill draft, for a row that decodes alone.

The draft that scored the prompt holds the prompt's KV afterwards (a dense request's
draft computes it first), so it can propose the reply too: each round it proposes
`count` tokens greedily, the target checks them in one forward, and the row takes every
proposal up to the first the target would not have chosen, then the target's own token
there. Greedy only, so the reply is plain decoding's (in float32: in bfloat16 a forward
of several tokens rounds otherwise than one-token steps, and a near-tie can go the
other way). A round costs the draft's steps and one target forward of `count + 1`
tokens, which pays where decode is bound by reading the weights (a Mac, a CPU) and not
where it is bound by the host building each forward (docs/benchmarks.md, "Speculative
decoding").

A round's tokens come out together, read back at its end (no pipelining across rounds).
Both caches are cut back to the tokens taken (mlx-lm's `trim_prompt_cache`), so a row
moves into the shared batch as any row does when another request joins
(`Executor._demote`).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from ..core import positioned_rope
from ..core.adapters import takes_position_ids
from ..core.prefill import logits_of
from ..core.quantized_kv import QuantizedKV, cut_cache


def speculative_support(model: nn.Module, draft: Optional[nn.Module], group) -> str:
    """Why this pair cannot decode speculatively; "" when it can."""
    if draft is None:
        return "it needs a draft model"
    if group is not None:
        return "the target is sharded (the draft runs on rank 0 alone)"
    if takes_position_ids(model):
        return "mlx-vlm multi-axis RoPE: decode positions come from the model's rope-delta carrier"
    for name, m in (("target", model), ("draft", draft)):
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(m) if type(c) is not KVCache})
        if kinds:
            return (f"the {name}'s caches ({', '.join(kinds)}) cannot be cut back to the "
                    "tokens taken: only plain KV caches can")
    return ""


class SpeculativeDecode:
    """One row: its target cache (`shift`: how far its positions move, a SpecPrefill
    row's), the draft's cache of the same tokens, and the token sampled last, handed out
    and not yet in the target's cache."""

    def __init__(self, model: nn.Module, draft: nn.Module, handle: int, cache: list,
                 draft_cache: list, first_token: int, shift: int, count: int,
                 kv: Optional[QuantizedKV] = None):
        self.model, self.draft = model, draft
        self.kv = kv  # the target's quantized KV: applied after each round (mlx-lm's way)
        self.cache, self.draft_cache = cache, draft_cache
        self.shift, self.count = shift, count
        self.rows = [handle]
        self.token = first_token
        self.pending = [first_token]  # taken tokens the draft has not read yet
        self.round = (0, 0)  # the last round's tokens proposed and taken from the draft

    def extract(self, handle: int, count: int) -> list:
        return cut_cache(self.cache, count)

    def remove(self, leaving: set) -> None:
        self.rows = [handle for handle in self.rows if handle not in leaving]

    def _propose(self) -> mx.array:
        inputs = mx.array(self.pending, dtype=mx.uint32)
        proposed = []
        for _ in range(self.count):
            logits = logits_of(self.draft(inputs[None], cache=self.draft_cache))
            inputs = mx.argmax(logits[0, -1:, :], axis=-1).astype(mx.uint32)
            mx.async_eval(inputs)
            proposed.append(inputs)
        return mx.concatenate(proposed)

    def _check(self, proposed: mx.array) -> mx.array:
        inputs = mx.concatenate([mx.array([self.token], dtype=mx.uint32), proposed])[None]
        if self.shift:
            with positioned_rope(self.model, shift=self.shift):
                logits = logits_of(self.model(inputs, cache=self.cache))
        else:
            logits = logits_of(self.model(inputs, cache=self.cache))
        return mx.argmax(logits[0], axis=-1)

    def step(self) -> tuple[list, dict]:
        """One round: (handle, token, None) for each token taken, and no failures."""
        proposed = self._propose()
        checked = self._check(proposed)
        mx.eval(proposed, checked)
        drafts, targets = proposed.tolist(), checked.tolist()
        taken = 0
        while taken < self.count and drafts[taken] == targets[taken]:
            taken += 1
        # the target read the last token and every proposal; the draft every proposal
        # but the last
        trim_prompt_cache(self.cache, self.count - taken)
        trim_prompt_cache(self.draft_cache, max(self.count - 1 - taken, 0))
        if self.kv is not None:
            self.kv.apply(self.cache)
        self.token = targets[taken]
        self.pending = [drafts[-1], self.token] if taken == self.count else [self.token]
        handle = self.rows[0]
        tokens = [(handle, token, None) for token in drafts[:taken] + [self.token]]
        self.round = (self.count, taken)
        return tokens, {}
