"""The memory budget: what running requests' KV and the prefix caches may hold.

By default it is what the device can hold, less the weights: on Apple silicon MLX's
recommended working set (what Metal keeps resident without paging; past it a long
prompt's KV is what panics a 16-32 GB Mac), on CUDA the device's memory, on a CPU the
free RAM when the engine starts, each within MLX's memory limit (`mx.set_memory_limit`);
`HEADROOM` of it is left for what a forward computes (a prefill chunk's activations)
and MLX's buffer cache. `kv_cache_bytes` sets it.

Each request reserves at admission what it can come to hold: its target KV for the
prompt and `max_tokens` (quantized where `kv_bits` will quantize it) and the draft's KV
of the prompt while it scores (and of its reply where it proposes one); a SpecPrefill
request's reservation shrinks to its kept tokens once selected, and the draft's goes
when scoring ends. Requests that decode in the shared batch also hold its padding:
mlx-lm's batch caches pad every row to the longest. The prefix caches give memory back
first: their least recently used entries are dropped to make room. A request that
cannot fit even alone (more than the whole budget) is refused before anything is
allocated, with `MemoryBudgetError`; one that fits once others finish waits in the
queue.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..core.quantized_kv import QuantizedKV, kv_bytes

logger = logging.getLogger(__name__)
HEADROOM = 0.1  # of the device's memory, left for activations and MLX's buffer cache
GB = 1e9


class MemoryBudgetError(ValueError):
    """A request needs more KV memory than the engine's whole budget; it is refused
    before anything is allocated, the engine goes on."""


def free_ram() -> int:
    """The RAM available to a new allocation now: /proc/meminfo's MemAvailable (page
    cache it can reclaim included), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else \
        os.sysconf("SC_PHYS_PAGES")
    return pages * os.sysconf("SC_PAGE_SIZE")


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) the device can hold, within MLX's memory limit (past it MLX
    gives its buffer cache back; past the device, allocations fail on CUDA or page)."""
    total, what = 0, ""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        if mx.metal.is_available():
            total, what = int(info["max_recommended_working_set_size"]), \
                "Metal's recommended working set"
        else:
            total, what = int(info.get("total_memory") or info.get("memory_size") or 0), \
                "the GPU's memory"
    if not total:
        total, what = free_ram(), "free RAM"
    limit = mx.get_memory_limit()
    if 0 < limit < total:
        return limit, "MLX's memory limit"
    return total, what


def weights_bytes(*models: Optional[nn.Module]) -> int:
    return sum(x.nbytes for m in models if m is not None
               for _, x in tree_flatten(m.parameters()))


@dataclass
class MemoryBudget:
    """The budget and where it came from (`stats()["memory"]`)."""

    budget: int  # bytes for running requests' KV and the prefix caches
    source: str
    device_bytes: int = 0  # what the device can hold (0: the budget was given)
    weights_bytes: int = 0


def memory_budget(kv_cache_bytes: Optional[int], device: tuple[int, str],
                  weights: int) -> MemoryBudget:
    """`kv_cache_bytes` when given, else the device's memory (`device_memory()`, read
    before the weights were loaded) less `HEADROOM` and the weights."""
    if kv_cache_bytes is not None:
        return MemoryBudget(kv_cache_bytes, "kv_cache_bytes", 0, weights)
    total, what = device
    budget = max(int(total * (1 - HEADROOM)) - weights, 0)
    if not budget:
        logger.warning("the weights (%.1f GB) leave no memory for KV in %s (%.1f GB): every "
                       "request will be refused; set kv_cache_bytes", weights / GB, what,
                       total / GB)
    return MemoryBudget(budget, f"{what} ({total / GB:.1f} GB) less {HEADROOM:.0%} and the "
                        f"weights ({weights / GB:.2f} GB)", total, weights)


@dataclass
class KVRates:
    """Bytes one KV entry takes in each model's dtype, and how the target's is quantized."""

    target: int
    draft: int = 0
    itemsize: int = 4  # bytes of the target's dtype
    kv: Optional[QuantizedKV] = None

    def target_bytes(self, entries: int) -> int:
        return kv_bytes(self.target, entries, self.kv, self.itemsize)

    def draft_bytes(self, entries: int) -> int:
        return self.draft * entries


@dataclass
class Reservation:
    """What a request may come to hold, in bytes."""

    target: int = 0
    draft: int = 0

    @property
    def total(self) -> int:
        return self.target + self.draft


def reservation(rates: KVRates, prompt: int, entries: int, max_tokens: int, scored: bool,
                proposes: bool) -> Reservation:
    """What a request may come to hold: its target KV for `entries` prompt entries (the
    kept ones once selected) and `max_tokens`, and the draft's of the prompt while it is
    `scored` (and of the reply where it `proposes` one)."""
    draft = rates.draft_bytes(prompt + (max_tokens if proposes else 0)) if scored or proposes \
        else 0
    return Reservation(rates.target_bytes(entries + max_tokens), draft)


def need_message(need: Reservation, budget: MemoryBudget, entries: str) -> str:
    return (f"this request needs {need.total / GB:.3f} GB of KV memory ({entries}: target "
            f"{need.target / GB:.3f} GB, draft {need.draft / GB:.3f} GB), more than the "
            f"{budget.budget / GB:.3f} GB available for KV ({budget.source}); shorten the "
            "prompt or max_tokens, use SpecPrefill (a lower keep), kv_bits=8 or 4, or a "
            "larger kv_cache_bytes")


@dataclass
class MemoryStats:
    """`Engine.stats()["memory"]`: the budget and what holds it now."""

    budget: int
    source: str
    device_bytes: int
    weights_bytes: int
    held: int = 0  # every reservation, the batch's padding and both prefix caches
    requests: dict = field(default_factory=dict)  # request id -> {"target", "draft"} reserved
    prefix_cache: int = 0
    draft_prefix_cache: int = 0
    evicted: int = 0  # prefix-cache entries dropped to make room for a request
    batch_padding: int = 0  # the shared decode batch's rows padded to its longest
