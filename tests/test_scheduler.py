"""The scheduler driven turn by turn on the test's own thread, as the worker's loop
drives it: `schedule()` returns the plan, the executor runs it, `update()` takes the
outcome. Every status change is the scheduler's, in its lifecycle's order, and a
request's tokens are those the engine gives it."""

import numpy as np
import pytest

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.executor import Executor
from specprefill_engine.engine.output import OutputProcessor
from specprefill_engine.engine.results import Result
from specprefill_engine.engine.runtime import EngineConfig, load_runtime
from specprefill_engine.engine.sampling import SamplingParams
from specprefill_engine.engine.scheduler import Scheduler
from specprefill_engine.engine.state import RequestState, Status
from specprefill_engine.engine.worker import make_prefix_caches
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.timeout(300)


def request(runtime, request_id: str, tokens: np.ndarray, events: list, **options) -> RequestState:
    params = SamplingParams(max_tokens=6)
    output = OutputProcessor(request_id, params, 6, runtime.tokenizer, False, events.append)
    return RequestState(request_id, tokens, params, events.append, keep=0.3, threshold=1024,
                        max_tokens=6, output=output, **options)


def test_the_scheduler_runs_turn_by_turn_without_a_thread(fresh_cache_dir):
    config = EngineConfig(densify="off")
    runtime = load_runtime(DEMO_TARGET, DEMO_DRAFT, config)
    caches, (store, draft_store) = make_prefix_caches(runtime)
    executor = Executor(runtime.model, store, None, scorer=runtime.scorer,
                        draft_prefix=draft_store, kv=runtime.kv)
    scheduler = Scheduler()
    scheduler.start(runtime, caches, executor.register)
    long_prompt = np.array(runtime.tokenizer.apply_chat_template(
        make_case(runtime.tokenizer, 3, "passkey", 1500).messages, add_generation_prompt=True),
        np.int32)
    short_prompt = np.array(runtime.tokenizer.encode("The capital of France is"), np.int32)
    events = {"sparse": [], "dense": []}
    states = {"sparse": request(runtime, "sparse", long_prompt, events["sparse"],
                                specprefill=True),
              "dense": request(runtime, "dense", short_prompt, events["dense"])}
    with scheduler.lock:
        for state in states.values():
            scheduler.add(state)
    seen = {name: [Status.WAITING] for name in states}

    def look():
        for name, state in states.items():
            if state.status is not seen[name][-1]:
                seen[name].append(state.status)
    for _ in range(200):
        plan = scheduler.schedule()
        look()
        scheduler.update(plan, executor.run(plan) if plan else None)
        look()
        if all(s.status is Status.ENDED for s in states.values()):
            break
    executor.clear()
    assert seen["sparse"] == [Status.WAITING, Status.SCORING, Status.PREFILLING,
                              Status.LAST_CHUNK, Status.JOINING, Status.DECODING,
                              Status.LEAVING, Status.ENDED]
    assert seen["dense"][-4:] == [Status.JOINING, Status.DECODING, Status.LEAVING,
                                  Status.ENDED]
    assert Status.SCORING not in seen["dense"]
    results = {name: [e for e in got if isinstance(e, Result)] for name, got in events.items()}
    assert [len(r) for r in results.values()] == [1, 1]
    assert results["sparse"][0].specprefill.engaged
    with Engine(densify="off", prefix_cache_bytes=0) as engine:
        for name, prompt in (("sparse", long_prompt), ("dense", short_prompt)):
            direct = engine.generate_sync(prompt.tolist(), max_tokens=6, keep=0.3,
                                          specprefill=name == "sparse" or None)
            assert results[name][0].token_ids == direct.token_ids, name
