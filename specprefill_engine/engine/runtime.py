"""Everything the worker thread owns: models, tokenizer, scorer, prefix cache."""

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .._blas import blas_status
from ..core import DraftScorer, Scorer
from ..core.matching import MATCH_WEIGHT
from ..core.prefill import STEP_SIZE
from ..core.quantized_kv import (
    KV_GROUP_SIZE, QUANTIZED_KV_START, QuantizedKV, check_kv_bits, quantized_kv_support,
)
from ..core.scoring import N_LOOKAHEAD, N_WINDOW, POOL_KERNEL, default_draft_step_size
from ..core.selection import BACKBONE, CHUNK_SIZE, KEEP, SPREAD, TAIL_TOKENS
from ..loading import DEMO_DRAFT, DEMO_TARGET, ModelLoadError, check_same_tokenizer, load_model
from .batch import batching_support
from .decisions import Decisions
from ..chat.render import DEFAULT_RECENT_CAP, DEFAULT_SYSTEM_CAP
from .disk_cache import model_identity
from .distributed import Channel, agree
from .plan import TurnPlan
from .kv_store import checkpointed
from .memory import KVRates, MemoryBudget, device_memory, memory_budget, weights_bytes
from .policy import CostModel, cost_model
from .speculative import speculative_support
from .vouch import DraftCheck, DraftVerdict
from .blank_lines import BlankLines
from .words import TokenWords

logger = logging.getLogger(__name__)


def default_step_size() -> int:
    """Tokens in the first unit of prefill work; on a CPU later units shrink so each
    costs as much (attention grows with the context: `core.prefill.unit_tokens`). A
    unit must take well under a second so decoding streams keep flowing, so 256 on a
    CPU (docs/how-it-works.md, "Batching"); a GPU wants large chunks."""
    return 256 if mx.default_device() == mx.cpu else STEP_SIZE


def check_keep(keep, name: str = "keep") -> float:
    """A share of the prompt to prefill: in (0, 1]."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or \
            not math.isfinite(keep) or not 0 < keep <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {keep!r}")
    return keep


def check_draft_tokens(value, name: str = "num_draft_tokens") -> int:
    """Tokens the draft proposes a round: an integer >= 0 (0: no speculative decoding)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: off), got {value!r}")
    return value


