"""A turn as data: the plan carries every prefix-cache decision (the planner's index
decides keys, absorptions and evictions; the executor holds the tensors under those
keys), and it travels to the other ranks whole."""

import numpy as np
import pytest

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.plan import (
    Join, PrefillChunk, Restore, Store, TurnPlan, decode_plan, encode_plan,
)

pytestmark = pytest.mark.timeout(600)


def test_a_plan_crosses_to_the_other_ranks_with_every_decision():
    plan = TurnPlan(
        stores=[Store(3, np.arange(7, dtype=np.int32), np.array([0, 1, 4, 6]), 0.25, True,
                      key=9, absorbs=[2, 5]),
                Store(4, np.arange(5, dtype=np.int32), key=9, into=True)],
        drops=[1], releases=[3], joins=[Join(4, 11, 5, solo=True)], decode=True,
        restores=[Restore(5, 9, 6, 3, np.array([0, 1, 4])), Restore(6)],
        chunks=[PrefillChunk(5, np.array([8, 9], dtype=np.int32), np.array([6, 7]),
                             last=True, checkpoint=8)])
    got = decode_plan(encode_plan(plan))
    for want, have in zip(plan.stores, got.stores):
        assert (have.handle, have.key, have.into, list(have.absorbs), have.keep,
                have.densified) == (want.handle, want.key, want.into, want.absorbs, want.keep,
                                    want.densified)
        assert np.array_equal(have.tokens, want.tokens)
        assert (have.positions is None) == (want.positions is None)
    assert np.array_equal(got.stores[0].positions, plan.stores[0].positions)
    for want, have in zip(plan.restores, got.restores):
        assert (have.handle, have.key, have.cut, have.count) == \
            (want.handle, want.key, want.cut, want.count)
        assert (have.positions is None) == (want.positions is None)
    assert np.array_equal(got.restores[0].positions, [0, 1, 4])
    assert (got.drops, got.releases, got.decode) == ([1], [3], True)
    assert (got.joins[0].handle, got.joins[0].token, got.joins[0].length) == (4, 11, 5)
    assert np.array_equal(got.chunks[0].positions, [6, 7]) and got.chunks[0].last


async def settled(engine) -> None:
    """A request's cache is stored in a turn after its result: one more request, which
    stores nothing, comes back after that turn."""
    await engine.generate("x", max_tokens=1, cache_prompt=False)


async def test_the_index_and_the_tensors_hold_the_same_entries_across_turns():
    """Three dense turns of one chat (a later one absorbing the first), a SpecPrefill chat
    and a third under a budget that evicts: the planner's index and the executor's tensors name
    the same entries, and the index counts their bytes."""
    budget = 16 << 20
    async with Engine(prefix_cache_bytes=budget, densify="off") as engine:
        index = engine._worker.scheduler.indexes.target
        held = engine._worker.executor.prefix.held
        messages = list(make_case(engine.tokenizer, 4, "passkey", 1200).messages)
        for turn in range(3):
            result = await engine.generate(messages, max_tokens=4, specprefill=False)
            assert result.usage.cached_tokens > 0 or turn == 0
            messages = messages + [{"role": "assistant", "content": result.text},
                                   {"role": "user", "content": f"And again ({turn})?"}]
            await settled(engine)
            if turn == 0:
                first = list(index.entries)
        assert len(first) == 1 and first[0] not in index.entries  # absorbed by a later turn
        (chat,) = index.entries
        sparse = await engine.generate(make_case(engine.tokenizer, 5, "passkey", 1200).messages,
                                       max_tokens=4, specprefill=True)
        assert sparse.specprefill.engaged
        await engine.generate(make_case(engine.tokenizer, 6, "passkey", 1200).messages,
                              max_tokens=4, specprefill=False)
        await settled(engine)
        entries = list(index.entries.values())
        assert chat not in index.entries  # evicted: the least recently used
        assert any(e.positions is not None for e in entries) and len(entries) == 2
        assert set(index.entries) == set(held)
        assert index.total_bytes == sum(h.nbytes for h in held.values()) <= budget
        for key, entry in index.entries.items():
            assert tuple(held[key].checkpoints) == entry.checkpoints
            assert entry.nbytes == held[key].nbytes
