"""A request's options: one dataclass, defined and validated here.

`Engine.generate` and its siblings take them as keywords (`RequestOptions.of`), the
CLI, the server and the LangChain model build one from their own settings the same
way, so a bad value is one error, naming its parameter, wherever it came from. The
sampling options are `SamplingParams` (`sampling.py`), held whole in `sampling`.
"""

from dataclasses import dataclass, field, fields
from typing import Callable, Optional

from .runtime import check_count, check_draft_tokens, check_keep
from .sampling import SamplingParams, check_keywords


@dataclass(frozen=True)
class RequestOptions:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    specprefill: Optional[bool] = None  # None: the engine's policy decides
    keep: Optional[float] = None  # None: the engine's
    threshold: Optional[int] = None  # None: the engine's
    tools: Optional[list] = None  # tool schemas, to the chat template
    chat_template_kwargs: Optional[dict] = None
    chat: bool = False  # a string prompt is one user message, through the chat template
    response_format: Optional[dict] = None  # constrained decoding (`chat/constrained.py`)
    logits_processors: tuple = ()  # `(generated, logits) -> logits`, mlx-lm's convention
    cache_prompt: bool = True  # False: neither read nor fill the prefix cache
    clamp_max_tokens: bool = True  # False: max_tokens past the context is a ValueError
    num_draft_tokens: Optional[int] = None  # speculative decoding; None: the engine's
    request_id: Optional[str] = None
    on_progress: Optional[Callable] = None

    def __post_init__(self):
        if self.specprefill not in (None, True, False):
            raise TypeError(f"specprefill must be None, True or False, got {self.specprefill!r}")
        if self.keep is not None:
            check_keep(self.keep)
        if self.threshold is not None:
            check_count(self.threshold, "threshold")
        tools = self.tools
        if tools is not None and not (isinstance(tools, (list, tuple))
                                      and all(isinstance(t, dict) for t in tools)):
            raise TypeError("tools must be a list of tool schemas (dicts)")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs,
                                                                    dict):
            raise TypeError("chat_template_kwargs must be a dict")
        for name in ("chat", "cache_prompt", "clamp_max_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        processors = self.logits_processors
        if not isinstance(processors, (list, tuple)) or not all(callable(p) for p in processors):
            raise TypeError("logits_processors must be a list of callables "
                            "(generated tokens, logits) -> logits")
        object.__setattr__(self, "logits_processors", tuple(processors))
        if self.num_draft_tokens is not None:
            check_draft_tokens(self.num_draft_tokens)
        if self.request_id is not None and not (isinstance(self.request_id, str)
                                                and self.request_id):
            raise TypeError("request_id must be a non-empty string")
        if self.on_progress is not None and not callable(self.on_progress):
            raise TypeError("on_progress must be callable")
        if self.response_format is not None:
            from ..chat.constrained import check_response_format

            object.__setattr__(self, "response_format",
                               check_response_format(self.response_format))

    @classmethod
    def of(cls, method: str, options: dict) -> "RequestOptions":
        """From keywords (`method`, e.g. "Engine.generate()", names the caller in a
        TypeError for an unknown one, with the nearest valid name); a missing or None
        `logits_processors` is none."""
        check_keywords(method, options, KEYWORDS)
        sampling = {k: v for k, v in options.items() if k in SAMPLING}
        own = {k: v for k, v in options.items() if k not in SAMPLING}
        if own.get("logits_processors", ()) is None:
            own["logits_processors"] = ()
        return cls(SamplingParams(**sampling), **own)


SAMPLING = frozenset(f.name for f in fields(SamplingParams))
KEYWORDS = SAMPLING | {f.name for f in fields(RequestOptions) if f.name != "sampling"}
