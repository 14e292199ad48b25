"""The async API: `Engine.generate`, `Engine.stream`, `Engine.abort`, and a sync facade.

Callers in any thread or event loop submit requests; the worker thread does the
MLX work and sends each event back through the caller's own loop
(`call_soon_threadsafe`) or, for sync callers, a plain queue.
"""

import asyncio
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Optional, Union

import numpy as np

from ..loading import DEMO_DRAFT, DEMO_TARGET, resolve_model_path
from .request import Request
from .results import Chunk, Progress, Result
from .runtime import EngineConfig, Runtime, load_runtime
from .sampling import SamplingParams
from .worker import Worker

Prompt = Union[str, list]
_ids = itertools.count()


def _prompt_tokens(prompt: Prompt, tokenizer, tools: Optional[list] = None) -> np.ndarray:
    """A string, chat messages ({"role", "content"} dicts), or token ids -> ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for message in prompt:
            if "role" not in message or "content" not in message:
                raise ValueError("each chat message needs 'role' and 'content'")
        kwargs = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, **kwargs)
    elif isinstance(prompt, (list, tuple)) and prompt and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        vocab = getattr(tokenizer, "vocab_size", None)
        if any(t < 0 or (vocab and t >= vocab) for t in ids):
            raise ValueError("token ids must be in [0, vocab_size)")
    elif isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    else:
        raise TypeError(
            "prompt must be a string, a list of chat messages, or a list of token ids; "
            f"got {type(prompt).__name__}"
        )
    if len(ids) == 0:
        raise ValueError("prompt is empty after tokenization")
    return np.asarray(ids, dtype=np.int32)


class _Subscription:
    """A caller's view of one request's events, shared by the async and sync APIs."""

    def __init__(self, engine: "Engine", request: Request, on_progress: Optional[Callable]):
        self.engine, self.request, self.on_progress = engine, request, on_progress
        self.finished = False

    def take(self, event):
        """The event for the caller, None for progress; raises a worker-side error."""
        if isinstance(event, BaseException):
            self.finished = True
            raise event
        if isinstance(event, Progress):
            self.on_progress(event)
            return None
        self.finished = isinstance(event, Result)
        return event

    def close(self) -> None:
        """Abort the request unless it finished; forget it either way."""
        if not self.finished:
            self.request.cancelled.set()
        self.engine._requests.pop(self.request.id, None)


class Engine:
    """SpecPrefill serving engine; all MLX work runs on one worker thread.

    `model` and `draft` are local paths or Hugging Face ids; with neither given,
    the bundled demo pair is used. With a `model` but no `draft`, requests prefill
    densely. Models load on the worker when the engine starts (`async with`,
    `await engine.start()`, or the first request).
    """

    def __init__(
        self,
        model: Optional[str] = None,
        draft: Optional[str] = None,
        *,
        keep: float = 0.3,
        threshold: int = 1024,
        dtype="auto",
        **config,
    ):
        self.config = EngineConfig(keep=keep, threshold=threshold, **config)
        self.model_path = resolve_model_path(model, DEMO_TARGET)
        use_draft = draft is not None or model is None
        self.draft_path = resolve_model_path(draft, DEMO_DRAFT) if use_draft else None
        self._worker = Worker(
            lambda: load_runtime(self.model_path, self.draft_path, self.config, dtype)
        )
        self._start_lock = threading.Lock()
        self._started = False
        self._closed = False
        self._requests: dict = {}

    # lifecycle -----------------------------------------------------------------

    def _ensure_started(self):
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if not self._started:
                self._worker.start()
                self._started = True
        return self._worker.ready

    async def start(self) -> "Engine":
        await asyncio.wrap_future(self._ensure_started())
        return self

    def start_sync(self) -> "Engine":
        self._ensure_started().result()
        return self

    @property
    def runtime(self) -> Runtime:
        """The loaded models (valid once started); the tokenizer is safe to use anywhere."""
        return self._ensure_started().result()

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    def shutdown_sync(self, timeout: float = 30.0) -> None:
        with self._start_lock:
            self._closed = True
            started = self._started
        for request in list(self._requests.values()):
            request.cancelled.set()
        if started:
            self._worker.stop()
            self._worker.thread.join(timeout)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort in-flight requests and stop the worker thread."""
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

    @property
    def active_request_ids(self) -> list:
        """Ids of the requests the worker is working on now (queued ones not counted)."""
        return [request.id for request, _ in list(self._worker.active)]

    def abort(self, request_id: str) -> bool:
        """Ask the worker to stop a request; it ends with finish_reason 'abort'."""
        request = self._requests.get(request_id)
        if request is not None:
            request.cancelled.set()
        return request is not None

    def _submit(self, prompt: Prompt, emit: Callable, stream: bool, *, specprefill=None,
                keep=None, tools=None, request_id=None, on_progress=None,
                **sampling) -> Request:
        runtime = self.runtime
        params = SamplingParams(**sampling)
        if specprefill not in (None, True, False):
            raise TypeError("specprefill must be None, True or False")
        if keep is not None and not (isinstance(keep, (int, float)) and 0 < keep <= 1):
            raise ValueError(f"keep must be in (0, 1], got {keep!r}")
        tokens = _prompt_tokens(prompt, runtime.tokenizer, tools)
        if runtime.context_length and tokens.size > runtime.context_length:
            raise ValueError(
                f"prompt is {tokens.size} tokens, longer than the model's context of "
                f"{runtime.context_length}"
            )
        request_id = request_id or f"req-{next(_ids)}"
        if on_progress is not None and not callable(on_progress):
            raise TypeError("on_progress must be callable")
        request = Request(request_id, tokens, params, emit, specprefill, keep, stream,
                          progress=on_progress is not None, submitted=time.perf_counter())
        self._requests[request_id] = request
        self._worker.submit(request)
        return request

    async def _events(self, prompt: Prompt, stream: bool, kwargs: dict) -> AsyncIterator:
        await self.start()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the caller's loop is gone: stop working for it
                request.cancelled.set()

        request = self._submit(prompt, emit, stream, **kwargs)
        subscription = _Subscription(self, request, kwargs.get("on_progress"))
        try:
            while not subscription.finished:
                event = subscription.take(await events.get())
                if event is not None:
                    yield event
        finally:
            subscription.close()

    async def generate(self, prompt: Prompt, **kwargs) -> Result:
        """Run a request to the end. Cancelling the awaiting task aborts it.

        Keyword arguments: the SamplingParams fields (max_tokens, temperature, top_p,
        top_k, min_p, repetition_penalty, seed, stop, stop_token_ids), `specprefill`
        (None: engine policy), `keep`, `tools` (passed to the chat template),
        `request_id`, and `on_progress(Progress)` for the scoring and prefill phases.
        """
        events = self._events(prompt, False, kwargs)
        try:
            async for event in events:
                if isinstance(event, Result):
                    return event
        finally:
            await events.aclose()

    async def stream(self, prompt: Prompt, **kwargs) -> AsyncIterator[Chunk]:
        """Yield text chunks; the last carries finish_reason, usage and timings.

        Leaving the loop early (break, aclose, cancellation, timeout) aborts the request.
        """
        events = self._events(prompt, True, kwargs)
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    yield event
        finally:
            await events.aclose()

    # sync facade ---------------------------------------------------------------

    def _sync_events(self, prompt: Prompt, stream: bool, kwargs: dict) -> Iterator:
        self.start_sync()
        events: "queue.Queue" = queue.Queue()
        request = self._submit(prompt, events.put, stream, **kwargs)
        subscription = _Subscription(self, request, kwargs.get("on_progress"))
        try:
            while not subscription.finished:
                event = subscription.take(events.get())
                if event is not None:
                    yield event
        finally:
            subscription.close()

    def generate_sync(self, prompt: Prompt, **kwargs) -> Result:
        for event in self._sync_events(prompt, False, kwargs):
            if isinstance(event, Result):
                return event
        raise RuntimeError("request ended without a result")

    def stream_sync(self, prompt: Prompt, **kwargs) -> Iterator[Chunk]:
        events = self._sync_events(prompt, True, kwargs)
        try:
            for event in events:
                if isinstance(event, Chunk):
                    yield event
        finally:
            events.close()
