"""Decoding requests together: one forward per step over mlx-lm's batch caches.

A row joins with its own prompt cache, turned into a batch of one by the cache
class's `merge` and appended with `extend` (left padding aligns rows of different
lengths); it leaves through `filter`. Positions are data: a batch cache keeps a
per-row `offset`, which only RoPE reads, apart from the shared write index and
each row's left padding, which the mask reads. A SpecPrefill row holds N + t
entries yet must decode at position M + t, so its offset moves by M - N when it
joins. A row decoding alone keeps its plain cache (no mask), its rope moved by M - N
for each step's forward.

Steps are pipelined as in mlx-lm's `generate_step`: the next forward is queued
before the tokens of the previous one are read back. Logits processors see a row's
tokens as a lazy array (mlx-lm's `TokenBuffer`), so a repetition penalty needs no host
read; a row with processors has the forward queued before they run, so one that reads
the host (a grammar) works while the forward computes. A processor that fails, or returns
logits of another shape, fails its own row only. With a sharded target (`group`) rank
0's sampled tokens reach the other ranks inside that same graph; the other ranks
(`sampling=False`) sample nothing and read nothing.
"""

from contextlib import nullcontext
from itertools import repeat
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    BatchKVCache, BatchRotatingKVCache, CacheList, TokenBuffer, make_prompt_cache,
)

from ..core import positioned_rope
from ..core.adapters import takes_position_ids
from ..core.prefill import align_buffers, logits_of
from ..core.quantized_kv import QuantizedKV, cut_cache
from .sampling import GREEDY, RowSampler, read_logprobs, sample_rows

POSITIONED_CACHES = (BatchKVCache, BatchRotatingKVCache)


def broadcast_tokens(tokens: mx.array, group) -> mx.array:
    """Rank 0's tokens on every rank, inside the graph: the other ranks pass zeros
    computed from their own logits, so their forward runs with the same collectives."""
    return mx.distributed.all_sum(tokens.astype(mx.int32), group=group).astype(mx.uint32)


class BatchLost(RuntimeError):
    """The batch's caches could not be kept whole (a copy failed part way through its
    layers): every row of the batch fails with it."""


def as_batch_of_one(cache: list, shift: int) -> list:
    """A request's prompt cache as batch caches, its positions moved by `shift`."""
    return [_row_layer(layer, shift) for layer in cache]


def _row_layer(layer, shift: int):
    merged = type(layer).merge([layer])
    if shift and isinstance(merged, POSITIONED_CACHES):
        merged.offset = merged.offset + shift
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


def _saved(layer):
    """A way back to a cache layer's present state (its fields are arrays and lists
    that `extend` and `filter` replace, never write into)."""
    if isinstance(layer, CacheList):
        parts = [_saved(c) for c in layer.caches]
        caches = layer.caches
        return lambda: (setattr(layer, "caches", caches), [restore() for restore in parts])
    fields = {k: list(v) if isinstance(v, list) else v for k, v in vars(layer).items()}
    return lambda: vars(layer).update(fields)


def _asked(rows: list) -> list:
    """Each row's logprobs k (None: not asked)."""
    return [row.params.logprobs for row in rows]


