"""The prefix cache (its index and its tensors, driven together: `PrefixPair`) on every
cache type mlx-lm makes: plain KV cut anywhere, conv/SSM states and sliding windows
restored from checkpoints, sparse entries, byte budgets, merging."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import HYBRID_CASES, MAMBA, ROPE_CASES, build, kept_chunks, random_tokens
from specprefill_engine.core import chunked_prefill
from specprefill_engine.core.scoring import run_steps
from prefix_pair import PrefixPair
from specprefill_engine.engine.kv_store import reusable, snapshot, supported

CASES = {
    "qwen3": ROPE_CASES["qwen3"],
    "qwen3_next": HYBRID_CASES["qwen3_next"],
    "nemotron_h": HYBRID_CASES["nemotron_h"],
    "gemma3": HYBRID_CASES["gemma3-small-window"],  # window 64 < the prompts
    "gpt_oss": ("gpt_oss", {**ROPE_CASES["gpt_oss"][1], "sliding_window": 64}),
    "mamba": MAMBA,
}
_models = {}


def model_of(name: str):
    if name not in _models:
        _models[name] = build(CASES[name])
    return _models[name]


def tokens(length: int, seed: int) -> np.ndarray:
    return np.array(random_tokens(length, seed=seed), dtype=np.int32)


def feed(model, cache, ids, positions=None, step: int = 64) -> mx.array:
    """Prefill `ids` in chunks of `step`; the last token's logits."""
    steps = chunked_prefill(model, mx.array(ids), cache, step, positions, balanced=False)
    return run_steps(steps)[0, -1]


def decode(model, cache, ids) -> None:
    """Feed tokens one at a time, as decoding does."""
    for token in ids:
        mx.eval(model(mx.array([[int(token)]]), cache=cache))


def fresh(model, ids) -> mx.array:
    return feed(model, make_prompt_cache(model), ids)


def assert_same_logits(got: mx.array, want: mx.array) -> None:
    assert np.allclose(np.array(got), np.array(want), atol=1e-4)
    assert int(mx.argmax(got)) == int(mx.argmax(want))


def one_turn(model, prompt, reply, boundaries):
    """Prefill `prompt` with a snapshot at each boundary and at its end, decode
    `reply`; the cache and the snapshots."""
    cache, snapshots, start = make_prompt_cache(model), {}, 0
    for end in [*boundaries, prompt.size]:
        feed(model, cache, prompt[start:end])
        snapshots[end], start = snapshot(cache), end
    decode(model, cache, reply)
    return cache, snapshots


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next", "nemotron_h", "gemma3", "gpt_oss"])
def test_next_turn_continues_from_the_longest_restorable_prefix(name):
    model = model_of(name)
    prompt, reply = tokens(300, 1), tokens(12, 2)
    cache, snapshots = one_turn(model, prompt, reply, [90, 200])
    assert supported(cache) and reusable(cache) == (name == "qwen3")
    store = PrefixPair()
    store.store(np.concatenate([prompt, reply]), cache, checkpoints=snapshots)
    plain = name == "qwen3"
    turns = {  # next prompt -> (shared tokens, the cut a lookup must find)
        "diverges inside a message": (np.concatenate([prompt[:250], tokens(40, 3)]),
                                      250, 250 if plain else 200),
        "reply re-rendered": (np.concatenate([prompt, tokens(5, 4), reply, tokens(20, 5)]),
                              300, 300),
        "extends the reply": (np.concatenate([prompt, reply, tokens(30, 6)]), 312, 312),
    }
    for case, (ids, shared, cut) in turns.items():
        hit = store.find(ids)
        assert (hit.shared, hit.cut) == (shared, cut), case
        if cut < shared:
            assert hit.describe() == f"checkpoint at {cut} of {shared} shared tokens"
        for _ in range(2):  # a restore leaves the entry as it was
            restored, positions = store.restore(model, hit, hit.cut)
            assert positions is None
            assert_same_logits(feed(model, restored, ids[hit.cut:]), fresh(model, ids))


def test_lookup_prefers_the_longest_restorable_prefix_over_the_longest_shared():
    model = model_of("mamba")
    prompt = tokens(200, 1)
    reply = tokens(10, 2)
    early, snapshots = one_turn(model, prompt, reply, [60])  # shares 200, checkpoint at 60
    late, at_150 = one_turn(model, prompt[:150], tokens(10, 3), [])  # shares 150
    store = PrefixPair()
    store.store(np.concatenate([prompt, reply]), early, checkpoints={60: snapshots[60]})
    key = store.store(np.concatenate([prompt[:150], tokens(10, 3)]), late, checkpoints=at_150)
    hit = store.find(np.concatenate([prompt, tokens(10, 4)]))
    assert (hit.entry.key, hit.cut) == (key, 150)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next"])
