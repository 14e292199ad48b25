"""A seeded storm of cancellations by every mechanism a caller has, with bystanders.

Afterwards nothing is left running, no position or query-capture wrapper is left on
either model, and every prompt gets the same tokens as on a fresh engine.
"""

import asyncio
import random

import pytest

from models import wrappers_left
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(600)
SEED = 20261129
MECHANISMS = ("task.cancel", "break", "aclose", "wait_for", "abort", "on_progress")


def prompts(tokenizer) -> list:
    """(messages, options) pairs: dense and SpecPrefill, several lengths."""
    cases = []
    for index, length in enumerate((200, 350, 600, 900, 1300)):
        messages = make_case(tokenizer, 100 + index, "passkey", length).messages
        cases.append((messages, {"specprefill": index % 2 == 1, "threshold": 256}))
    return cases


async def reference_outputs(engine, cases) -> list:
    return [(await engine.generate(m, max_tokens=12, **o)).token_ids for m, o in cases]



async def one_victim(engine, rng, messages, options, request_id, used):
    mechanism = rng.choice(MECHANISMS)
    used.add(mechanism)
    stream_mode = rng.random() < 0.5
    kwargs = dict(options, max_tokens=rng.randint(5, 40), request_id=request_id)
    if mechanism == "on_progress":
        after = rng.randint(1, 6)
        seen = []

        def cancel_from_progress(progress):
            seen.append(progress)
            if len(seen) == after:
                engine.abort(request_id)

        kwargs["on_progress"] = cancel_from_progress
        return await engine.generate(messages, **kwargs)
    if mechanism in ("break", "aclose"):
        stream = engine.stream(messages, **kwargs)
        limit = rng.randint(0, 3)
        received = 0
        async for _ in stream:
            received += 1
            if received > limit:
                break
        if mechanism == "aclose":
            await stream.aclose()
        return None
    call = (engine.stream(messages, **kwargs) if stream_mode else None)

    async def run():
        if call is not None:
            return [c async for c in call]
        return await engine.generate(messages, **kwargs)

    if mechanism == "wait_for":
        try:
            return await asyncio.wait_for(run(), rng.uniform(0.0, 0.6))
        except asyncio.TimeoutError:
            return None
    task = asyncio.create_task(run())
    await asyncio.sleep(rng.uniform(0.0, 0.6))
    if mechanism == "abort":
        engine.abort(request_id)
    else:
        task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def test_cancellation_storm_leaves_the_engine_as_fresh():
    rng = random.Random(SEED)
    async with Engine() as fresh:
        cases = prompts(fresh.tokenizer)
        expected = await reference_outputs(fresh, cases)
    async with Engine() as engine:
        bystanders, used = [], set()
        for wave in range(8):
            jobs = []
            for slot in range(10):
                messages, options = rng.choice(cases)
                jobs.append(one_victim(engine, rng, messages, options, f"v{wave}-{slot}", used))
            index = rng.randrange(len(cases))
            messages, options = cases[index]
            bystanders.append((index, asyncio.ensure_future(
                engine.generate(messages, max_tokens=12, **options))))
            await asyncio.wait_for(asyncio.gather(*jobs), 300)
        for index, task in bystanders:
            assert (await task).token_ids == expected[index]
        assert used == set(MECHANISMS)  # the 80 victims tried every way of cancelling
        for _ in range(100):  # aborted requests end within a few scheduler turns
            if not engine.active_request_ids:
                break
            await asyncio.sleep(0.05)
        assert engine.active_request_ids == []
        runtime = engine._worker.runtime
        assert wrappers_left(runtime.model) == [] and wrappers_left(runtime.scorer.model) == []
        assert await reference_outputs(engine, cases) == expected