class DecodeBatch:
    """The rows decoding together (by handle), their batch caches and their next input
    tokens. On rank 0 each row has its `RowSampler`; the other ranks sample nothing.

    A leaving row's slot goes at the next step or join (`_compact`): a vacant slot, and
    the left padding the others keep while a longer row stays, would hold memory the
    budget no longer counts, and the batch's length would keep growing with the steps.
    Compacting copies the batch's KV once, a layer at a time: about what two decode
    steps read.
    """

    def __init__(self, model: nn.Module, group=None, sampling: bool = True):
        self.model = model
        self.group = group  # a distributed group: tokens come from rank 0
        self.sampling = sampling  # rank 0 samples; the other ranks follow its tokens
        self.slots: list = []  # a handle, or None once it has left
        self.samplers: list = []  # per slot: its RowSampler (rank 0), GREEDY when vacant
        self.contexts: list = []  # per slot: its tokens for processors (TokenBuffer) or None
        self.cache: Optional[list] = None
        self.inputs: Optional[mx.array] = None  # (B,) next tokens to feed, maybe not evaluated
        self.logprobs: Optional[tuple] = None  # `inputs`' token_logprobs, when a row asks
        self._known: list[bool] = []  # whether a slot's input token was already handed out
        self.plain = False  # one row on its own plain cache
        self.shift = 0  # that row's decode positions past its cache's (a sparse prefill)

    @property
    def rows(self) -> list:
        return [handle for handle in self.slots if handle is not None]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, handle: int, sampler: Optional[RowSampler], cache: list, first_token: int,
            shift: int) -> None:
        """Join a row whose first token was already sampled and handed out.

        The row's KV joins a layer at a time, each layer's copy evaluated before the
        next is made, so a join holds one layer's copy beside the batch, never a second
        batch. If joining fails (a copy cannot be allocated), the layers already joined
        give the row back, the batch is as it was and the error is raised for this row
        alone; where the batch cannot be put back (that too fails, or its compaction
        failed part way), `BatchLost`.

        A lone row decodes on its plain cache, as mlx-lm's generate_step does, its
        positions moved by `shift` through the rope (a sparse prefill's row): a batch
        cache's mask and per-row offsets cost time per token there (on CUDA the masked
        attention is several times slower). The batch cache takes over when a second
        row joins (a copy of one row, the lone one)."""
        try:
            self._compact()
        except BaseException as error:
            raise BatchLost(f"compacting the decode batch failed: {error!r}") from error
        token = mx.array([first_token], dtype=mx.uint32)
        if self.cache is None:
            self.cache, self.plain, self.shift, self.inputs = cache, True, shift, token
        else:
            if self.plain:
                alone, self.cache = self.cache, as_batch_of_one(self.cache, self.shift)
                try:
                    align_buffers(self.cache)
                    mx.eval([layer.state for layer in self.cache])
                except BaseException:
                    self.cache = alone
                    raise
                self.plain, self.shift = False, 0
            self._join_layers(cache, shift)
            self.inputs = mx.concatenate([self.inputs, token])
            mx.eval(self.inputs)
        sampler = sampler or GREEDY
        self.slots = self.slots + [handle]
        self.samplers = self.samplers + [sampler]
        self.contexts = self.contexts + [TokenBuffer() if sampler.processors else None]
        self._known = self._known + [True]

    def _join_layers(self, cache: list, shift: int) -> None:
        """Each batch layer extended by the row's, one layer evaluated at a time; a
        failure undoes the layers joined so far (`filter` to the batch's rows)."""
        rows = mx.arange(len(self.slots))
        for joined, (layer, own) in enumerate(zip(self.cache, cache)):
            restore = _saved(layer)
            try:
                layer.extend(_row_layer(own, shift))
                align_buffers([layer])
                mx.eval(layer.state)
            except BaseException as error:
                restore()
                try:
                    for done in self.cache[:joined]:
                        done.filter(rows)
                        mx.eval(done.state)
                except BaseException as lost:
                    raise BatchLost(f"a failed join could not be undone: {lost!r}") from error
                raise

    def step(self) -> tuple[list, dict]:
        """Queue one forward for every slot; return the tokens sampled by the previous
        step, (handle, token, TokenLogprob or None) for each row, now that they are
        needed, and the rows whose processors failed in this one (handle -> error).
        A slot left vacant: the batch is compacted first."""
        self._compact()
        inputs = self.inputs
        with positioned_rope(self.model, shift=self.shift) if self.shift else nullcontext():
            logits = logits_of(self.model(inputs[:, None], cache=self.cache))[:, -1, :]
        if not self.sampling:
            self.inputs = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group)
            mx.async_eval(self.inputs)
            return [], {}
        contexts = [None] * len(self.slots)
        if any(sampler.processors for sampler in self.samplers):
            mx.async_eval(logits)  # the forward computes while host-side processors run
            contexts = [None if buffer is None else buffer.update_and_fetch(inputs[i : i + 1])
                        for i, buffer in enumerate(self.contexts)]
        failed: dict = {}
        self.inputs, logprobs = sample_rows(self.samplers, logits, contexts, failed)
        if self.group is not None:
            self.inputs = broadcast_tokens(self.inputs, self.group)
        mx.async_eval(self.inputs, [c for c in contexts if c is not None], logprobs or ())
        produced = self._read(inputs, self.logprobs)
        self.logprobs = logprobs
        self._known = [False] * len(self.slots)
        return produced, {self.slots[i]: error for i, error in failed.items()
                          if self.slots[i] is not None}

    def _read(self, inputs: mx.array, logprobs: Optional[tuple]) -> list:
        tokens = inputs.tolist()
        read = repeat(None)
        if logprobs is not None:
            ks = [None if known or handle is None else k
                  for handle, known, k in zip(self.slots, self._known, _asked(self.samplers))]
            read = read_logprobs(logprobs, tokens, ks)
        return [(handle, token, logprob)
                for handle, known, token, logprob in zip(self.slots, self._known, tokens, read)
                if handle is not None and not known]

    def extract(self, handle: int, count: int) -> list:
        """A row's first `count` cache entries as plain per-layer caches (its left
        padding removed, mlx-lm's `extract`): views on a lone row's own cache, else one
        copy each."""
        if self.plain:
            return cut_cache(self.cache, count)
        index = self.slots.index(handle)
        return cut_cache([layer.extract(index) for layer in self.cache], count)

    def remove(self, leaving: set) -> None:
        """Rows leave (finished or aborted); their cache rows go at the next step or join."""
        self.slots = [None if handle in leaving else handle for handle in self.slots]
        self.samplers = [GREEDY if handle is None else sampler
                         for handle, sampler in zip(self.slots, self.samplers)]
        self.contexts = [None if handle is None else c
                         for handle, c in zip(self.slots, self.contexts)]
        if not self.rows:
            self.slots, self.samplers, self.contexts, self._known = [], [], [], []
            self.cache = self.inputs = self.logprobs = None

    def _compact(self) -> None:
        """The vacant slots' cache rows dropped, a layer evaluated at a time (one layer's
        copy beside the batch); the slots' lists follow once every layer is done."""
        occupied = [i for i, handle in enumerate(self.slots) if handle is not None]
        if len(occupied) == len(self.slots):
            return
        indices = mx.array(occupied, dtype=mx.int32)
        if not self.plain:
            for layer in self.cache:
                layer.filter(indices)
                mx.eval(layer.state)
        self.inputs = self.inputs[indices]
        if self.logprobs is not None:
            self.logprobs = tuple(a[indices] for a in self.logprobs)
        self.slots = [self.slots[i] for i in occupied]
        self.samplers = [self.samplers[i] for i in occupied]
        self.contexts = [self.contexts[i] for i in occupied]
        self._known = [self._known[i] for i in occupied]


