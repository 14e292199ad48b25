"""What a request gives back: stream chunks and the final result."""

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the likeliest alternatives, (token id,
    logprob) most likely first: log_softmax of the model's logits at that step, before
    logits processors, penalties and temperature."""

    token: int
    logprob: float
    top: list = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # target KV entries reused from the prefix cache
    draft_cached_tokens: int = 0  # prompt tokens the draft did not have to prefill


@dataclass
class Timings:
    """Seconds. `prepare`: the caller's side (validating, the chat template, tokenizing);
    `queue_wait`, `scoring` and `prefill` on the worker; `time_to_first_token` from the
    call, as the caller waits for it (prepare included); decode_tokens_per_s excludes the
    first token."""

    prepare: float = 0.0
    queue_wait: float = 0.0
    scoring: float = 0.0
    prefill: float = 0.0
    time_to_first_token: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass
class SpecPrefillReport:
    """Whether SpecPrefill ran and why; whether the request decoded in the shared batch,
    and whether its draft proposed its reply."""

    engaged: bool = False
    reason: str = ""
    kept_tokens: int = 0
    total_tokens: int = 0
    keep: float = 1.0
    batched: bool = False
    batch_reason: str = ""
    reuse: str = "none"  # what the prefix cache gave: dense or sparse prefix, or why not
    selection_digest: str = ""  # a hash of the kept positions: equal digests, equal selections
    predicted_dense_s: float = 0.0  # the automatic policy's predictions (specprefill=None)
    predicted_specprefill_s: float = 0.0
    # speculative decoding (`num_draft_tokens`): why the reply was or was not drafted
    # ("" with the option off), and the draft's tokens proposed and taken
    speculative: str = ""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # KV memory the request held at its end (bytes): the target's entries (the kept ones
    # for a SpecPrefill request, quantized with kv_bits), the same prompt and reply's
    # target KV held densely, and the draft's while it scored (and proposed the reply)
    kv_bytes: int = 0
    dense_kv_bytes: int = 0
    draft_kv_bytes: int = 0


@dataclass
class Progress:
    """A long phase's progress, in tokens: phase is "scoring" (prompt tokens through the
    draft, of the prompt), "draft prefill" (the same, for a dense prompt whose reply the
    draft will propose) or "prefill" (tokens through the target, of those it computes)."""

    phase: str
    done: int
    total: int


@dataclass
class Chunk:
    """One piece of a stream. Usage, timings, the report and the warnings come on the
    last only."""

    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    timings: Optional[Timings] = None
    specprefill: Optional[SpecPrefillReport] = None
    request_id: str = ""
    warnings: list = field(default_factory=list)
    """As `Result.warnings`, on the last chunk."""
    logprobs: Optional[list] = None
    """With `logprobs` asked: a TokenLogprob per token since the previous chunk (the last
    chunk carries those whose text a stop string held back)."""


@dataclass
class Result:
    text: str
    token_ids: list
    finish_reason: str
    usage: Usage
    timings: Timings
    specprefill: SpecPrefillReport
    request_id: str = ""
    warnings: list = field(default_factory=list)
    """What the engine changed about the request, e.g. a max_tokens clamped to the context."""
    logprobs: Optional[list] = None  # with `logprobs` asked: a TokenLogprob per token_ids entry
