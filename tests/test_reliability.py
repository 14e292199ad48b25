"""Reliability: each defect found in review and under stress, pinned by a test.

Every test here failed on 76844a1 (the engine before the scheduler redesign).
No wall-clock assertions: a `wait_for` bound only turns a hang into a failure.
"""

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import save_with_demo_tokenizer
from specprefill_engine import Engine
from specprefill_engine._blas import CANDIDATES
from specprefill_engine.core import sparse_prefill
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine import EngineFailedError, RequestFailedError
from prefix_pair import PrefixPair
from specprefill_engine.loading import DEMO_TARGET

pytestmark = pytest.mark.timeout(300)
HANG = 120  # seconds after which a wait counts as a hang


@pytest.fixture(scope="module")
def engine():
    engine = Engine(densify="off").start_sync()  # no background work between the tests
    yield engine
    engine.shutdown_sync()


def chat(engine, seed, n_tokens=300, kind="passkey"):
    return make_case(engine.tokenizer, seed, kind, n_tokens).messages


# 1 ---------------------------------------------------------------------------------

async def test_cancelling_the_first_request_while_loading_leaves_the_engine_usable():
    engine = Engine()
    task = asyncio.create_task(engine.generate("def f():", max_tokens=3))
    await asyncio.sleep(0)  # the task is now waiting for the models to load
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        result = await asyncio.wait_for(engine.generate("def f():", max_tokens=3), HANG)
        assert result.usage.completion_tokens >= 1
        assert engine.tokenizer.encode("x")
        assert engine._worker.thread.is_alive()
    finally:
        await engine.shutdown()


# 2 ---------------------------------------------------------------------------------

async def test_a_duplicate_live_request_id_is_refused_and_the_worker_lives(engine):
    first = asyncio.create_task(engine.generate(chat(engine, 1), max_tokens=20, request_id="twin"))
    while "twin" not in engine.active_request_ids:
        await asyncio.sleep(0.01)
    with pytest.raises(ValueError, match="twin"):
        await engine.generate(chat(engine, 2), max_tokens=4, request_id="twin")
    assert (await asyncio.wait_for(first, HANG)).finish_reason in ("stop", "length")
    again = await engine.generate(chat(engine, 2), max_tokens=4, request_id="twin")  # free again
    assert again.usage.completion_tokens >= 1


# 3 ---------------------------------------------------------------------------------

async def test_requests_submitted_while_shutdown_runs_all_end():
    engine = await Engine().start()
    running = asyncio.create_task(engine.generate(chat(engine, 3, 1500), max_tokens=200))
    while not engine.active_request_ids:
        await asyncio.sleep(0.01)
    shutdown = asyncio.create_task(engine.shutdown())
    late = [asyncio.create_task(engine.generate(chat(engine, 4 + i), max_tokens=50))
            for i in range(6)]
    outcomes = await asyncio.wait_for(
        asyncio.gather(running, *late, shutdown, return_exceptions=True), HANG)
    refused = aborted = 0
    for outcome in outcomes[1:-1]:  # submitted after the shutdown began: never served
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, RuntimeError) and "shut down" in str(outcome), outcome
            refused += 1
        else:
            assert outcome.finish_reason == "abort", outcome.finish_reason
            aborted += 1
    assert refused + aborted == 6
    assert outcomes[0].finish_reason == "abort"
    assert not engine.active_request_ids and not engine._worker.thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.generate("def f():", max_tokens=2)


class WorkerKiller(BaseException):
    """Not an Exception: nothing on the worker is meant to catch it."""


