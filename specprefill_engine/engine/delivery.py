"""Handing the worker's events to the callers' event loops.

Events for the callers on one loop go through that loop's `Mailbox`: one
`call_soon_threadsafe` hands over every event posted before the loop gets to it.
Inside `one_delivery()` (the worker wraps the output processing of each decode step
in it) nothing is handed over until the block ends, so a batched step of N streams wakes
each loop once (a model that cannot batch decodes one request per step): otherwise a
loop that is idle drains after the first few posts and wakes again for the rest, and
every wake takes the GIL from the worker (on a GPU, where the worker's Python is what
bounds decode, that is time the step loses).
"""

import asyncio
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

_held = threading.local()  # per thread: the mailboxes with events held back, or None


@contextmanager
def one_delivery() -> Iterator[None]:
    """Hold back the events posted on this thread until the block ends."""
    mailboxes = _held.mailboxes = []
    try:
        yield
    finally:
        _held.mailboxes = None
        for mailbox in mailboxes:
            mailbox.flush()


class Mailbox:
    """The worker's events for the callers on one event loop.

    The first event posted (or the end of a `one_delivery` block) schedules one drain
    on the loop; events posted before that drain runs join it (each caller's events
    stay in order). The loop is held weakly: a closed or collected loop makes `post`
    return False, and the caller's request is then cancelled, as when
    `call_soon_threadsafe` refuses a closed loop; events already waiting for a loop that
    closes go with it (their requests stop at their next event)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list = []
        self._scheduled = False

    def post(self, events: asyncio.Queue, event) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False
        held = getattr(_held, "mailboxes", None)
        with self._lock:
            self._items.append((events, event))
            if self._scheduled:
                return True
            if held is not None:
                if self not in held:
                    held.append(self)
                return True
            self._scheduled = True
        return self._schedule(loop)

    def flush(self) -> None:
        """Schedule a drain for events held back, unless one is already scheduled."""
        loop = self._loop()
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        self._schedule(loop)

    def _schedule(self, loop: Optional[asyncio.AbstractEventLoop]) -> bool:
        try:
            if loop is None:  # collected: nothing posted here will be delivered
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed: nothing posted here will be delivered
            with self._lock:
                self._items.clear()
                self._scheduled = False
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for events, event in items:
            events.put_nowait(event)
