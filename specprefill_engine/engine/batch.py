"""Decoding requests together: one forward per step over mlx-lm's batch caches.

A row joins with its own prompt cache, turned into a batch of one by the cache
class's `merge` and appended with `extend` (left padding aligns rows of different
lengths); it leaves through `filter`. Positions are data: a batch cache keeps a
per-row `offset`, which only RoPE reads, apart from the shared write index and
each row's left padding, which the mask reads. A SpecPrefill row holds N + t
entries yet must decode at position M + t, so its offset moves by M - N when it
joins; no wrapper is put on the model.

Steps are pipelined as in mlx-lm's `generate_step`: the next forward is queued
before the tokens of the previous one are read back. Logits processors see a row's
tokens as a lazy array (mlx-lm's `TokenBuffer`), so a repetition penalty needs no host
read; a row with processors has the forward queued before they run, so one that reads
the host (a grammar) works while the forward computes. A processor that fails, or returns
logits of another shape, fails its own row only. With a sharded target (`group`) rank
0's sampled tokens reach the other ranks inside that same graph; the other ranks
(`sampling=False`) sample nothing and read nothing.
"""

from itertools import repeat
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, TokenBuffer, make_prompt_cache,
)

from ..core import positioned_rope
from ..core.adapters import takes_position_ids
from ..core.prefill import logits_of
from .sampling import SamplingParams, read_logprobs, token_logprobs
from .state import RequestState

POSITIONED_CACHES = (BatchKVCache, BatchRotatingKVCache)


def broadcast_tokens(tokens: mx.array, group) -> mx.array:
    """Rank 0's tokens on every rank, inside the graph: the other ranks pass zeros
    computed from their own logits, so their forward runs with the same collectives."""
    return mx.distributed.all_sum(tokens.astype(mx.int32), group=group).astype(mx.uint32)


def _processed(row: RequestState, context: mx.array, logits: mx.array) -> mx.array:
    shape = logits.shape
    for processor in row.processors:
        logits = processor(context, logits)
    if logits.shape != shape:
        raise ValueError(f"a logits processor returned shape {logits.shape}, not {shape}")
    return logits


def sample_rows(rows: list, logits: mx.array, contexts: Optional[list] = None,
                failed: Optional[dict] = None) -> tuple[mx.array, Optional[tuple]]:
    """(B, vocab) logits -> (B,) tokens: each row's processors (seeing `contexts[i]`, its
    tokens so far), then its sampler. A row whose processors raise is sampled from its
    raw logits and recorded in `failed` (row -> error); the others are unaffected.
    Second, when a row asks for logprobs, `token_logprobs` of the raw logits (lazy, in
    the sample's graph; for every row, at the largest k asked), else None."""
    ks = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    raw = logits
    if any(row.processors for row in rows):
        parts = []
        for index, row in enumerate(rows):
            row_logits = logits[index : index + 1]
            if row.processors:
                try:
                    context = contexts[index] if contexts else mx.array(row.generated, mx.int32)
                    row_logits = _processed(row, context, row_logits)
                except Exception as error:  # this row fails; the others go on
                    if failed is None:
                        raise
                    failed[row] = error
                    row_logits = logits[index : index + 1]
            parts.append(row_logits)
        logits = mx.concatenate(parts, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(row.params.greedy for row in rows):
        tokens = mx.argmax(logprobs, axis=-1)
    else:
        tokens = mx.concatenate(
            [row.sampler(logprobs[index : index + 1]) for index, row in enumerate(rows)], axis=0)
    return tokens, (token_logprobs(raw, tokens, max(ks)) if ks else None)


def asked(rows: list) -> list:
    """Each row's logprobs k (None: not asked, or no row)."""
    return [None if row is None else row.params.logprobs for row in rows]


def as_batch_of_one(cache: list, shift: int) -> list:
    """A request's prompt cache as batch caches, its positions moved by `shift`."""
    merged = [type(layer).merge([layer]) for layer in cache]
    if shift:
        for layer in merged:
            if isinstance(layer, POSITIONED_CACHES):
                layer.offset = layer.offset + shift
    return merged


def batching_support(model: nn.Module) -> str:
    """Why this model's requests cannot share a batched decode; "" when they can.

    Decided by trying: two rows, one with moved positions, through one decode step.
    """
    if takes_position_ids(model):
        return "mlx-vlm multi-axis RoPE: decode positions come from the model's rope-delta carrier"
    cache = make_prompt_cache(model)
    lacking = sorted({type(c).__name__ for c in cache if not hasattr(type(c), "merge")})
    if lacking:
        return f"caches that cannot be merged into a batch: {', '.join(lacking)}"
    try:
        rows = []
        for shift in (0, 3):
            row_cache = make_prompt_cache(model)
            model(mx.array([[1, 2]]), cache=row_cache)
            rows.append(as_batch_of_one(row_cache, shift))
        for layer, other in zip(*rows):
            layer.extend(other)
        mx.eval(logits_of(model(mx.array([[1], [2]]), cache=rows[0])))
    except Exception as error:  # a model whose layers cannot take per-row positions
        return f"batched decode failed on this model: {type(error).__name__}: {error}"
    return ""


def cut_cache(cache: list, count: int) -> list:
    """The first `count` entries of a row's plain KV caches, as views (no copy: a later
    write into the live cache copies its buffer first, MLX arrays being values); the
    layers that cannot be cut as they are (they hold what the row was fed)."""
    cut = []
    for layer in cache:
        if type(layer) is KVCache:
            part = KVCache()
            part.keys, part.values = layer.keys[..., :count, :], layer.values[..., :count, :]
            part.offset = count
            layer = part
        cut.append(layer)
    return cut


def _saved(layer):
    """A way back to a cache layer's present state (its fields are arrays and lists
    that `extend` and `filter` replace, never write into)."""
    if isinstance(layer, CacheList):
        parts = [_saved(c) for c in layer.caches]
        caches = layer.caches
        return lambda: (setattr(layer, "caches", caches), [restore() for restore in parts])
    fields = {k: list(v) if isinstance(v, list) else v for k, v in vars(layer).items()}
    return lambda: vars(layer).update(fields)


# stands in for a row that has left but whose cache row is still there
_VACANT = SimpleNamespace(processors=[], params=SamplingParams(),
                          sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))


