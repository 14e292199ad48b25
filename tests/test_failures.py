"""A failure stays with its request: whatever one request does wrong, or whatever fails
in one of its steps, that request ends with an error and every other request ends as
if it had run alone; the engine serves the next request.

Faults are injected at each stage of the executor (`tests/faults.py`: restore, prefill,
join, decode, store), in a request's logits processor (sample) and in its output
processing (output), for one request of a batch of 8. On 0945836 (checked with the same
faults raised from `DecodeBatch.add`, `OutputProcessor.accept` and the prefix cache's store)
an error at a join, in output processing or at a store ended the worker
(`EngineFailedError` for the rest of the batch), a processor of the wrong width failed
its neighbours in the batch, and a schema llguidance cannot compile ended the engine;
a failing prefill chunk, restore or processor already failed its request alone.
"""

import asyncio
from contextlib import ExitStack

import pytest
from faults import executor_fault

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine import RequestFailedError
from specprefill_engine.engine.output import OutputProcessor

pytestmark = pytest.mark.timeout(300)
HANG = 120
VICTIM = "victim"


@pytest.fixture(scope="module")
def engine():
    engine = Engine(threshold=256, densify="off").start_sync()  # no background work
    yield engine
    engine.shutdown_sync()


def batch(engine) -> list:
    """Eight requests: chat prompts of 300-700 tokens, dense and SpecPrefill rows."""
    return [dict(prompt=make_case(engine.tokenizer, 80 + i, "passkey", 300 + 60 * i).messages,
                 max_tokens=10, specprefill=i % 2 == 1, ignore_eos=True, cache_prompt=False)
            for i in range(8)]


@pytest.fixture(scope="module")
def alone(engine) -> list:
    return [engine.generate_sync(**request).token_ids for request in batch(engine)]


def _handle_is_victim(engine, handle: int) -> bool:
    state = engine._worker.find(VICTIM)
    return state is not None and state.handle == handle


class Fault(RuntimeError):
    """The injected failure."""


@pytest.mark.parametrize("stage", ["restore", "prefill", "join", "decode", "sample", "output",
                                   "store"])
async def test_a_failure_at_any_stage_fails_only_its_request(engine, alone, stage, monkeypatch):
    requests = batch(engine)
    victim = requests[3]
    victim["request_id"] = VICTIM
    fired, handles = [], []  # the victim's handle, seen while it runs
    faults = ExitStack()

    def fault(handle):
        if _handle_is_victim(engine, handle) or handle in handles:
            fired.append(stage)
            raise Fault(f"injected at {stage}")

    if stage in ("restore", "prefill", "join", "decode", "store"):
        faults.enter_context(executor_fault(stage, fault))
    if stage == "store":  # stored as the request ends: its handle is noted at its prefill
        victim["cache_prompt"] = True  # it must succeed, its cache left out
        faults.enter_context(executor_fault("prefill", lambda handle: handles.extend(
            [handle] if _handle_is_victim(engine, handle) else [])))
    if stage == "sample":
        def processor(generated, logits):
            if generated.size >= 2:
                raise Fault("injected at sample")
            return logits
        victim["logits_processors"] = [processor]
    if stage == "output":
        accept = OutputProcessor.accept

        def faulty(self, token, logprob=None):
            if self.request_id == VICTIM and len(self.tokens) >= 2:
                raise Fault("injected at output")
            return accept(self, token, logprob)
        monkeypatch.setattr(OutputProcessor, "accept", faulty)
    try:
        with faults:
            outcomes = await asyncio.wait_for(asyncio.gather(
                *(engine.generate(**request) for request in requests),
                return_exceptions=True), HANG)
            if stage == "store":  # the store runs in a turn after the victim's result
                for _ in range(500):
                    if fired:
                        break
                    await asyncio.sleep(0.01)
    finally:
        faults.close()
    if stage == "store":  # the victim succeeds: the fault must still have been raised
        assert fired
    for index, outcome in enumerate(outcomes):
        if index == 3 and stage != "store":
            assert isinstance(outcome, RequestFailedError), outcome
            assert isinstance(outcome.__cause__, Fault), outcome.__cause__
        else:
            assert not isinstance(outcome, BaseException), (index, outcome)
            assert outcome.token_ids == alone[index], index
    assert engine.active_request_ids == []
    after = await engine.generate(**batch(engine)[0])
    assert after.token_ids == alone[0]


async def test_a_processor_of_the_wrong_width_fails_only_its_request(engine, alone):
    request = batch(engine)[0]
    request["max_tokens"] = 30
    reference = await engine.generate(**request)
    stream = engine.stream(**request)
    tokens = list((await stream.__anext__()).token_ids)  # decoding now
    narrow = engine.generate(**batch(engine)[1], logits_processors=[lambda t, l: l[:, :-1]])
    outcome = (await asyncio.gather(narrow, return_exceptions=True))[0]
    async for chunk in stream:
        tokens += chunk.token_ids
    assert isinstance(outcome, RequestFailedError) and "shape" in str(outcome.__cause__)
    assert tokens == reference.token_ids


BAD_FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
    {"type": "tool_call", "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}]},
]


@pytest.mark.parametrize("response_format", BAD_FORMATS, ids=["type", "ref", "tool"])
async def test_a_schema_that_cannot_compile_is_refused_at_the_call(engine, alone, response_format):
    request = batch(engine)[0]
    with pytest.raises(ValueError, match="response_format"):
        await engine.generate(**request, response_format=response_format)
    assert (await engine.generate(**request)).token_ids == alone[0]