class SoloDecode:
    """One row of a model whose caches cannot be batched (or of quantized KV, which
    mlx-lm cannot batch): a forward per step, its positions set for that call (the
    prefill's per-call handling) and cleared after."""

    def __init__(self, model: nn.Module, handle: int, sampler: Optional[RowSampler],
                 cache: list, first_token: int, shift: int, group=None, sampling: bool = True,
                 kv: Optional[QuantizedKV] = None):
        self.model, self.cache, self.shift = model, cache, shift
        self.kv = kv  # quantized KV: applied after each step, as mlx-lm's generate_step does
        self.sampler = sampler or GREEDY
        self.group, self.sampling = group, sampling
        self.rows = [handle]
        self.token = first_token
        self.context = TokenBuffer() if self.sampler.processors else None

    def extract(self, handle: int, count: int) -> list:
        return cut_cache(self.cache, count)

    def remove(self, leaving: set) -> None:
        self.rows = [handle for handle in self.rows if handle not in leaving]

    def step(self) -> tuple[list, dict]:
        with positioned_rope(self.model, shift=self.shift):
            output = self.model(mx.array([[self.token]]), cache=self.cache)
        if self.kv is not None:
            self.kv.apply(self.cache)
        logits = logits_of(output)[:, -1, :]
        if not self.sampling:
            self.token = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group).item()
            return [], {}
        context = None
        if self.context is not None:
            context = self.context.update_and_fetch(mx.array([self.token], dtype=mx.int32))
        failed: dict = {}
        token, logprobs = sample_rows([self.sampler], logits, [context], failed)
        if self.group is not None:
            token = broadcast_tokens(token, self.group)
        mx.eval(token, logprobs or ())
        self.token = token.item()
        logprob = read_logprobs(logprobs, [self.token], _asked([self.sampler]))[0]
        handle = self.rows[0]
        return [(handle, self.token, logprob)], {handle: error for error in failed.values()}