async def test_when_the_worker_dies_every_caller_gets_an_error_naming_the_cause():
    engine = await Engine().start()

    def fatal(generated, logits):
        if generated.size >= 2:
            raise WorkerKiller("boom")
        return logits

    rambling = "import os\n\n\ndef main():\n"  # the demo model goes on and on
    bystander = asyncio.create_task(engine.generate(rambling, max_tokens=1000))
    doomed = asyncio.create_task(engine.generate(chat(engine, 8), max_tokens=50,
                                                 logits_processors=[fatal], request_id="doomed"))
    while "doomed" not in engine.active_request_ids:
        await asyncio.sleep(0.01)
    queued = [asyncio.create_task(engine.generate(chat(engine, 6 + i, 1200), max_tokens=5))
              for i in range(2)]
    outcomes = await asyncio.wait_for(
        asyncio.gather(doomed, bystander, *queued, return_exceptions=True), HANG)
    for outcome in outcomes:
        assert isinstance(outcome, EngineFailedError) and "boom" in str(outcome), outcome
    with pytest.raises(EngineFailedError, match="boom"):
        await engine.generate("def f():", max_tokens=2)
    engine._worker.thread.join(HANG)
    assert not engine._worker.thread.is_alive()
    await engine.shutdown()


async def test_a_failing_logits_processor_fails_only_its_own_request(engine):
    messages = chat(engine, 9)
    reference = await engine.generate(messages, max_tokens=16)

    def broken(generated, logits):
        if generated.size >= 3:
            raise ZeroDivisionError("processor bug")
        return logits

    bad = engine.generate(chat(engine, 10), max_tokens=30, logits_processors=[broken])
    outcomes = await asyncio.gather(bad, engine.generate(messages, max_tokens=16),
                                    return_exceptions=True)
    assert isinstance(outcomes[0], RequestFailedError)
    assert isinstance(outcomes[0].__cause__, ZeroDivisionError)
    assert outcomes[1].token_ids == reference.token_ids


# 4 ---------------------------------------------------------------------------------

async def test_eos_flushes_the_text_held_back_for_a_stop_string(engine):
    messages = chat(engine, 11)
    full = await engine.generate(messages, max_tokens=20, specprefill=False)
    assert full.finish_reason == "stop" and len(full.text) >= 2  # ended at EOS
    never = full.text[-1] + "\u2603"  # its first character is the answer's last
    held = await engine.generate(messages, max_tokens=20, specprefill=False, stop=[never])
    assert held.text == full.text
    assert held.text == engine.tokenizer.decode(held.token_ids)
    streamed = [c async for c in engine.stream(messages, max_tokens=20, specprefill=False,
                                                stop=[never])]
    assert "".join(c.text for c in streamed) == full.text


# 5 ---------------------------------------------------------------------------------

