"""The async engine on the demo pair: equality, concurrency, cancellation, errors."""

import asyncio
import sys
import threading
from contextlib import contextmanager
from types import ModuleType

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from specprefill_engine import Engine, ModelLoadError, load_model
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(densify="off").start_sync()  # the default step size, as users get it;
    # densify off: these tests compare with fresh engines, and a densified prefix would
    # change a later request's path with the timing
    yield engine
    engine.shutdown_sync()


def chat(engine, seed, n_tokens=300, kind="passkey"):
    return make_case(engine.tokenizer, seed, kind, n_tokens).messages


async def test_generate_equals_stream_equals_mlx_lm(engine):
    messages = chat(engine, 1)
    result = await engine.generate(messages, max_tokens=24, specprefill=False)
    chunks = [c async for c in engine.stream(messages, max_tokens=24, specprefill=False)]
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert chunks[-1].finish_reason == result.finish_reason and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    model, tokenizer = load_model()  # mlx-lm's own loop on its own copy, in this thread
    expected = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=24):
        if token in tokenizer.eos_token_ids:
            break
        expected.append(token)
    assert result.token_ids == expected


async def test_sixteen_concurrent_requests_match_their_solo_results(engine):
    prompts = [chat(engine, 10 + i, n_tokens=120 + 20 * i) for i in range(16)]
    solo = [await engine.generate(p, max_tokens=8, specprefill=False) for p in prompts]
    together = await asyncio.gather(
        *(engine.generate(p, max_tokens=8, specprefill=False) for p in prompts)
    )
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]


async def test_sparse_requests_interleaved_with_dense_ones_stay_exact(engine):
    long = chat(engine, 3, n_tokens=1500)
    short = chat(engine, 4, n_tokens=200)
    sparse_alone = await engine.generate(long, max_tokens=8, specprefill=True)
    dense_alone = await engine.generate(short, max_tokens=30, specprefill=False)
    sparse, dense = await asyncio.gather(
        engine.generate(long, max_tokens=8, specprefill=True),
        engine.generate(short, max_tokens=30, specprefill=False),
    )
    assert sparse.specprefill.engaged and sparse.token_ids == sparse_alone.token_ids
    assert dense.token_ids == dense_alone.token_ids


async def test_break_out_of_stream_aborts_and_next_request_is_clean(engine):
    messages = "import os\n\n\ndef main():\n"  # plain code: the demo model rambles on
    reference = await engine.generate(messages, max_tokens=16, specprefill=False)
    stream = engine.stream(messages, max_tokens=200, specprefill=False, request_id="abandoned")
    received = 0
    async for _ in stream:
        received += 1
        if received == 2:
            break
    await stream.aclose()
    again = await engine.generate(messages, max_tokens=16, specprefill=False)
    assert again.token_ids == reference.token_ids
    # 198 more tokens would outlast 16: the abandoned request is no longer worked on
    assert "abandoned" not in engine.active_request_ids


async def test_cancel_during_draft_prefill_stops_the_work(engine):
    messages = chat(engine, 6, n_tokens=8000)
    seen = []

    def cancel_in_draft_prefill(progress):
        seen.append(progress)
        if len(seen) == 2:  # 2 of the draft's ~63 prefill chunks done
            task.cancel()

    task = asyncio.create_task(engine.generate(
        messages, max_tokens=4, specprefill=True, on_progress=cancel_in_draft_prefill,
        request_id="cancelled"))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen[-1].phase == "scoring" and seen[-1].done < seen[-1].total
    small = chat(engine, 7)
    first = await engine.generate(small, max_tokens=8, specprefill=False)
    # the rest of an 8K-token scoring and prefill would outlast this short request
    assert "cancelled" not in engine.active_request_ids
    with Engine(step_size=256) as fresh:
        assert fresh.generate_sync(small, max_tokens=8, specprefill=False).token_ids == first.token_ids


async def test_timeout_during_long_prefill(engine):
    messages = chat(engine, 8, n_tokens=6000)
    prefill = []
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.generate(messages, max_tokens=4, specprefill=False,
                                               on_progress=prefill.append,
                                               request_id="timed-out"), 1.0)
    assert prefill and prefill[-1].done < prefill[-1].total  # timed out mid-prefill
    result = await engine.generate(chat(engine, 9), max_tokens=4)
    assert result.finish_reason in ("stop", "length")
    assert "timed-out" not in engine.active_request_ids