class DecodeBatch:
    """The rows decoding together, their batch caches and their next input tokens.

    A leaving row's slot stays (decoding costs no more for one row more) until half
    the slots are vacant or a row joins: compacting copies the whole batch's KV, and
    rows that started at different times leave at different steps.
    """

    def __init__(self, model: nn.Module, group=None, sampling: bool = True):
        self.model = model
        self.group = group  # a distributed group: tokens come from rank 0
        self.sampling = sampling  # rank 0 samples; the other ranks follow its tokens
        self.slots: list = []  # a row, or None once it has left
        self.contexts: list = []  # per slot: its tokens for processors (TokenBuffer) or None
        self.cache: Optional[list] = None
        self.inputs: Optional[mx.array] = None  # (B,) next tokens to feed, maybe not evaluated
        self.logprobs: Optional[tuple] = None  # `inputs`' token_logprobs, when a row asks
        self._known: list[bool] = []  # whether a slot's input token was already handed out
        self.plain = False  # one row on its own plain cache

    @property
    def rows(self) -> list:
        return [row for row in self.slots if row is not None]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row, cache: list, first_token: int, shift: int) -> None:
        """Join a row whose first token was already sampled and handed out. All or
        nothing: if joining fails (the copy into the batch cannot be allocated), the
        batch is as it was and the error is raised for this row alone.

        A lone row at its cache's own positions decodes on its plain cache, as mlx-lm's
        generate_step does (a batch cache's mask and per-row offsets cost ~20% per
        token there); the batch cache takes over when a second row joins."""
        layers = [_saved(layer) for layer in self.cache or []]
        before = (self.slots, self.contexts, self._known, self.cache, self.inputs, self.plain,
                  self.logprobs)
        try:
            self._compact()
            token = mx.array([first_token], dtype=mx.uint32)
            if self.cache is None:
                self.plain = shift == 0
                self.cache = cache if self.plain else as_batch_of_one(cache, shift)
                self.inputs = token
            else:
                if self.plain:
                    self.cache, self.plain = as_batch_of_one(self.cache, 0), False
                for layer, other in zip(self.cache, as_batch_of_one(cache, shift)):
                    layer.extend(other)
                self.inputs = mx.concatenate([self.inputs, token])
            if not self.plain:
                mx.eval(self.inputs, [layer.state for layer in self.cache])
        except BaseException:
            for restore in layers:
                restore()
            (self.slots, self.contexts, self._known, self.cache, self.inputs, self.plain,
             self.logprobs) = before
            raise
        self.slots = self.slots + [row]
        self.contexts = self.contexts + [TokenBuffer() if row.processors else None]
        self._known = self._known + [True]

    def step(self) -> tuple[list, dict]:
        """Queue one forward for every slot; return the tokens sampled by the previous
        step, (row, token, TokenLogprob or None) for each row, now that they are needed,
        and the rows whose processors failed in this one (row -> error)."""
        inputs = self.inputs
        logits = logits_of(self.model(inputs[:, None], cache=self.cache))[:, -1, :]
        if not self.sampling:
            self.inputs = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group)
            mx.async_eval(self.inputs)
            return [], {}
        rows = [row or _VACANT for row in self.slots]
        contexts = None
        if any(row.processors for row in rows):
            mx.async_eval(logits)  # the forward computes while host-side processors run
            contexts = [None if buffer is None else buffer.update_and_fetch(inputs[i : i + 1])
                        for i, buffer in enumerate(self.contexts)]
        failed: dict = {}
        self.inputs, logprobs = sample_rows(rows, logits, contexts, failed)
        if self.group is not None:
            self.inputs = broadcast_tokens(self.inputs, self.group)
        mx.async_eval(self.inputs, [c for c in contexts or [] if c is not None], logprobs or ())
        produced = self._read(inputs, self.logprobs)
        self.logprobs = logprobs
        self._known = [False] * len(self.slots)
        return produced, failed

    def _read(self, inputs: mx.array, logprobs: Optional[tuple]) -> list:
        produced = []
        tokens = inputs.tolist()
        read = repeat(None)
        if logprobs is not None:
            ks = [None if known else k for known, k in zip(self._known, asked(self.slots))]
            read = read_logprobs(logprobs, tokens, ks)
        for row, known, token, logprob in zip(self.slots, self._known, tokens, read):
            if row is not None and not known:
                row.generated.append(token)
                produced.append((row, token, logprob))
        return produced

    def extract(self, row, count: int) -> list:
        """A row's first `count` cache entries as plain per-layer caches (its left
        padding removed): views on a lone row's own cache, else one copy each."""
        if self.plain:
            return cut_cache(self.cache, count)
        index = self.slots.index(row)
        extracted = []
        for layer in self.cache:
            if isinstance(layer, BatchKVCache):
                padding = int(layer.left_padding[index].item())
                part = KVCache()
                part.keys = mx.contiguous(layer.keys[index : index + 1, :, padding : padding + count])
                part.values = mx.contiguous(layer.values[index : index + 1, :, padding : padding + count])
                part.offset = count
                extracted.append(part)
            else:
                extracted.append(layer.extract(index))
        return extracted

    def remove(self, leaving: set) -> None:
        """Rows leave (finished or aborted); their cache rows go at the next compaction."""
        self.slots = [None if row in leaving else row for row in self.slots]
        self.contexts = [None if row is None else c for row, c in zip(self.slots, self.contexts)]
        if not self.rows:
            self.slots, self.contexts, self._known, self.cache, self.inputs = [], [], [], None, None
            self.logprobs = None
        elif 2 * self.slots.count(None) >= len(self.slots):
            self._compact()

    def _compact(self) -> None:
        keep = [i for i, row in enumerate(self.slots) if row is not None]
        if len(keep) == len(self.slots):
            return
        self.slots = [self.slots[i] for i in keep]
        self.contexts = [self.contexts[i] for i in keep]
        self._known = [self._known[i] for i in keep]
        if not keep:
            self.cache = self.inputs = self.logprobs = None
            return
        indices = mx.array(keep, dtype=mx.int32)
        for layer in self.cache:
            layer.filter(indices)
        self.inputs = self.inputs[indices]
        if self.logprobs is not None:
            self.logprobs = tuple(a[indices] for a in self.logprobs)


