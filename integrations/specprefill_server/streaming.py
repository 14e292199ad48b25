"""Requests in flight: admission (overload, drain), keep-alives before the first token,
client disconnects, and the SSE response.

A streamed response's status is decided by its first event: a request the engine
refuses (a bad value, a prompt too long) gets the API's JSON error with a 4xx, not a
200 stream. Headers go out once the engine has taken the request (it is among
`engine.active_request_ids`, or its prefill reported progress), or with the first
token. A client that goes away (ASGI `http.disconnect`) cancels the
request's task, and leaving the engine's stream aborts the request on the worker.
"""

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Optional

from starlette.responses import JSONResponse, Response

from specprefill_engine.engine.results import Chunk, Result

from .calls import Call, served
from .errors import APIError, classify, error_body

logger = logging.getLogger(__name__)
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it
OPEN_POLL_S = 0.001  # the first look at whether the engine has taken a request


def sse_event(event: Optional[str], data) -> bytes:
    """One server-sent event: `data` as JSON, named `event` (None: unnamed)."""
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {json.dumps(data)}\n\n".encode()


@dataclass
class Opened:
    """The engine has taken the request: it is valid, the response's headers can go."""


@dataclass
class KeepAlive:
    """The request still waits for its first token."""


@dataclass
class Logprobs:
    """The TokenLogprobs of the chunk whose output events follow."""

    values: list


@dataclass
class End:
    """The last chunk, its token_ids those of the whole reply."""

    final: Chunk


class ClientGone(Exception):
    """The client disconnected; its request was aborted and nobody reads an answer."""


class Gate:
    """The server's requests in flight: refuses new ones past a bound (429) or while
    draining (503), and aborts the ones left when a drain runs out of time."""

    def __init__(self, engine, limit: Optional[int]):
        self.engine, self.limit = engine, limit
        self.active: set = set()
        self.draining = False

    @contextlib.contextmanager
    def admitted(self, request_id: str):
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.limit is not None and len(self.active) >= self.limit:
            raise APIError(429, f"the server has {len(self.active)} requests in flight, its "
                           f"limit; retry later", code="overloaded")
        self.active.add(request_id)
        try:
            yield request_id
        finally:
            self.active.discard(request_id)

    def aborted(self) -> APIError:
        why = "the server is shutting down" if self.draining else "the engine stopped it"
        return APIError(503, f"the request was aborted: {why}", code="aborted")

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; after `timeout` seconds abort those still running (their
        streams end with an error event)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.active):
            self.engine.abort(request_id)


async def until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def log_warnings(request_id: str, warnings: list) -> None:
    """What the engine changed in a request (a clamped max_tokens, ...), in the log too
    (at info: a request without max_tokens is clamped to the context every time)."""
    for warning in warnings:
        logger.info("%s: %s", request_id, warning)


async def output_events(engine, gate: Gate, call: Call, request_id: str, keepalive: float,
                        progress: bool = False) -> AsyncIterator[object]:
    """A streamed request as events: `Opened` once the engine has taken it, then, while
    it waits for its first token, `KeepAlive` every `keepalive` seconds, or the engine's
    `Progress` when the client asked for it and the prefill moved; then the output's
    `served` events (`chat/parser_events.py`), each chunk's led by `Logprobs` when the call
    asked for them, then `End`. Whether the engine has it is polled at 1, 2, 4, ... ms:
    the headers then reach the client while the prefill runs, not with the first token."""
    with gate.admitted(request_id):
        parser = call.parser(engine.tokenizer)
        seen = []
        options = dict(call.options, request_id=request_id, on_progress=seen.append)
        chunks = engine.stream(call.prompt, **options)
        pending = asyncio.ensure_future(chunks.__anext__())
        try:
            wait, opened, sent = OPEN_POLL_S, False, 0
            while not (await asyncio.wait((pending,), timeout=wait))[0]:
                if not opened:
                    if seen or request_id in engine.active_request_ids:
                        opened, wait = True, keepalive
                        yield Opened()
                    else:
                        wait = min(wait * 2, keepalive)
                elif progress and len(seen) > sent:
                    sent = len(seen)
                    yield seen[-1]
                else:
                    yield KeepAlive()
            chunk = pending.result()
            if not opened:
                yield Opened()
            tokens = []
            while True:
                tokens += chunk.token_ids
                if chunk.logprobs is not None:
                    yield Logprobs(chunk.logprobs)
                for event in served(call.read(parser, chunk.text, chunk.finish_reason)):
                    yield event
                if chunk.finish_reason is not None:
                    if chunk.finish_reason == "abort":
                        raise gate.aborted()
                    log_warnings(request_id, chunk.warnings)
                    yield End(replace(chunk, token_ids=tokens))
                    return
                chunk = await chunks.__anext__()
        finally:
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await chunks.aclose()


async def race(*coroutines) -> list:
    """Run them until the first ends, then cancel the others and wait for them."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tasks


async def merged(streams: list) -> AsyncIterator[tuple]:
    """(index, event) from several event streams as each has one; the first error ends
    them all (the others are cancelled and closed, which aborts their requests)."""
    if len(streams) == 1:  # one request: its events as they are, no task per event
        async with contextlib.aclosing(streams[0]) as stream:
            async for event in stream:
                yield 0, event
        return
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, event
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def all_of(coroutines) -> list:
    """Their results; on the first error (or a cancellation) the others are cancelled."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def whole_results(request, calls: list, request_ids: list) -> list:
    """Requests run together to their Results (the rows of one `n`); the client leaving
    aborts them all."""
    state = request.app.state.server
    with contextlib.ExitStack() as admitted:
        for request_id in request_ids:
            admitted.enter_context(state.gate.admitted(request_id))
        task, _ = await race(all_of(state.engine.generate(call.prompt, request_id=request_id,
                                                          **call.options)
                                    for call, request_id in zip(calls, request_ids)),
                             until_disconnected(request.receive))
        if task.cancelled():
            raise ClientGone()
        results = task.result()
        if any(result.finish_reason == "abort" for result in results):
            raise state.gate.aborted()
        for request_id, result in zip(request_ids, results):
            log_warnings(request_id, result.warnings)
        return results


async def whole_result(request, call: Call, request_id: str) -> Result:
    """A request run to its Result; the client leaving aborts it."""
    return (await whole_results(request, [call], [request_id]))[0]


class EventStream(Response):
    """An SSE response whose status waits for its first event (see the module doc).

    `events` yields encoded SSE text; an error it raises before its first event is
    answered as the API's JSON error, one after it as `error_event(APIError)`."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], error_event: Callable[[APIError], bytes],
                 fields=()):
        self.status_code, self.background = 200, None
        self.init_headers(SSE_HEADERS)  # no body: no content-length
        self.events, self.error_event, self.fields = events, error_event, fields

    async def __call__(self, scope, receive, send) -> None:
        producer, _ = await race(self._produce(scope, receive, send), until_disconnected(receive))
        error = producer.exception() if producer.done() and not producer.cancelled() else None
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            raise error

    async def _produce(self, scope, receive, send) -> None:
        events = self.events
        try:
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as error:
                api = classify(error, self.fields)
                headers = {"retry-after": "1"} if api.status == 429 else None
                response = JSONResponse(error_body(api, scope["path"]), api.status, headers)
                await response(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for part in events:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            except Exception as error:
                await send({"type": "http.response.body", "more_body": True,
                            "body": self.error_event(classify(error, self.fields))})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()
