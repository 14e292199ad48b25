"""A later turn repairs the stored sparse view instead of selecting the prompt anew: the
passages its selection wants and the view lacks are fed at their true positions (after
entries of later positions, attending by position), then the new tokens."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine import Engine
from specprefill_engine.core.prefill import prefill_chunk
from specprefill_engine.core.windows import SlidingWindows
from specprefill_engine.demo_tasks import make_agent_session

pytestmark = pytest.mark.timeout(600)


def masked_forward(model, ids: np.ndarray, sees: np.ndarray):
    """One dense forward of all of `ids` in which query q sees key k where sees[q, k]
    (and k <= q): the reference for a cache built in pieces. Returns the cache."""
    module = sys.modules[type(model).__module__]
    attention = module.scaled_dot_product_attention
    mask = mx.array(sees & np.tril(np.ones_like(sees)))

    def masked(queries, keys, values, cache, scale, **kwargs):
        kwargs["mask"] = mask
        return attention(queries, keys, values, cache=cache, scale=scale, **kwargs)

    cache = make_prompt_cache(model)
    module.scaled_dot_product_attention = masked
    try:
        mx.eval(model(mx.array(ids)[None], cache=cache))
    finally:
        module.scaled_dot_product_attention = attention
    return cache


def test_a_repaired_passage_attends_by_position_as_a_masked_dense_forward(demo_pair):
    """Turn 1 kept `held`; the repair feeds `added` (before some of held) and `new` (the
    turn's new tokens). Every entry's keys and values, and the last logits, equal one
    dense forward whose mask lets held tokens see held ones and the fed ones see all kept
    (each causally by position), float32, within 1e-4."""
    target, _, _ = demo_pair
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 4000, 700)
    held = np.concatenate([np.arange(0, 100), np.arange(250, 400), np.arange(520, 600)])
    added = np.concatenate([np.arange(130, 190), np.arange(430, 470)])
    new = np.arange(600, 700)
    cache = make_prompt_cache(target)
    prefill_chunk(target, mx.array(ids[held]), cache, held)
    windows = SlidingWindows(cache, held)
    fed = np.concatenate([added, new])
    for start in range(0, fed.size, 64):  # chunks that cross the held passages
        chunk = fed[start : start + 64]
        logits = prefill_chunk(target, mx.array(ids[chunk]), cache, chunk, want_logits=True,
                               windows=windows)
    order = np.concatenate([held, fed])
    sees = np.zeros((ids.size, ids.size), dtype=bool)
    sees[np.ix_(held, held)] = True
    sees[np.ix_(fed, order)] = True
    sees[np.arange(ids.size), np.arange(ids.size)] = True  # dropped tokens: themselves only
    reference = masked_forward(target, ids, sees)
    for layer, ref in zip(cache, reference):
        keys, values = layer.keys, layer.values
        assert mx.abs(keys[..., : order.size, :] - ref.keys[..., mx.array(order), :]).max().item() < 1e-4
        assert mx.abs(values[..., : order.size, :] - ref.values[..., mx.array(order), :]).max().item() < 1e-4
    whole = target(mx.array(ids[-1:])[None], cache=make_prompt_cache(target))  # shape only
    assert logits.shape[-1] == whole.shape[-1]


def test_every_layer_of_a_repair_forward_reads_one_mask_by_position(demo_pair):
    """Tokens fed before entries of later positions: each plain layer's mask is the same
    array, built once for the forward (not a chunk-by-cache array per layer on the
    host), and it is the causal mask by position."""
    target, _, _ = demo_pair
    held = np.concatenate([np.arange(0, 100), np.arange(250, 400)])
    cache = make_prompt_cache(target)
    prefill_chunk(target, mx.array(np.arange(10, 10 + held.size)), cache, held)
    windows = SlidingWindows(cache, held)
    chunk = np.concatenate([np.arange(130, 160), np.arange(400, 410)])
    with windows.by_position(chunk):
        masks = [layer.make_mask(chunk.size) for layer in windows.plain]
    assert len(masks) == len(target.layers) and all(m is masks[0] for m in masks)
    keys = np.concatenate([held, chunk])
    assert np.array_equal(np.array(masks[0]), keys[None] <= chunk[:, None])
    assert all("make_mask" not in vars(layer) for layer in windows.plain)  # removed after


def test_a_later_turn_gets_the_passage_its_question_needs_for_new_and_repaired_tokens(
        demo_pair, fresh_cache_dir):
    """The question of turn 2 is about a fact turn 1's selection dropped: the report says
    the view was repaired, the answer is dense's, and the target computes only the
    repaired and the new kept tokens (counted: kept entries minus those restored), fewer
    than a fresh selection of the same prompt computes."""
    _, _, tokenizer = demo_pair
    session = make_agent_session(tokenizer, 3, 4000, 2)
    # a strict gate: the stored view wants a repair
    with Engine(densify="off", reuse_coverage=0.999) as engine:
        first = engine.generate_sync(session.messages(0, []), max_tokens=8, specprefill=True)
        costs = engine._worker.runtime.costs
        dense_points = len(costs.target)
        messages = session.messages(1, [first.text])
        second = engine.generate_sync(messages, max_tokens=8, specprefill=True)
        # the repaired prefill is timed as a repair, apart from the causal ones
        assert (len(costs.repair), len(costs.target)) == (1, dense_points)
    with Engine(densify="off") as fresh_engine:
        fresh = fresh_engine.generate_sync(messages, max_tokens=8, specprefill=True)
    with Engine(draft=None) as dense_engine:
        dense = dense_engine.generate_sync(messages, max_tokens=8)
    report = second.specprefill
    assert "repaired: +" in report.reuse, report.reuse
    added = int(report.reuse.split("chunks (")[1].split(" tokens")[0])
    computed = report.kept_tokens - second.usage.cached_tokens
    assert added < computed < fresh.specprefill.kept_tokens
    assert fresh.usage.cached_tokens == 0
    assert second.text == dense.text and session.answers[1] in second.text


def test_repair_is_chosen_whenever_it_covers_the_new_selection(demo_pair, fresh_cache_dir):
    """Over an agent's turns on a plain model, no turn selects anew: each repairs or
    extends the stored view (decision counts)."""
    _, _, tokenizer = demo_pair
    session = make_agent_session(tokenizer, 11, 2000, 4)
    decisions, replies = [], []
    with Engine(densify="off") as engine:
        for step in range(4):
            result = engine.generate_sync(session.messages(step, replies), max_tokens=8,
                                          specprefill=True)
            replies.append(result.text)
            decisions.append(result.specprefill.reuse)
    assert not any(d.startswith("selected anew") for d in decisions), decisions
    assert all(d.startswith("sparse") for d in decisions[1:]), decisions
