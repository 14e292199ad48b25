"""The async path never blocks the event loop: a heartbeat task beats every 5 ms while
ChatSpecPrefill loads a model, binds tools and renders a chat template that is slow
to render (~0.3 s per render). A beat is missed for every PERIOD the loop spends
running code between two waits for events, past STALL; a call that loaded the model
or rendered the template on the loop would miss dozens. The request's own duration
is not timed.

What is counted is the loop's own time: the CPU time its thread spends from one
`select()` returning to the next call (`time.thread_time`), so neither a busy shared
machine (waiting for a CPU) nor another thread's pure-Python work (waiting for the GIL,
as a template render in `asyncio.to_thread` makes it) counts as blocking.
"""

import asyncio
import selectors
import time

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool

from chat_templates import SLOW_TEMPLATE, demo_variant
from langchain_specprefill import ChatSpecPrefill

pytestmark = pytest.mark.timeout(600)
PERIOD = 0.005
STALL = 0.02  # the loop running longer than this without waiting misses beats
ALLOWED = 20  # the loop's own short callbacks; a render on the loop misses 190


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


class TimedSelector(selectors.DefaultSelector):
    """Counts the beats missed while the loop ran code between two selects."""

    def __init__(self):
        super().__init__()
        self.missed, self.returned = 0, None

    def select(self, timeout=None):
        if self.returned is not None:
            ran = time.thread_time() - self.returned
            if ran > STALL:
                self.missed += int(ran / PERIOD)
        events = super().select(timeout)
        self.returned = time.thread_time()
        return events


async def heartbeat(done: asyncio.Event) -> None:
    while not done.is_set():
        await asyncio.sleep(PERIOD)


def missed_beats(work) -> tuple:
    """(work's result, beats missed while it ran on a loop with a heartbeat)."""
    selector = TimedSelector()
    loop = asyncio.SelectorEventLoop(selector)

    async def main():
        done = asyncio.Event()
        beating = asyncio.create_task(heartbeat(done))
        try:
            return await work()
        finally:
            done.set()
            await beating

    try:
        return loop.run_until_complete(main()), selector.missed
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def langchain_warm_up():
    """LangChain's own first-use imports (callbacks, tracers) on a fake model."""
    fake = GenericFakeChatModel(messages=iter([AIMessage("a b"), AIMessage("c d")]))
    await fake.ainvoke("hi")
    return [chunk async for chunk in fake.astream("hi")]


def test_loading_and_rendering_leave_the_loop_free(tmp_path):
    llm = ChatSpecPrefill(model=demo_variant(tmp_path / "slow", SLOW_TEMPLATE), max_tokens=2)
    missed_beats(langchain_warm_up)

    async def call_tools():  # binding happens on the loop too, as in an agent's model node
        return await llm.bind_tools([get_weather], tool_choice="any",
                                    max_tokens=40).ainvoke("Weather in Paris?")

    async def stream():
        return [chunk async for chunk in llm.astream("Say hi.", reasoning=True)]

    try:
        first, on_load = missed_beats(lambda: llm.ainvoke("hi"))  # loads the model
        calls, on_tools = missed_beats(call_tools)
        chunks, on_stream = missed_beats(stream)
    finally:
        llm.close()
    missed = (on_load, on_tools, on_stream)
    assert first.usage_metadata["output_tokens"] >= 1 and calls.tool_calls and chunks
    assert max(missed) <= ALLOWED, missed
