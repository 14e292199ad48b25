"""The async API: `Engine.generate`, `Engine.stream`, `Engine.abort`, and a sync facade.

Callers in any thread or event loop submit requests; the worker thread (see
`worker.py`) does the MLX work and sends each event back through the caller's
own loop (through that loop's mailbox, `delivery.py`: a batched decode step of N streams
wakes the loop once) or, for sync callers, a plain queue. Tokenizing and chat
templating run off the event loop, in a thread of asyncio's pool.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import fields, replace
from typing import AsyncIterator, Callable, Iterator, Optional, Union

import numpy as np

from ..loading import DEMO_DRAFT, DEMO_TARGET, resolve_dtype, resolve_model_path
from ..chat.render import Rendered, check_text, render_chat
from .delivery import Mailbox
from .memory import MemoryBudgetError, need_message, reservation
from .output import OutputProcessor
from .results import Chunk, Progress, Result
from .distributed import distributed_group
from .follower import FollowerWorker
from .runtime import EngineConfig, EngineInfo, load_runtime, load_target
from .options import RequestOptions
from .sampling import check_keywords
from .worker import Worker
from .state import RequestState

logger = logging.getLogger(__name__)
Prompt = Union[str, list, Rendered]
_ids = itertools.count()


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int, tools: Optional[list] = None,
                    chat_template_kwargs: Optional[dict] = None, chat: bool = False,
                    render: Callable = render_chat) -> tuple:
    """A string, chat messages ({"role", "content"} dicts), a `Rendered` chat, or token
    ids -> (ids, the Rendered chat or None). A chat's template is rendered once, by
    `render(messages, tools, chat_template_kwargs)` (`Engine.render`: with the engine's
    caps). A string is raw text, as mlx-lm takes it; with `chat` it is one user message,
    sent through the chat template."""
    rendered = None
    if chat and isinstance(prompt, str) and prompt:
        prompt = [{"role": "user", "content": prompt}]
    elif chat and isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
        raise ValueError("chat=True applies to a string prompt; token ids are sent as they are")
    if isinstance(prompt, Rendered):
        if tools is not None or chat_template_kwargs is not None:
            raise ValueError("a Rendered prompt holds its tools and chat_template_kwargs; "
                             "pass them to render_chat, not to the request")
        rendered = prompt
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(check_text(prompt, "prompt"))
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        rendered = render(list(prompt), tools, chat_template_kwargs)
    elif isinstance(prompt, (list, tuple)) and prompt and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        if any(t < 0 or t >= vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    elif isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    else:
        raise TypeError(
            "prompt must be a string, a list of chat messages, a Rendered chat, or a list of "
            f"token ids; got {type(prompt).__name__}"
        )
    if rendered is not None:
        ids = rendered.tokens
    if len(ids) == 0:
        raise ValueError("prompt is empty after tokenization")
    return np.asarray(ids, dtype=np.int32), rendered


def _stop_worker(worker: Worker, timeout: float) -> None:
    """Stop and join a worker; also run at interpreter exit or when the Engine is
    collected, so no MLX work is cut off mid-call (which aborts the process)."""
    worker.stop()
    if worker.thread.is_alive():
        worker.thread.join(timeout)


class Engine:
    """SpecPrefill serving engine; all MLX work runs on one worker thread.

    `model` and `draft` are local paths or Hugging Face ids; with neither given,
    the bundled demo pair is used. With a `model` but no `draft`, requests prefill
    densely. Models load on the worker when the engine starts (`async with`,
    `await engine.start()`, or the first request). `dtype`: "auto" (float32 on a
    CPU, the stored dtype on a GPU), None (stored), "float32", "bfloat16", "float16"
    or the `mx` dtype. Settings are `EngineConfig` fields (e.g. `max_batch_size`,
    `kv_cache_bytes`, `step_size`, `system_message_cap`).

    A string prompt is raw text, sent without the chat template (mlx-lm's
    convention: a completion prompt); pass `chat=True` to a request to send it as one
    user message through the template, or pass chat messages.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        draft: Optional[str] = None,
        *,
        dtype="auto",
        **config,
    ):
        check_keywords("Engine()", config, CONFIG_KEYWORDS)
        self.config = EngineConfig(**config)
        self._keep_given = "keep" in config
        dtype = resolve_dtype(dtype)
        self.model_path = resolve_model_path(model, DEMO_TARGET)
        use_draft = draft is not None or model is None
        self.draft_path = resolve_model_path(draft, DEMO_DRAFT) if use_draft else None
        paths, settings = (self.model_path, self.draft_path), self.config
        group = distributed_group()  # under mlx.launch: the target is sharded over it
        self.rank = group.rank() if group is not None else 0
        self.ranks = group.size() if group is not None else 1
        if self.rank:
            target = self.model_path
            self._worker = FollowerWorker(lambda: load_target(target, dtype, group)[0], group,
                                             settings.prefix_cache_bytes)
        else:
            self._worker = Worker(lambda: load_runtime(*paths, settings, dtype, group))
        self._start_lock = threading.Lock()
        self._started = False
        self._mailboxes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._finalizer = weakref.finalize(self, _stop_worker, self._worker, 30.0)

    # lifecycle -----------------------------------------------------------------

    def _ensure_started(self):
        with self._start_lock:
            self._worker.check_open()
            if not self._started:
                self._worker.thread.start()
                self._started = True
        return self._worker.ready

    async def start(self) -> "Engine":
        """Load the models. On a rank > 0 of a distributed engine this serves rank 0
        until it shuts down, then exits the process (SystemExit(0))."""
        # the ready future cannot be cancelled: a caller's cancellation ends its own wait only
        await asyncio.wrap_future(self._ensure_started())
        if self.rank:
            await asyncio.wrap_future(self._worker.done)
            self._follower_exit()
        return self

    def start_sync(self) -> "Engine":
        self._ensure_started().result()
        if self.rank:
            self._worker.done.result()
            self._follower_exit()
        return self

    def _follower_exit(self) -> None:
        logger.info("rank %d: rank 0 shut down; exiting", self.rank)
        self._worker.thread.join()  # it frees its MLX state; exiting mid-call aborts
        self._finalizer.detach()
        raise SystemExit(0)

    @property
    def info(self) -> EngineInfo:
        """Tokenizer, context length, batching support, the draft check's verdict at the
        engine's keep (`draft`, a `DraftVerdict`; None without a draft) (blocks until
        loaded; still readable after shutdown)."""
        if self.rank:
            self.start_sync()  # a follower serves, then exits: it has no info to give
        info = (self._worker.ready if self._started else self._ensure_started()).result()
        check = self._worker.vouch
        return info if check is None else replace(info, draft=check.verdict(self.config.keep))

    def stats(self) -> dict:
        """What the engine has done in the background: `densify` (a `DensifyStats`:
        turns densified, tokens computed, seconds spent, turns pending), `memory` (a
        `memory.MemoryStats`: the KV budget and where it came from, what is held now:
        each running request's reservation, target and draft, and each prefix cache,
        cache entries dropped to make room)
        and, with a
        prefix cache on disk (`prefix_cache_disk_bytes`), `disk` (a `DiskStats`: files
        written and read, their bytes and seconds, reads skipped as slower than
        prefilling, broken files ignored, why the tier is off)."""
        if self.rank:
            return {}
        stats = {"densify": replace(self._worker.scheduler.densify_stats)}
        if self._worker.scheduler.memory_stats is not None:
            stats["memory"] = self._worker.scheduler.memory_stats
        if self._worker.disk_stats is not None:
            stats["disk"] = replace(self._worker.disk_stats)
        return stats

    @property
    def tokenizer(self):
        """The target's tokenizer (mlx-lm TokenizerWrapper); safe to use from any thread."""
        return self.info.tokenizer

    def render(self, messages: list, tools: Optional[list] = None,
               chat_template_kwargs: Optional[dict] = None) -> Rendered:
        """Render a chat as this engine's requests do (the target's template, the
        engine's `recent_message_cap` and `system_message_cap`); the result is a prompt
        (`engine.generate(rendered)`). Blocks until the models are loaded."""
        return render_chat(self.tokenizer, messages, tools, chat_template_kwargs,
                           recent_cap=self.config.recent_message_cap,
                           system_cap=self.config.system_message_cap)

    def shutdown_sync(self, timeout: float = 30.0) -> None:
        """Abort in-flight and queued requests (they end with finish_reason "abort"),
        stop the worker, which frees the models on its own thread."""
        with self._start_lock:
            started = self._started
            self._worker.stop()
        if started:
            self._finalizer.detach()
            _stop_worker(self._worker, timeout)

    async def shutdown(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self.shutdown_sync, timeout)

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def __enter__(self) -> "Engine":
        return self.start_sync()

    def __exit__(self, *exc) -> None:
        self.shutdown_sync()

    # requests ------------------------------------------------------------------

    def health(self) -> Optional[str]:
        """Why the engine cannot serve (it failed, or it is shut down), or None."""
        failure = self._worker.failure
        if failure is not None:
            return f"the engine failed: {failure!r}"
        if self._worker.closed:
            return "the engine is shut down"
        return None

    @property
    def active_request_ids(self) -> list:
        """Ids of the requests submitted and not yet finished (queued ones included)."""
        return self._worker.active_ids()

    def abort(self, request_id: str) -> bool:
        """Ask the worker to stop a request; it ends with finish_reason 'abort'."""
        state = self._worker.find(request_id)
        if state is not None:
            state.cancelled.set()
        return state is not None

    def _prepare(self, prompt: Prompt, emit: Callable, stream: bool,
                 options: RequestOptions) -> RequestState:
        """Tokenize on the caller's side (the options are checked already); the worker
        gets a ready state."""
        called = time.perf_counter()
        info = self.info
        params = options.sampling
        if params.top_k >= info.vocab_size:  # mlx-lm's top-k filter needs fewer
            raise ValueError(f"top_k must be below the vocabulary size ({info.vocab_size}; 0 "
                             f"turns it off), got {params.top_k}")
        specprefill, keep, threshold = options.specprefill, options.keep, options.threshold
        response_format, clamp_max_tokens = options.response_format, options.clamp_max_tokens
        tokens, rendered = tokenize_prompt(prompt, info.tokenizer, info.vocab_size, options.tools,
                                           options.chat_template_kwargs, options.chat,
                                           self.render)
        max_tokens, warnings = params.max_tokens, []
        if info.context_length:
            room = info.context_length - tokens.size
            if room < 1:
                raise ValueError(f"prompt is {tokens.size} tokens, longer than the model's "
                                 f"context of {info.context_length} (no room to generate)")
            if max_tokens > room and not clamp_max_tokens:
                raise ValueError(f"prompt is {tokens.size} tokens and max_tokens is {max_tokens}: "
                                 f"together more than the model's context of "
                                 f"{info.context_length}")
            if max_tokens > room:
                warnings.append(f"max_tokens clamped from {max_tokens} to {room}: prompt "
                                f"{tokens.size} + max_tokens must fit the context of "
                                f"{info.context_length}")
                max_tokens = room
        constraint = None
        if response_format is not None:  # compiled here: a bad schema fails this call only
            from ..chat.constrained import make_constraint, resolve_response_format

            response_format = resolve_response_format(
                response_format, info.tokenizer, rendered.think if rendered else None, max_tokens)
            constraint = make_constraint(info.tokenizer, response_format)
        num_draft_tokens = self.config.num_draft_tokens if options.num_draft_tokens is None \
            else options.num_draft_tokens
        if info.memory is not None:  # refused here, before it is queued: one that cannot fit
            # even alone (the worker checks again at admission)
            draft = self.draft_path is not None
            need = reservation(info.rates, tokens.size, tokens.size, max_tokens,
                               draft and specprefill is not False, draft and num_draft_tokens > 0)
            if need.total > info.memory.budget:
                raise MemoryBudgetError(need_message(
                    need, info.memory, f"{tokens.size} prompt tokens + max_tokens {max_tokens}"))
        protected = None
        if specprefill is not False and self.draft_path is not None and rendered is not None:
            protected = rendered.protected
        request_id = options.request_id or f"req-{next(_ids)}"
        logger.debug("request %s: %d prompt tokens, max_tokens %d", request_id, tokens.size,
                     max_tokens)
        output = OutputProcessor(request_id, params, max_tokens, info.tokenizer, stream, emit)
        boundaries = () if rendered is None else tuple(sorted({
            start for start in (*rendered.message_starts, rendered.generation_start)
            if start is not None and 0 < start < tokens.size}))
        return RequestState(
            request_id, tokens, params, emit, called=called,
            keep=self.config.keep if keep is None else keep,
            threshold=self.config.threshold if threshold is None else threshold,
            max_tokens=max_tokens, output=output, specprefill=specprefill, stream=stream,
            progress=options.on_progress is not None, constraint=constraint,
            logits_processors=list(options.logits_processors), cache_prompt=options.cache_prompt,
            num_draft_tokens=num_draft_tokens,
            protected=protected, warnings=warnings, boundaries=boundaries,
            question=None if rendered is None else rendered.question,
            keep_given=keep is not None or self._keep_given,
        )

    @staticmethod
    def _receive(event, on_progress):
        """The event for the caller, None for progress; raises a worker-side error."""
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, Progress):
            on_progress(event)
            return None
        return event

    async def _events(self, prompt: Prompt, stream: bool,
                      options: RequestOptions) -> AsyncIterator:
        await self.start()
        loop = asyncio.get_running_loop()
        with self._start_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = Mailbox(loop)
        events: asyncio.Queue = asyncio.Queue()
        state: Optional[RequestState] = None

        def emit(event):
            if not mailbox.post(events, event) and state is not None:
                state.cancelled.set()  # the caller's loop is gone: stop working for it

        state = await asyncio.to_thread(self._prepare, prompt, emit, stream, options)
        self._worker.submit(state)
        try:
            while True:
                event = self._receive(await events.get(), options.on_progress)
                if event is not None:
                    yield event
                    if isinstance(event, Result):
                        return
        finally:
            state.cancelled.set()  # a no-op once it has finished

    async def generate(self, prompt: Prompt, **kwargs) -> Result:
        """Run a request to the end. Cancelling the awaiting task aborts it.

        `prompt`: a string (raw text, no chat template), chat messages, a chat rendered
        by `chat.render_chat`, or token ids. Keyword arguments: `chat` (True: a string
        prompt is one user message, sent through the chat template), the SamplingParams
        fields (max_tokens, temperature, top_p, top_k (below the vocabulary size),
        min_p, repetition_penalty, seed, stop, stop_token_ids, logprobs: k in [0, 20] puts
        each token's TokenLogprob, with the k likeliest alternatives, in `Result.logprobs`
        and the chunks' `logprobs`), `specprefill`
        (None: engine policy), `keep`, `threshold`, `tools` and `chat_template_kwargs`
        (passed to the chat template), `response_format` (constrained decoding, see
        `chat/constrained.py`), `logits_processors` (callables `(generated, logits) -> logits`,
        mlx-lm's convention, for this request only), `cache_prompt` (False: neither
        read nor fill the prefix cache), `clamp_max_tokens` (False: a max_tokens past
        the context raises ValueError instead of being clamped, as HTTP APIs answer),
        `num_draft_tokens` (speculative decoding for this request; None: the engine's),
        `request_id`, and `on_progress(Progress)`. An unknown keyword is a TypeError
        that names the nearest valid one.
        """
        events = self._events(prompt, False, RequestOptions.of("Engine.generate()", kwargs))
        try:
            async for event in events:
                if isinstance(event, Result):
                    return event
        finally:
            await events.aclose()
        raise RuntimeError("request ended without a result")

    async def stream(self, prompt: Prompt, **kwargs) -> AsyncIterator[Chunk]:
        """Yield text chunks; the last carries finish_reason, usage and timings.

        Leaving the loop early (break, aclose, cancellation, timeout) aborts the request.
        Takes `generate`'s arguments.
        """
        events = self._events(prompt, True, RequestOptions.of("Engine.stream()", kwargs))
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    yield event
        finally:
            await events.aclose()

    # sync facade ---------------------------------------------------------------

    def _sync_events(self, prompt: Prompt, stream: bool, options: RequestOptions) -> Iterator:
        self.start_sync()
        events: "queue.Queue" = queue.Queue()
        state = self._prepare(prompt, events.put, stream, options)
        self._worker.submit(state)
        try:
            while True:
                event = self._receive(_next_event(events), options.on_progress)
                if event is not None:
                    yield event
                    if isinstance(event, Result):
                        return
        finally:
            state.cancelled.set()

    def generate_sync(self, prompt: Prompt, **kwargs) -> Result:
        """`generate` from synchronous code (blocks this thread)."""
        options = RequestOptions.of("Engine.generate_sync()", kwargs)
        for event in self._sync_events(prompt, False, options):
            if isinstance(event, Result):
                return event
        raise RuntimeError("request ended without a result")

    def stream_sync(self, prompt: Prompt, **kwargs) -> Iterator[Chunk]:
        """`stream` from synchronous code: iterate it; leaving early aborts the request."""
        events = self._sync_events(prompt, True, RequestOptions.of("Engine.stream_sync()", kwargs))
        try:
            for event in events:
                if isinstance(event, Chunk):
                    yield event
        finally:
            events.close()


WAKE_SECONDS = 0.1  # how often a blocking call's caller wakes (`_next_event`)


def _next_event(events: "queue.Queue"):
    """The next event, waking every `WAKE_SECONDS`: Python runs a signal's handler (Ctrl-C's
    KeyboardInterrupt) only in the main thread, when it runs, and a signal delivered to
    another thread (the worker, a BLAS thread) does not end a wait without a timeout."""
    while True:
        try:
            return events.get(timeout=WAKE_SECONDS)
        except queue.Empty:
            continue


# the keywords Engine() takes
CONFIG_KEYWORDS = frozenset(["model", "draft", "dtype"] + [f.name for f in fields(EngineConfig)])
