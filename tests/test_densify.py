"""Densify while idle: after a SpecPrefill turn the engine computes its dense KV when
nothing else runs, and the agent's next turn continues from it, as dense would.

No timing assertions: waits are bounded only to turn a hang into a failure, and "an
arriving request waits at most one unit" is counted in tokens the densification
computed before the request's first token (read on the worker, in a logits processor).
"""

import asyncio
import time

import pytest

from models import wrappers_left
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(600)
HANG = 300


def turns(tokenizer, seed: int = 3, n_tokens: int = 2000):
    case = make_case(tokenizer, seed, "passkey", n_tokens)
    return case, case.messages


def next_turn(messages: list, reply: str) -> list:
    return messages + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": "Say the passkey again."}]


async def until(engine, done) -> None:
    """Wait for `done(engine.stats()["densify"])`, bounded by HANG."""
    deadline = time.monotonic() + HANG
    while not done(engine.stats()["densify"]):
        assert time.monotonic() < deadline, engine.stats()
        await asyncio.sleep(0.01)


async def densified(engine, count: int = 1) -> None:
    await until(engine, lambda stats: stats.entries >= count and not stats.pending)


async def densifying(engine) -> None:
    await until(engine, lambda stats: stats.tokens > 0)


async def test_the_turn_after_a_densified_one_answers_as_dense():
    async with Engine() as engine:
        case, messages = turns(engine.tokenizer)
        first = await engine.generate(messages, max_tokens=8, specprefill=True)
        assert first.specprefill.engaged
        await densified(engine)
        stats = engine.stats()["densify"]
        assert stats.tokens >= first.usage.prompt_tokens - 64 and stats.seconds > 0
        # the reply as an agent framework re-serializes it: the prompt leaves the
        # densified entry at the reply
        grown = next_turn(messages, f"{first.text.strip()} (as the tool saw it)")
        second = await engine.generate(grown, max_tokens=8, specprefill=True)
        # the turn after extends the second's own dense entry: still run as dense would
        third = await engine.generate(next_turn(grown, second.text), max_tokens=8,
                                      specprefill=True)
    report = second.specprefill
    assert "densified" in report.reuse, report.reuse
    assert not report.engaged and "too few to sparsify" in report.reason
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert "densified" in third.specprefill.reuse, third.specprefill.reuse
    assert not third.specprefill.engaged and "too few to sparsify" in third.specprefill.reason
    assert third.usage.cached_tokens >= second.usage.prompt_tokens
    with Engine() as dense:
        alone = dense.generate_sync(grown, max_tokens=8, specprefill=False, cache_prompt=False)
    assert second.token_ids == alone.token_ids


async def test_a_request_arriving_mid_densify_waits_at_most_one_unit():
    async with Engine() as engine:
        _, messages = turns(engine.tokenizer, 4, 2000)
        first = await engine.generate(messages, max_tokens=4, specprefill=True)
        await densifying(engine)
        seen = []

        def probe(generated, logits):  # on the worker, at the first token
            if not seen:
                seen.append(engine.stats()["densify"].tokens)
            return logits

        other = make_case(engine.tokenizer, 5, "passkey", 400).messages
        before = engine.stats()["densify"].tokens
        assert before < first.usage.prompt_tokens - 2 * engine.info.step_size  # units left
        result = await engine.generate(other, max_tokens=6, specprefill=False,
                                       logits_processors=[probe])
        step = engine.info.step_size
        assert seen[0] - before <= step * 1.25 + 1  # one unit at most (and a folded tail)
        await densified(engine)
        assert engine.stats()["densify"].entries == 1
    with Engine() as fresh:
        alone = fresh.generate_sync(other, max_tokens=6, specprefill=False, cache_prompt=False)
    assert result.token_ids == alone.token_ids
    assert first.specprefill.engaged


async def test_shutdown_during_densify_is_prompt_and_leaves_nothing():
    engine = await Engine().start()
    _, messages = turns(engine.tokenizer, 6, 2000)
    await engine.generate(messages, max_tokens=4, specprefill=True)
    await densifying(engine)
    runtime = engine._worker.runtime
    model, draft = runtime.model, runtime.scorer.model
    await asyncio.wait_for(engine.shutdown(), HANG)
    assert not engine._worker.thread.is_alive() and engine.active_request_ids == []
    assert wrappers_left(model) == [] and wrappers_left(draft) == []
    assert engine.stats()["densify"].entries == 0


async def test_densify_off_stores_only_the_sparse_turn():
    async with Engine(densify="off") as engine:
        _, messages = turns(engine.tokenizer, 7, 1500)
        await engine.generate(messages, max_tokens=4, specprefill=True)
        # a later request: its turns plan the first one's ending, where "idle" would
        # queue its densification
        await engine.generate("def f():", max_tokens=2, cache_prompt=False)
        entries = list(engine._worker.scheduler.indexes.target.entries.values())
        stats = engine.stats()["densify"]
        assert stats.tokens == 0 and stats.pending == 0 and stats.entries == 0
    assert len(entries) == 1 and entries[0].positions is not None


async def test_a_densified_entry_replaces_the_sparse_one_within_the_budget():
    budget = 16 << 20
    async with Engine(prefix_cache_bytes=budget) as engine:
        _, messages = turns(engine.tokenizer, 8, 1500)
        await engine.generate(messages, max_tokens=4, specprefill=True)
        await densified(engine)
        prefix = engine._worker.scheduler.indexes.target
        entries = list(prefix.entries.values())
        assert len(entries) == 1 and entries[0].positions is None and entries[0].densified
        assert prefix.total_bytes <= budget


async def test_densify_decode_runs_a_unit_beside_each_decode_step_and_leaves_the_reply_alone():
    """densify="decode": the previous turn densifies while the next request decodes its
    reply, at most one unit a turn (each unit's tokens at most one prefill unit); the reply
    is token for token the one without densify."""
    async with Engine(densify="decode") as engine:
        _, messages = turns(engine.tokenizer, 4, 2000)
        first = await engine.generate(messages, max_tokens=4, specprefill=True)
        assert first.specprefill.engaged
        other = make_case(engine.tokenizer, 5, "passkey", 400).messages
        reply = await engine.generate(other, max_tokens=64, ignore_eos=True, specprefill=False,
                                      cache_prompt=False)
        stats = engine.stats()["densify"]
        step = engine.info.step_size
        assert 1 <= stats.decode_units <= reply.usage.completion_tokens
        assert stats.tokens <= (stats.decode_units + 2) * step * 1.25 + 1
        await densified(engine)
    with Engine(densify="off") as plain:
        plain.generate_sync(messages, max_tokens=4, specprefill=True)
        alone = plain.generate_sync(other, max_tokens=64, ignore_eos=True, specprefill=False,
                                    cache_prompt=False)
    assert reply.token_ids == alone.token_ids


def test_densify_must_be_one_of_its_modes():
    with pytest.raises(ValueError, match="densify must be 'idle', 'decode' or 'off'"):
        Engine(densify="always")