async def test_growing_chat_reuses_the_prefix():
    async with Engine(step_size=256) as cached, Engine(step_size=256, prefix_cache_bytes=0) as plain:
        turn1 = chat(cached, 11, n_tokens=600)
        first = await cached.generate(turn1, max_tokens=8, specprefill=False)
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "What is the secret passkey?"}]
        second = await cached.generate(turn2, max_tokens=8, specprefill=False)
        baseline = await plain.generate(turn2, max_tokens=8, specprefill=False)
        assert second.usage.cached_tokens > 450  # cut to the chunk grid: 256, 488, 702, ...
        assert baseline.usage.cached_tokens == 0
        assert second.token_ids == baseline.token_ids


@pytest.mark.parametrize(
    "prompt, kwargs, error",
    [
        ("", {}, ValueError),
        ([], {}, ValueError),
        (42, {}, TypeError),
        ([{"content": "no role"}], {}, ValueError),
        ([1] * 17000, {}, ValueError),
        ("hi", {"keep": 0.0}, ValueError),
        ("hi", {"keep": 1.5}, ValueError),
        ("hi", {"max_tokens": 0}, ValueError),
        ("hi", {"temperature": -1}, ValueError),
        ("hi", {"stop": [""]}, ValueError),
    ],
)
async def test_bad_input_raises_and_engine_keeps_serving(engine, prompt, kwargs, error):
    with pytest.raises(error):
        await engine.generate(prompt, **kwargs)
    result = await engine.generate("def f():", max_tokens=3)
    assert result.usage.completion_tokens >= 1


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model="/no/such/model")


async def test_stop_strings_are_not_emitted(engine):
    messages = chat(engine, 14)
    full = await engine.generate(messages, max_tokens=12, specprefill=False)
    assert len(full.text) >= 3
    stop = full.text[1:3]
    cut = await engine.generate(messages, max_tokens=12, specprefill=False, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    streamed = [c async for c in engine.stream(messages, max_tokens=12, specprefill=False, stop=[stop])]
    assert "".join(c.text for c in streamed) == cut.text


def test_sync_facade_and_several_event_loops(engine):
    messages = chat(engine, 15)
    expected = engine.generate_sync(messages, max_tokens=8, specprefill=False).token_ids
    results = []

    def in_own_loop():
        results.append(asyncio.run(engine.generate(messages, max_tokens=8, specprefill=False)).token_ids)

    threads = [threading.Thread(target=in_own_loop) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected] * 3
    assert "".join(c.text for c in engine.stream_sync(messages, max_tokens=8, specprefill=False)) == \
        engine.generate_sync(messages, max_tokens=8, specprefill=False).text


@contextmanager
def recording_mlx_calls(calls: dict):
    """Record the thread of every call into MLX's C++ (the functions of mlx.core and its
    submodules, the array's methods and operators: each wrapped, the real call still
    made) and of every Python frame of mlx / mlx-lm model code (mlx-lm's tokenizer
    wrapper is not MLX work)."""
    def record(name):
        calls.setdefault(threading.current_thread().name, set()).add(name)

    def wrapped(owner, name, call):
        def wrapper(*args, **kwargs):
            record(name)
            return call(*args, **kwargs)
        return wrapper

    patched = []
    for owner in (mx, mx.random, mx.fast, mx.linalg):
        for name in dir(owner):
            value = getattr(owner, name)
            if not name.startswith("_") and callable(value) and not isinstance(value, type) \
                    and not isinstance(value, ModuleType):
                patched.append((owner, name, value))
    for name in [n for n in dir(mx.array) if not n.startswith("_")] + [
            "__getitem__", "__setitem__", "__add__", "__sub__", "__mul__", "__truediv__",
            "__matmul__", "__neg__", "__eq__", "__lt__", "__gt__", "__bool__", "__len__"]:
        value = getattr(mx.array, name)
        if callable(value):
            patched.append((mx.array, name, value))

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and ("/mlx/" in path or "/mlx_lm/" in path) \
                and not path.endswith("tokenizer_utils.py"):
            record(frame.f_code.co_name)

    for owner, name, value in patched:
        setattr(owner, name, wrapped(owner, name, value))
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for owner, name, value in patched:
            setattr(owner, name, value)


def test_no_mlx_call_happens_off_the_worker_thread():
    """Every MLX call, Python or C++, runs on the worker thread."""
    calls = {}

    async def run(engine):
        await engine.generate("def main():", max_tokens=4)
        async for _ in engine.stream("import os", max_tokens=4):
            pass
        await engine.generate(chat(engine, 7, 300), max_tokens=4, specprefill=True,
                              response_format={"type": "json_object"})

    engine = Engine(step_size=256)
    with recording_mlx_calls(calls):
        asyncio.run(run(engine))
        engine.shutdown_sync()
        mx.zeros((1,)).tolist()  # the probe sees calls off the worker: these, on this thread
    assert calls.pop("MainThread") == {"zeros", "tolist"}, calls
    assert "specprefill-worker" in calls
    assert set(calls) == {"specprefill-worker"}, calls