def test_sparse_entry_restores_its_kept_entries_and_positions(name):
    model = model_of(name)
    prompt = tokens(300, 1)
    kept = np.array(kept_chunks(prompt.size))  # chunks 0, 1, 4, 7, ... and the last
    cache, snapshots, done = make_prompt_cache(model), {}, 0
    for boundary in (64, 150, 230):  # all kept entries before the boundary fed, none after
        upto = int(np.searchsorted(kept, boundary))
        feed(model, cache, prompt[kept[done:upto]], kept[done:upto])
        snapshots[boundary], done = snapshot(cache), upto
    feed(model, cache, prompt[kept[done:]], kept[done:])
    store = PrefixPair()
    store.store(prompt, cache, kept, snapshots)
    ids = np.concatenate([prompt[:250], tokens(40, 3)])

    hit = store.find(ids)
    cut = 250 if name == "qwen3" else 230
    assert hit.cut == cut and hit.describe().endswith(f"({np.sum(kept < cut)} entries)")
    restored, positions = store.restore(model, hit, cut)
    assert np.array_equal(positions, kept[kept < cut])
    rest = np.arange(cut, ids.size)
    got = feed(model, restored, ids[cut:], rest)
    again = make_prompt_cache(model)  # the same sparse sequence, fed fresh
    feed(model, again, prompt[positions], positions)
    assert_same_logits(got, feed(model, again, ids[cut:], rest))

    dense = store.find(ids, dense_only=True)  # kept holds 0..63 without gaps
    assert (dense.shared, dense.cut) == (64, 64)
    restored, positions = store.restore(model, dense, 64)
    assert positions is None
    assert_same_logits(feed(model, restored, ids[64:]), fresh(model, ids))


def _leaves(snap) -> list:
    return [x for _, state in snap.layers.values() for x in _flat(state)]


def _flat(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _flat(item)]
    return [tree] if isinstance(tree, mx.array) else []


def _address(x: mx.array) -> int:
    return np.asarray(x).__array_interface__["data"][0]


@pytest.mark.parametrize("name", ["gemma3", "nemotron_h"])
def test_snapshot_holds_the_live_arrays_without_a_copy_and_survives_writes(name):
    model = model_of(name)
    prompt, reply = tokens(100, 1), tokens(5, 2)
    cache = make_prompt_cache(model)
    feed(model, cache, prompt)
    decode(model, cache, reply[:2])  # a sliding window now takes writes in place
    snap = snapshot(cache)
    live = [x for i in snap.layers for x in _flat(cache[i].state)]
    held = _leaves(snap)
    assert [_address(x) for x in held] == [_address(x) for x in live]  # no copy
    before = [np.array(x) for x in held]
    decode(model, cache, reply[2:])
    assert all(np.array_equal(np.array(x), b) for x, b in zip(held, before))

    store = PrefixPair()
    store.store(np.concatenate([prompt, reply]), cache, checkpoints={102: snap})
    ids = np.concatenate([prompt, reply[:2], tokens(20, 3)])
    hit = store.find(ids)
    assert hit.cut == 102
    restored, _ = store.restore(model, hit, hit.cut)
    assert_same_logits(feed(model, restored, ids[102:]), fresh(model, ids))


def kv_bytes(cache, count: int) -> int:
    """Bytes of the first `count` entries of the plain KV layers."""
    return sum(c.keys[..., :count, :].nbytes + c.values[..., :count, :].nbytes
               for c in cache if type(c).__name__ == "KVCache")


def test_merging_moves_checkpoints_into_the_longer_entry():
    model = model_of("nemotron_h")
    prompt, reply = tokens(120, 1), tokens(6, 2)
    cache, snapshots = one_turn(model, prompt, [], [50, 90])
    store = PrefixPair()
    first = store.store(prompt, cache, checkpoints={50: snapshots[50]})
    assert set(store.entries[first].checkpoints) == {50, 120}  # the live state at 120
    decode(model, cache, reply)
    second = store.store(np.concatenate([prompt, reply]), cache, checkpoints={90: snapshots[90]})
    entry = store.entries[second]
    assert list(store.entries) == [second] and second != first
    assert list(entry.checkpoints) == [50, 90, 120, 126]
    assert store.total_bytes == entry.nbytes == kv_bytes(cache, 126) + sum(
        s.nbytes for s in store.held(second).checkpoints.values())
    # the same prompt again: already held, nothing copied, only touched
    again, _ = one_turn(model, prompt, [], [])
    assert store.store(prompt, again) == second and store.total_bytes == entry.nbytes
    # a sparse entry that kept other positions is not merged with the dense one
    kept = np.array(kept_chunks(prompt.size))
    sparse = make_prompt_cache(model)
    feed(model, sparse, prompt[kept], kept)
    assert store.store(prompt, sparse, kept) not in (None, second) and len(store.entries) == 2