def test_added_token_ids_up_to_the_embedding_size_are_accepted(tmp_path):
    import json

    path = save_with_demo_tokenizer(("qwen3", {"vocab_size": 4160}), tmp_path / "wide")
    tokenizer_file = path / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    spec["added_tokens"].append({"id": 4096, "content": "<tool_call>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    tokenizer_file.write_text(json.dumps(spec))
    with Engine(model=str(path)) as engine:
        ids = engine.tokenizer.encode("<tool_call>")
        assert 4096 in ids and engine.tokenizer.vocab_size <= 4096
        assert engine.generate_sync(ids, max_tokens=2).usage.prompt_tokens == len(ids)
        with pytest.raises(ValueError, match="4160"):
            engine.generate_sync([4160], max_tokens=2)


# 6 ---------------------------------------------------------------------------------

async def test_a_stream_gets_a_token_after_every_prefill_unit_at_the_default_step(engine):
    """With the default step size a prefill unit is small (256 tokens on the CPU, fewer
    as the context grows, so each costs about as much), and a decoding stream is
    served between any two units of another request's prefill."""
    assert engine.info.step_size <= 256  # on the CPU
    events = []
    stream_started = asyncio.Event()

    async def stream():
        async for chunk in engine.stream("import os\n\n\ndef main():\n", max_tokens=400,
                                         specprefill=False):
            events.append("token")
            stream_started.set()

    streaming = asyncio.create_task(stream())
    await stream_started.wait()
    progress = []

    def on_progress(p):
        progress.append(p.done)
        events.append("unit")

    await engine.generate(chat(engine, 12, 4000), max_tokens=2, specprefill=False,
                          on_progress=on_progress)
    streaming.cancel()
    units_tokens = np.diff([0] + progress)
    # the first unit may start past a prefix another test cached (the template's head) and
    # end on the step grid
    assert engine.info.step_size - 16 < units_tokens[0] <= engine.info.step_size
    assert max(units_tokens) <= engine.info.step_size
    assert units_tokens[-2] < units_tokens[0] / 2  # attention at 4K: later units are smaller
    units = [i for i, e in enumerate(events) if e == "unit"]
    assert len(units) >= 20
    # between two consecutive prefill units the stream got at least one token
    # (while it still ran: it may have finished by its max_tokens)
    last_token = max(i for i, e in enumerate(events) if e == "token")
    gaps = [b - a for a, b in zip(units, units[1:]) if b < last_token]
    assert gaps and min(gaps) >= 2


# 7 ---------------------------------------------------------------------------------

def _run_script(code: str, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=HANG, **kwargs)


def test_shutdown_frees_the_models_on_the_worker_and_hands_none_out():
    # in its own process: other tests' engines free memory at times of their own
    run = _run_script("""
        import gc
        import mlx.core as mx
        from specprefill_engine import Engine
        gc.collect()
        before = mx.get_active_memory()
        engine = Engine().start_sync()
        engine.generate_sync("def f():", max_tokens=4)
        loaded = mx.get_active_memory()
        engine.shutdown_sync()
        print(loaded - before, mx.get_active_memory() - before, hasattr(engine, "runtime"))
    """)
    assert run.returncode == 0, run.stderr
    loaded, left, has_runtime = run.stdout.split()
    assert int(loaded) > 20e6  # the pair really was loaded (~64 MB in float32)
    assert int(left) < 2e6  # freed while the Engine object lives on
    assert has_runtime == "False"


# 8 ---------------------------------------------------------------------------------

def test_a_process_exiting_with_a_request_in_flight_exits_cleanly():
    run = _run_script("""
        from specprefill_engine import Engine
        engine = Engine()
        stream = engine.stream_sync("import os\\n\\n\\ndef main():\\n", max_tokens=10000)
        print(next(stream).request_id, flush=True)
        # the script ends here: the stream is open and the engine never shut down
    """)
    assert run.returncode == 0, run.stderr
    assert "terminate called" not in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("send", ["os.kill(os.getpid(), signal.SIGINT)",
                                  # the signal lands on a thread other than the caller's
                                  "signal.pthread_kill(threading.get_ident(), signal.SIGINT)"])
def test_ctrl_c_during_a_blocking_call_raises_keyboard_interrupt_in_the_caller(send):
    script = f"""
        import os, signal, threading
        from specprefill_engine import Engine
        # Ctrl-C's handler, as an interactive Python has it (a process started in the
        # background of a shell script starts with SIGINT ignored, and Python keeps that)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        engine = Engine().start_sync()
        threading.Timer(1.0, lambda: {send}).start()
        try:
            engine.generate_sync("import os\\n\\n\\ndef main():\\n", max_tokens=100000)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
    run = _run_script(script)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "interrupted"
    assert "terminate called" not in run.stderr


# 10 --------------------------------------------------------------------------------

def test_prefix_cache_refuses_an_entry_over_budget_without_copying_it(demo_pair):
    target, _, _ = demo_pair
    cache = make_prompt_cache(target)
    tokens = np.arange(5, 2005, dtype=np.int32) % 4000
    target(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    size = sum(c.keys[..., :2000, :].nbytes + c.values[..., :2000, :].nbytes for c in cache)
    store = PrefixPair(max_bytes=size // 2)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    store.store(tokens, cache)
    assert not store.entries and store.total_bytes == 0
    assert mx.get_peak_memory() - before < size // 4


# 11 --------------------------------------------------------------------------------

def test_cli_compare_times_a_cold_dense_prefill(tmp_path, demo_pair):
    import json

    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 3, "assignment", 1500)
    document = tmp_path / "module.py"
    document.write_text(case.context)
    run = subprocess.run(
        [sys.executable, "-m", "specprefill_engine.cli", "ask", str(document), "--question",
         case.question, "--max-tokens", "4", "--no-specprefill", "--compare", "--json"],
        capture_output=True, text=True, timeout=HANG)
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    assert payload["usage"]["cached_tokens"] == 0
    # the comparison prefilled the whole prompt again: nothing came from the prefix cache
    assert payload["dense_cached_tokens"] == 0 and payload["dense_time_to_first_token"] > 0


# 12 --------------------------------------------------------------------------------

def test_sparse_prefill_returns_logits_of_shape_1_1_vocab(demo_pair):
    target, _, _ = demo_pair
    tokens = mx.arange(5, 105)
    cache = make_prompt_cache(target)
    logits = sparse_prefill(target, tokens, mx.arange(0, 100, 2).tolist() + [99], cache)
    assert logits.shape == (1, 1, 4096)
    from specprefill_engine.core import cleanup_rope

    cleanup_rope(target)


# 13 --------------------------------------------------------------------------------

async def test_prompt_plus_max_tokens_beyond_the_context_is_clamped_and_said(tmp_path):
    short = tmp_path / "short-context"  # the demo target with a 1024-token context
    shutil.copytree(DEMO_TARGET, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    async with Engine(model=str(short), densify="off") as engine:
        assert engine.info.context_length == 1024
        ids = [5 + i % 3000 for i in range(1024 - 3)]
        result = await engine.generate(ids, max_tokens=50, specprefill=False)
    assert result.usage.completion_tokens <= 3
    assert result.warnings and "max_tokens clamped from 50 to 3" in result.warnings[0]


async def test_time_to_first_token_is_set_when_the_first_token_is_eos(engine):
    eos = engine.tokenizer.eos_token_ids
    first = await engine.generate(chat(engine, 13), max_tokens=1)
    result = await engine.generate(chat(engine, 13), max_tokens=5,
                                   stop_token_ids=[first.token_ids[0]] if first.token_ids else list(eos))
    assert result.token_ids == [] and result.finish_reason == "stop"
    assert result.timings.time_to_first_token > 0


async def test_time_to_first_token_counts_the_chat_template_the_caller_waits_for(engine):
    tokenizer = engine.tokenizer
    original = tokenizer.apply_chat_template

    def slow(*args, **kwargs):  # a long conversation's template and tokenizing
        time.sleep(0.3)
        return original(*args, **kwargs)

    tokenizer.apply_chat_template = slow
    try:
        result = await engine.generate(chat(engine, 15), max_tokens=2)
    finally:
        del tokenizer.apply_chat_template
    timings = result.timings
    assert timings.prepare >= 0.3
    assert timings.time_to_first_token >= (timings.prepare + timings.queue_wait
                                           + timings.scoring + timings.prefill)


async def test_tokenizing_runs_off_the_event_loop(engine):
    import threading

    loop_thread = threading.current_thread()
    seen = []
    tokenizer = engine.tokenizer
    original = tokenizer.apply_chat_template

    def recording(*args, **kwargs):
        seen.append(threading.current_thread())
        return original(*args, **kwargs)

    tokenizer.apply_chat_template = recording
    try:
        await engine.generate(chat(engine, 14), max_tokens=2)
    finally:
        del tokenizer.apply_chat_template
    assert seen and loop_thread not in seen


# bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, kwargs, error, name", [
    ("hi", {"stop": None}, TypeError, "stop"),
    ("hi", {"stop": 5}, TypeError, "stop"),
    ("hi", {"seed": -1}, ValueError, "seed"),
    ("bad \ud800 text", {}, ValueError, "prompt"),
    ("hi", {"top_p": "a"}, TypeError, "top_p"),
    ([{"role": "wizard", "content": "hi"}], {}, ValueError, "role"),
    ([{"role": "user", "content": None}], {}, ValueError, "content"),
    ("hi", {"max_tokens": True}, TypeError, "max_tokens"),
    ("hi", {"temperature": math.inf}, ValueError, "temperature"),
    ("hi", {"temperature": math.nan}, ValueError, "temperature"),
    ("hi", {"top_p": math.nan}, ValueError, "top_p"),
    ("hi", {"min_p": math.nan}, ValueError, "min_p"),
    ("hi", {"repetition_penalty": math.nan}, ValueError, "repetition_penalty"),
    ("hi", {"keep": math.nan}, ValueError, "keep"),
    ("hi", {"threshold": 0}, ValueError, "threshold"),
    ("hi", {"logits_processors": [5]}, TypeError, "logits_processors"),
    ([1, 2, 99999], {}, ValueError, "token ids"),
])
async def test_bad_input_names_the_parameter(engine, prompt, kwargs, error, name):
    with pytest.raises(error, match=name):
        await engine.generate(prompt, **kwargs)
    assert (await engine.generate("def f():", max_tokens=2)).usage.completion_tokens >= 1


def test_the_package_logs_through_logging_and_prints_nothing_by_default():
    script = """
        import logging, sys
        from specprefill_engine import Engine
        from specprefill_engine.engine import RequestFailedError
        if sys.argv[1] == "configured":
            logging.basicConfig(level=logging.WARNING)

        def broken(generated, logits):
            raise ZeroDivisionError("processor bug")

        with Engine() as engine:
            try:
                engine.generate_sync("def f():", max_tokens=3, logits_processors=[broken])
            except RequestFailedError:
                print("failed as expected")
    """
    quiet = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "quiet"],
                           capture_output=True, text=True, timeout=HANG)
    loud = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "configured"],
                          capture_output=True, text=True, timeout=HANG)
    assert quiet.stdout.strip() == loud.stdout.strip() == "failed as expected"
    assert quiet.stderr == ""
    assert "specprefill_engine.engine.scheduler" in loud.stderr and "processor bug" in loud.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or mx.default_device() != mx.cpu
                    or os.environ.get("SPECPREFILL_BLAS", "").lower() == "off",
                    reason="the optimized BLAS is loaded on Linux CPU machines only")
def test_an_engine_on_the_reference_blas_says_so():
    """MLX imported before the package cannot use the optimized BLAS (about 20x slower on
    a CPU): the engine logs a warning naming the fix; imported after, it does not."""
    script = """
        import logging
        if {mlx_first}:
            import mlx.core  # noqa: F401
        logging.basicConfig(level=logging.WARNING)
        from specprefill_engine import Engine
        with Engine(draft=None) as engine:
            print(len(engine.generate_sync([5, 6, 7], max_tokens=2).token_ids))
    """
    late = _run_script(script.format(mlx_first=True))
    early = _run_script(script.format(mlx_first=False))
    assert late.stdout.strip() == early.stdout.strip() == "2"
    assert "reference BLAS" in late.stderr and "import specprefill_engine before mlx" in late.stderr
    assert "reference BLAS" not in early.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or mx.default_device() != mx.cpu
                    or os.environ.get("SPECPREFILL_BLAS", "").lower() == "off"
                    or not any(os.path.exists(path) for path in CANDIDATES),
                    reason="OpenBLAS is loaded on Linux CPU machines that have it")
def test_openblas_idle_threads_sleep_unless_the_caller_chose():
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads: the package sets it to the
    minimum (idle threads spinning between decode steps take a small CPU's cores from
    the worker and the event loop), and leaves a value the caller set alone."""
    script = """
        import os
        from specprefill_engine._blas import blas_status
        print(os.environ["OPENBLAS_THREAD_TIMEOUT"], blas_status())
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    default = _run_script(script, env=env).stdout.split()
    chosen = _run_script(script, env={**env, "OPENBLAS_THREAD_TIMEOUT": "20"}).stdout.split()
    assert default[0] == "4" and chosen[0] == "20"
    assert default[1] == chosen[1] == "loaded"