def check_count(value, name: str) -> int:
    """An integer >= 1 (a token count, a size)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings; `keep`, `threshold` and `specprefill` can be overridden
    per request. `step_size` (target prefill unit) and `draft_step_size` (the draft's
    scoring chunk) None pick the device's defaults on the worker; `kv_cache_bytes`
    is the memory for running requests' KV and the prefix caches (None: what the device
    can hold, less the weights: `memory.py`)."""

    keep: float = KEEP
    threshold: int = 1024
    chunk_size: int = CHUNK_SIZE
    tail_tokens: int = TAIL_TOKENS
    backbone_pct: float = BACKBONE
    n_lookahead: int = N_LOOKAHEAD
    n_window: int = N_WINDOW
    pool_kernel: int = POOL_KERNEL
    spread: int = SPREAD  # tokens after an important one whose chunks rank with it
    # the question's words found elsewhere in the prompt rank with the draft's top (x this;
    # `core/matching.py`); 0: the draft's attention alone
    match_weight: float = MATCH_WEIGHT
    step_size: Optional[int] = None
    draft_step_size: Optional[int] = None
    prefix_cache_bytes: int = 8 << 30  # kept only whole: an 8B model's KV at 32K is ~4.5 GiB
    max_batch_size: int = 32
    kv_cache_bytes: Optional[int] = None
    draft_prefix_cache_bytes: int = 4 << 30
    prefix_cache_disk_bytes: int = 0  # both models' files on disk, least recently used out; 0: off
    prefix_cache_disk_bits: int = 0  # 8 or 4: KV stored quantized on disk; 0: as computed
    cache_dir: Optional[str] = None  # the disk tier's folder's parent; None: `cache_dir()`
    reuse_coverage: float = 0.9
    specprefill_margin: float = 0.1
    recent_message_cap: int = DEFAULT_RECENT_CAP  # tokens of the newest message kept
    system_message_cap: int = DEFAULT_SYSTEM_CAP  # a longer system message: its ends kept
    rank_timeout: float = 60.0  # seconds a turn may take before rank 0 declares a rank lost
    # "idle": compute a SpecPrefill turn's dense KV while idle; "decode": also one unit in
    # each turn where requests only decode (every token of theirs waits for it); "off"
    densify: str = "idle"
    # the probe of whether the draft finds what the target would (`vouch.py`): "lazy" on the
    # first prompt the automatic policy would engage on, "load" as the engine starts, "off"
    draft_check: str = "lazy"
    # speculative decoding: tokens the draft proposes a round for a greedy request that
    # decodes alone (`speculative.py`); 0: off. Requests can set their own
    num_draft_tokens: int = 0
    # quantized KV, mlx-lm's settings: the target's KV (running requests' and its prefix
    # cache's) in `kv_bits` (4 or 8; None: the model's dtype), groups of `kv_group_size`
    # along the head dimension, once a cache holds `quantized_kv_start` entries
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_GROUP_SIZE
    quantized_kv_start: int = QUANTIZED_KV_START

    def __post_init__(self):
        check_keep(self.keep)
        check_kv_bits(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        if isinstance(self.match_weight, bool) or not isinstance(self.match_weight, (int, float)) \
                or not math.isfinite(self.match_weight) or self.match_weight < 0:
            raise ValueError(f"match_weight must be a number >= 0 (0: off), got "
                             f"{self.match_weight!r}")
        if not 0 <= self.specprefill_margin:
            raise ValueError(f"specprefill_margin must be >= 0, got {self.specprefill_margin!r}")
        if not 0 <= self.reuse_coverage <= 1:
            raise ValueError(f"reuse_coverage must be in [0, 1], got {self.reuse_coverage!r}")
        for name in ("threshold", "chunk_size", "max_batch_size", "n_lookahead", "n_window",
                     "recent_message_cap"):
            check_count(getattr(self, name), name)
        for name in ("system_message_cap", "spread"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.densify not in ("idle", "decode", "off"):
            raise ValueError(f"densify must be 'idle', 'decode' or 'off', got {self.densify!r}")
        if self.draft_check not in ("lazy", "load", "off"):
            raise ValueError(f"draft_check must be 'lazy', 'load' or 'off', got "
                             f"{self.draft_check!r}")
        if not (isinstance(self.rank_timeout, (int, float)) and self.rank_timeout > 0):
            raise ValueError(f"rank_timeout must be a number of seconds > 0, got "
                             f"{self.rank_timeout!r}")
        disk = self.prefix_cache_disk_bytes
        if isinstance(disk, bool) or not isinstance(disk, int) or disk < 0:
            raise ValueError(f"prefix_cache_disk_bytes must be an integer >= 0 (0: off), got "
                             f"{disk!r}")
        if self.prefix_cache_disk_bits not in (0, 4, 8) or isinstance(
                self.prefix_cache_disk_bits, bool):
            raise ValueError(f"prefix_cache_disk_bits must be 0, 4 or 8, got "
                             f"{self.prefix_cache_disk_bits!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a path or None, got {self.cache_dir!r}")
        check_draft_tokens(self.num_draft_tokens)
        for name in ("step_size", "draft_step_size", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None:
                check_count(value, f"{name} (None or an integer >= 1)")


@dataclass
class Runtime:
    """Owned by the worker thread; never handed to other threads."""

    model: nn.Module
    tokenizer: object
    scorer: Optional[Scorer]
    config: EngineConfig
    context_length: Optional[int]
    batch_reason: str  # why requests cannot share a batched decode; "" when they can
    kv_bytes_per_token: int
    vocab_size: int  # token ids a prompt may hold: the embedding's rows
    costs: CostModel  # prefill costs for the policy
    checkpointed: bool = False  # caches that cannot be cut: snapshots at message boundaries
    group: object = None  # the distributed group of a sharded target; None on one machine
    channel: Optional[Channel] = None  # rank 0's plan broadcast to the other ranks
    identities: tuple = ("", "")  # target's and draft's `model_identity`; "": no disk tier
    vouch: Optional[DraftCheck] = None  # what the engine knows of its draft; None: no draft
    speculative_reason: str = ""  # why the pair cannot decode speculatively; "": it can
    words: Optional[TokenWords] = None  # the tokens' words, where the selection matches them
    blank_lines: Optional[BlankLines] = None  # where blocks begin: the selection's units
    decisions: Decisions = field(default_factory=Decisions)  # the same request, the same plan
    kv: Optional[QuantizedKV] = None  # how the target's KV is quantized; None: not
    memory: Optional[MemoryBudget] = None  # what running requests' KV and the caches may hold
    rates: Optional[KVRates] = None  # KV bytes per entry, of each model


@dataclass(frozen=True)
class EngineInfo:
    """What callers may know of a started engine (no models: those stay on the worker)."""

    tokenizer: object
    context_length: Optional[int]
    batching: bool
    batch_reason: str
    step_size: int
    vocab_size: int
    ranks: int = 1  # processes the target is sharded over
    draft: Optional[DraftVerdict] = None  # the draft check's verdict now; None: no draft
    memory: Optional[MemoryBudget] = None  # the KV budget (rank 0)
    rates: Optional[KVRates] = None  # KV bytes per entry of each model (rank 0)


def context_length_of(model: nn.Module) -> Optional[int]:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size_of(model: nn.Module, tokenizer) -> int:
    """The embedding's size (it counts added tokens, which `tokenizer.vocab_size`
    leaves out), else the tokenizer's full length."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return len(tokenizer._tokenizer)


def kv_bytes_per_token(model: nn.Module) -> int:
    """KV bytes one token adds across all layers, from one probe token's cache."""
    cache = make_prompt_cache(model)
    model(mx.array([[1]]), cache=cache)
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            total += (keys.nbytes + values.nbytes) // max(keys.shape[2], 1)
    return total


def quantized_kv_of(config: EngineConfig, model: nn.Module, group) -> Optional[QuantizedKV]:
    """The engine's `QuantizedKV`, or None; a target that cannot take it is refused by
    name (ValueError)."""
    if config.kv_bits is None:
        return None
    kv = QuantizedKV(config.kv_bits, config.kv_group_size, config.quantized_kv_start)
    if group is not None:
        raise ValueError(f"kv_bits={kv.bits}: quantized KV is not supported on a sharded "
                         "target (mlx.launch): only rank 0 is given the setting")
    refused = quantized_kv_support(model, kv)
    if refused:
        raise ValueError(f"kv_bits={kv.bits}, kv_group_size={kv.group_size}: this target's "
                         f"KV cannot be quantized ({refused})")
    return kv


def itemsize_of(model: nn.Module) -> int:
    """Bytes of one element of the model's KV: its floating weights' dtype."""
    return next((v.dtype.size for _, v in tree_flatten(model.parameters())
                 if mx.issubdtype(v.dtype, mx.floating)), 4)


def dtype_of(model: nn.Module) -> str:
    """The dtype the model's floating weights run in."""
    return next((str(v.dtype) for _, v in tree_flatten(model.parameters())
                 if mx.issubdtype(v.dtype, mx.floating)), "")


def identity_of(path: Optional[str], model: Optional[nn.Module],
                kv: Optional[QuantizedKV] = None) -> str:
    """The model's `model_identity` for its disk tier, "" when there is none to give
    (no model, or a hub id whose files are not found locally). Quantized KV is part of
    it: an engine never reads another setting's files."""
    if path is None or model is None:
        return ""
    dtype = dtype_of(model)
    if kv is not None:
        dtype = f"{dtype}:kv{kv.bits}g{kv.group_size}s{kv.start}"
    try:
        return model_identity(path, dtype)
    except (OSError, ValueError, ImportError) as error:
        logger.warning("no prefix cache on disk for %s: its files are not found (%r)", path,
                       error)
        return ""


DEMO_VERDICT = DraftVerdict(None, "not checked: the bundled demo pair, trained together "
                                  "(its probe's measurement: docs/how-it-works.md, 'The draft "
                                  "check')")


def _pair_identity(path: str, model: nn.Module) -> str:
    """`model_identity`, else (a hub id whose files are not found locally) its name."""
    try:
        return model_identity(path, dtype_of(model))
    except (OSError, ValueError, ImportError):
        return f"{path}:{dtype_of(model)}"


def make_draft_check(model_path: str, draft_path: str, model: nn.Module, draft: nn.Module,
                config: EngineConfig, sharded: bool) -> DraftCheck:
    """What the engine knows of its draft before any probe: a verdict that needs none
    (the draft is the target; the bundled demo pair; the check turned off; a sharded
    target, whose forward needs every rank), else the probe's saved measurement, if any."""
    settings = dict(n_lookahead=config.n_lookahead, n_window=config.n_window,
                    pool_kernel=config.pool_kernel, chunk_size=config.chunk_size,
                    tail_tokens=config.tail_tokens, backbone_pct=config.backbone_pct,
                    spread=config.spread)
    fixed = None
    if model_path == draft_path:
        fixed = DraftVerdict(True, "the draft is the target")
    elif (model_path, draft_path) == (str(DEMO_TARGET), str(DEMO_DRAFT)):
        fixed = DEMO_VERDICT
    elif config.draft_check == "off":
        fixed = DraftVerdict(None, "not checked (draft_check='off')")
    elif sharded:
        fixed = DraftVerdict(None, "not checked: the target is sharded (the probe would run "
                                   "it on rank 0 alone)")
    key = {} if fixed is not None else {"target": _pair_identity(model_path, model),
                                        "draft": _pair_identity(draft_path, draft),
                                        "settings": settings,
                                        "units": "blocks, the tail from a block"}
    return DraftCheck(key, settings, config.keep, fixed, (draft_path, model_path))


def load_target(model_path: str, dtype, group) -> tuple:
    """The target (this rank's shard with a group) and what every rank learns of it
    by running it: the same probe forwards, in the same order, on every rank. With a
    group the ranks first agree that every one of them loaded, so a rank that failed
    never leaves the others waiting inside a probe's collectives."""
    model = tokenizer = None
    try:
        model, tokenizer = load_model(model_path, dtype=dtype, group=group)
    finally:
        if group is not None:
            failed = agree(group, model is None)
            if failed and model is not None:
                raise ModelLoadError(f"{failed} of {group.size()} ranks failed to load the target")
    return model, tokenizer, batching_support(model), kv_bytes_per_token(model)


def load_runtime(model_path: str, draft_path: Optional[str], config: EngineConfig,
                 dtype="auto", group=None) -> Runtime:
    """Load on the calling thread, which must be the engine's worker.

    Paths are already resolved; without a draft every request prefills densely.
    With a distributed group this is rank 0: the target's shard, then the draft,
    which only rank 0 holds.
    """
    if mx.default_device() == mx.cpu and blas_status().startswith("mlx.core was imported first"):
        logger.warning("MLX runs on its reference BLAS (far slower on a CPU): import "
                       "specprefill_engine before mlx or mlx_lm to load an optimized one")
    device = device_memory() if config.kv_cache_bytes is None else (0, "")  # before the weights
    if config.step_size is None:
        config = replace(config, step_size=default_step_size())
    if config.draft_step_size is None:
        config = replace(config, draft_step_size=default_draft_step_size())
    model, tokenizer, batch_reason, kv_bytes = load_target(model_path, dtype, group)
    channel = Channel(group) if group is not None else None
    scorer = draft = None
    try:
        kv = quantized_kv_of(config, model, group)
        if kv is not None and not batch_reason:  # as mlx_lm.server: no batch with kv_bits
            batch_reason = (f"kv_bits={kv.bits}: mlx-lm has no batched quantized KV cache, "
                            "so each request decodes in its own forward")
        if draft_path is not None:
            draft, draft_tokenizer = load_model(draft_path, dtype=dtype)
            check_same_tokenizer(tokenizer, draft_tokenizer)
            scorer = DraftScorer(draft, config.n_lookahead, config.pool_kernel,
                                 config.draft_step_size, n_window=config.n_window)
        refused = speculative_support(model, draft, group)
        if config.num_draft_tokens and refused:
            raise ValueError(f"num_draft_tokens={config.num_draft_tokens}: speculative "
                             f"decoding cannot run here: {refused}")
        if config.num_draft_tokens and mx.default_device() == mx.gpu \
                and not mx.metal.is_available():
            logger.warning("num_draft_tokens: speculative decoding was measured slower than "
                           "plain decoding on a CUDA GPU (docs/benchmarks.md, 'Speculative "
                           "decoding with the SpecPrefill draft')")
    except BaseException:
        if channel is not None:
            channel.post(TurnPlan(shutdown=True))  # the other ranks wait for plans: release them
        raise
    costs = cost_model(model, draft, (model_path, draft_path, dtype, group.size() if group else 1))
    vouch = None
    if draft is not None:
        vouch = make_draft_check(model_path, draft_path, model, draft, config, group is not None)
        if config.draft_check == "load" and vouch.pending:
            vouch.run(model, draft, tokenizer)
    rates = KVRates(kv_bytes, kv_bytes_per_token(draft) if draft is not None else 0,
                    itemsize_of(model), kv)
    memory = memory_budget(config.kv_cache_bytes, device, weights_bytes(model, draft))
    identities = ("", "")
    if config.prefix_cache_disk_bytes and group is None:  # a shard's KV is its rank's alone
        identities = (identity_of(model_path, model, kv), identity_of(draft_path, draft))
    return Runtime(model, tokenizer, scorer, config, context_length_of(model), batch_reason,
                   kv_bytes, vocab_size_of(model, tokenizer), costs,
                   checkpointed=checkpointed(model), group=group,
                   channel=channel, identities=identities, vouch=vouch,
                   speculative_reason=refused,
                   words=TokenWords(tokenizer) if draft is not None and config.match_weight
                   else None, blank_lines=BlankLines(tokenizer) if draft is not None else None,
                   kv=kv, memory=memory, rates=rates)