def test_checkpoints_per_entry_are_bounded_to_the_longest():
    model = model_of("mamba")
    prompt = tokens(100, 1)
    cache, snapshots = one_turn(model, prompt, [], list(range(5, 100, 5)))
    store = PrefixPair(max_checkpoints=4)
    key = store.store(prompt, cache, checkpoints=snapshots)
    assert list(store.entries[key].checkpoints) == [85, 90, 95, 100]
    assert store.total_bytes == 4 * snapshots[100].nbytes


def test_budget_evicts_least_recently_used_and_refuses_oversize_entries():
    model = model_of("qwen3_next")
    prompts = [tokens(80, seed) for seed in (1, 2, 3)]
    turns = [one_turn(model, p, [], [40]) for p in prompts]
    size = kv_bytes(turns[0][0], 80) + 2 * turns[0][1][80].nbytes
    store = PrefixPair(max_bytes=int(2.5 * size))
    a, b = (store.store(p, c, checkpoints={40: s[40]}) for p, (c, s) in zip(prompts[:2], turns))
    assert store.total_bytes == 2 * size
    hit = store.find(np.concatenate([prompts[0][:60], tokens(5, 9)]))
    assert hit.entry.key == a and list(store.entries) == [a, b]  # a lookup changes nothing
    store.touch(a)  # a restore uses it
    c = store.store(prompts[2], turns[2][0], checkpoints={40: turns[2][1][40]})
    assert store.total_bytes == 3 * size  # a store never evicts: the caller drops
    assert store.evictions() == [b] and store.evictions(pinned={b}) == [a]
    for key in store.evictions():
        store.drop(key)
    assert list(store.entries) == [a, c] and store.total_bytes == 2 * size

    small = PrefixPair(max_bytes=size - 1)
    assert small.store(prompts[0], turns[0][0], checkpoints={40: turns[0][1][40]}) is None
    assert not small.entries and small.total_bytes == 0
    assert small.store(prompts[0], turns[0][0]) is not None  # without the checkpoint it fits


def test_the_same_calls_give_the_same_entries_and_keys():
    """A sharded engine's ranks make the same calls: they must end up with the same
    entries under the same keys (evictions included)."""
    model = model_of("qwen3")
    stores = [PrefixPair(), PrefixPair()]
    for seed in range(4):
        ids = tokens(64, seed)
        cache = make_prompt_cache(model)
        feed(model, cache, ids)
        for store in stores:
            store.max_bytes = 2 * kv_bytes(cache, 64)  # room for two
            store.store(ids, cache)
            if seed == 2:
                store.touch(next(iter(store.entries)))
            for key in store.evictions():
                store.drop(key)
        assert list(stores[0].entries) == list(stores[1].entries)
    assert len(stores[0].entries) == 2


@pytest.mark.parametrize("name", ["mamba", "nemotron_h"])
def test_one_hundred_agent_turns_keep_memory_flat(name):
    model = model_of(name)
    store = PrefixPair()
    history = np.zeros(0, np.int32)
    checkpoint_bytes = []
    for turn in range(100):
        prompt = np.concatenate([history, tokens(8, 2 * turn + 1)])
        hit = store.find(prompt)
        assert (hit.cut if hit else 0) == history.size
        cache, _ = store.restore(model, hit, history.size)
        feed(model, cache, prompt[history.size:])
        at_prompt_end = snapshot(cache)
        reply = tokens(4, 2 * turn + 2)
        decode(model, cache, reply)
        history = np.concatenate([prompt, reply])
        store.store(history, cache, checkpoints={prompt.size: at_prompt_end})
        (entry,) = store.entries.values()
        assert len(entry.checkpoints) <= 16
        checkpoint_bytes.append(store.total_bytes - kv_bytes(cache, history.size))
    assert checkpoint_bytes[-1] == checkpoint_bytes[10] == 16 * at_prompt_end.nbytes
    ids = np.concatenate([history, tokens(8, 999)])
    restored, _ = store.restore(model, store.find(ids), history.size)
    assert_same_logits(feed(model, restored, ids[history.size:]), fresh(model, ids))


def test_bad_cuts_and_checkpoints_are_named():
    model = model_of("qwen3_next")
    prompt = tokens(100, 1)
    cache, snapshots = one_turn(model, prompt, [], [40])
    store = PrefixPair()
    with pytest.raises(ValueError, match="checkpoints: length 101"):
        store.store(prompt, cache, checkpoints={101: snapshots[40]})
    with pytest.raises(ValueError, match="checkpoints: the snapshot at 50 was taken after 40"):
        store.store(prompt, cache, checkpoints={50: snapshots[40]})
    with pytest.raises(ValueError, match="positions"):
        store.store(prompt, cache, positions=np.array([3, 2, 3]))  # one position twice
    store.store(prompt, cache, checkpoints={40: snapshots[40]})
    hit = store.find(np.concatenate([prompt[:60], tokens(5, 2)]))
    assert hit.cut == 40 and hit.entry.restorable(39) == 0
    with pytest.raises(ValueError, match="cut 50 is not restorable"):
        store.restore(model, hit, 50)