class SoloDecode:
    """One row of a model whose caches cannot be batched: a forward per step, its
    positions set for that call (the prefill's per-call handling) and cleared after."""

    def __init__(self, model: nn.Module, row, cache: list, first_token: int, shift: int,
                 group=None, sampling: bool = True):
        self.model, self.row, self.cache, self.shift = model, row, cache, shift
        self.group, self.sampling = group, sampling
        self.rows = [row]
        self.token = first_token

    def extract(self, row, count: int) -> list:
        return cut_cache(self.cache, count)

    def remove(self, leaving: set) -> None:
        self.rows = [row for row in self.rows if row not in leaving]

    def step(self) -> tuple[list, dict]:
        with positioned_rope(self.model, shift=self.shift):
            output = self.model(mx.array([[self.token]]), cache=self.cache)
        logits = logits_of(output)[:, -1, :]
        if not self.sampling:
            self.token = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group).item()
            return [], {}
        failed: dict = {}
        token, logprobs = sample_rows(self.rows, logits, None, failed)
        if self.group is not None:
            token = broadcast_tokens(token, self.group)
        mx.eval(token, logprobs or ())
        self.token = token.item()
        self.row.generated.append(self.token)
        logprob = read_logprobs(logprobs, [self.token], asked(self.rows))[0]
        return [(self.row, self.token, logprob)], failed
