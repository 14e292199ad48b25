"""The core on the trained demo pair: scoring, selection, exactness, quality."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.benchmarking import answer_text, dense_answer, random_selection, sparse_answer
from specprefill_engine.core import cleanup_rope, score_tokens, select_chunks, sparse_prefill
from specprefill_engine.demo_tasks import make_case


def prompt_ids(tokenizer, seed, kind="passkey", n_tokens=2048):
    case = make_case(tokenizer, seed, kind, n_tokens)
    return case, tokenizer.apply_chat_template(case.messages, add_generation_prompt=True)


def greedy_after(model, logits, cache, n):
    tokens = [mx.argmax(logits, axis=-1).item()]
    while len(tokens) < n:
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
        tokens.append(mx.argmax(logits, axis=-1).item())
    return tokens


def dense_greedy(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n, prefill_step_size=512)]


def sparse_greedy(model, ids, kept, n):
    cache = make_prompt_cache(model)
    try:
        return greedy_after(model, sparse_prefill(model, ids, kept, cache, step_size=512), cache, n)
    finally:
        cleanup_rope(model)


def test_select_chunks_keeps_first_chunk_tail_and_budget():
    importance = mx.zeros(1000).at[500:520].add(1.0)
    kept = np.array(select_chunks(importance, keep_pct=0.2, chunk_size=32, tail_tokens=40,
                                  sink_tokens=32))
    kept_set = set(kept.tolist())
    assert set(range(32)) <= kept_set  # the first chunk
    assert set(range(960, 1000)) <= kept_set  # the last 40 tokens
    # 72 forced tokens leave 128 of the 200-token budget: too few for 8 chunks of 32, so
    # chunks of 16; the two holding the important tokens are kept
    assert set(range(496, 528)) <= kept_set
    assert kept.size == 72 + 8 * 16
    assert np.all(np.diff(kept) > 0) and kept[-1] == 999
    assert select_chunks(importance, keep_pct=1.0).size == 1000
    # a larger budget keeps whole 32-token chunks
    wide = np.array(select_chunks(importance, keep_pct=0.5, chunk_size=32, tail_tokens=40,
                                  sink_tokens=32))
    assert set(range(480, 544)) <= set(wide.tolist())
    assert wide.size == 72 + 14 * 32


def test_select_chunks_grid_is_anchored_at_absolute_positions():
    rng = np.random.default_rng(0)
    importance = rng.random(3000).astype(np.float32)
    for start in (0, 5, 37, 100):
        kept = np.array(select_chunks(importance[start:], 0.2, chunk_size=32, tail_tokens=32,
                                      start=start, min_chunk_size=32)) + start
        free = kept[(kept >= 32) & (kept < 3000 - 32)]  # outside the sink and the tail
        assert np.all(np.isin(free // 32, np.unique(free // 32)))
        counts = np.bincount(free // 32)
        assert set(counts[counts > 0].tolist()) == {32}  # whole absolute chunks only
    # a few cached tokens do not move which chunks win
    base = np.array(select_chunks(importance, 0.2, start=0, min_chunk_size=32))
    shifted = np.array(select_chunks(importance[7:], 0.2, start=7, min_chunk_size=32)) + 7
    middle = lambda k: set(k[(k >= 64) & (k < 2900)].tolist())
    assert middle(base) == middle(shifted)
    # with start past the sink, no first chunk is forced
    late = np.r_[np.zeros(32), np.ones(468)].astype(np.float32)
    assert np.array(select_chunks(late, 0.1, start=1000))[0] >= 32


def test_select_chunks_must_keep_is_on_top_of_the_budget():
    length = 2000
    importance = mx.zeros(length).at[1500:1510].add(1.0)
    must = np.zeros(length, dtype=bool)
    must[100:500] = True  # a 400-token system prompt
    kept = np.array(select_chunks(importance, 0.1, must_keep=must))
    assert set(range(100, 500)) <= set(kept.tolist())
    assert set(range(1500, 1510)) <= set(kept.tolist())
    others = np.setdiff1d(kept, np.arange(100, 500))
    budget = int(np.ceil(0.1 * (length - 400)))  # 160: 40 forced + 120 free = 15 chunks of 8
    assert budget <= others.size < budget + 8
    with pytest.raises(ValueError):
        select_chunks(importance, 0.1, must_keep=must[:10])


def test_select_chunks_is_deterministic_with_ties():
    flat = np.ones(4096, dtype=np.float32)
    first = np.array(select_chunks(flat, 0.1))
    assert np.array_equal(first, np.array(select_chunks(mx.array(flat), 0.1)))
    # ties go to the earliest chunks after the sink
    assert np.array_equal(first[:40], np.arange(40))


def test_select_chunks_backbone_and_bad_keep():
    importance = mx.zeros(3200)
    kept = np.array(select_chunks(importance, keep_pct=0.1, backbone_pct=0.1, tail_tokens=32,
                                  sink_tokens=32))
    assert len(set((kept // 32).tolist())) == 10
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            select_chunks(importance, keep_pct=bad)


def test_score_tokens_is_finite_deterministic_and_cancellable(demo_pair):
    _, draft, tokenizer = demo_pair
    _, ids = prompt_ids(tokenizer, 0, n_tokens=600)
    calls = []
    first = score_tokens(draft, ids, step_size=256, cancel_check=lambda: calls.append(1))
    second = score_tokens(draft, ids, step_size=256)
    assert first.shape == (len(ids),) and first.dtype == mx.float32
    assert mx.all(mx.isfinite(first)).item()
    assert mx.array_equal(first, second)
    assert len(calls) >= 4  # prefill chunks, the capturing chunk, the reduction

    def cancel():
        raise TimeoutError("stop")

    with pytest.raises(TimeoutError):
        score_tokens(draft, ids, cancel_check=cancel)
    assert mx.array_equal(score_tokens(draft, ids, step_size=256), first)


def test_keep_all_gives_mlx_lm_dense_greedy_tokens(demo_pair):
    target, draft, tokenizer = demo_pair
    _, ids = prompt_ids(tokenizer, 1, n_tokens=700)
    kept = select_chunks(score_tokens(draft, ids), keep_pct=1.0)
    assert sparse_greedy(target, ids, kept, 12) == dense_greedy(target, ids, 12)


def test_no_state_leaks_after_sparse_or_failed_requests(demo_pair):
    target, draft, tokenizer = demo_pair
    _, ids = prompt_ids(tokenizer, 2, n_tokens=700)
    reference = dense_greedy(target, ids, 8)
    sparse_greedy(target, ids, select_chunks(score_tokens(draft, ids), 0.3), 4)
    assert dense_greedy(target, ids, 8) == reference

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        sparse_prefill(target, ids, mx.arange(len(ids)), make_prompt_cache(target),
                       step_size=128, cancel_check=fail)
    assert dense_greedy(target, ids, 8) == reference


def test_passkey_quality_at_keep_30_percent(demo_pair):
    """SpecPrefill keeps the needle; a random selection of the same size does not.

    Six 1.5K-token cases: dense and SpecPrefill answer all six, a random selection of
    the same size two. A selection that ignores the draft's scores fails the second
    bound (keeping the lowest-scored chunks answers one of the six)."""
    target, draft, tokenizer = demo_pair
    eos = set(tokenizer.eos_token_ids)
    rng = random.Random(0)
    dense_right = both_right = random_right = 0
    n_cases = 6
    for seed in range(n_cases):
        case, ids = prompt_ids(tokenizer, 100 + seed, "passkey", 1536)
        n = len(case.answer) + 1

        def right(tokens):
            return answer_text(tokenizer, tokens) == case.answer

        dense_ok = right(dense_answer(target, ids, n, eos, step_size=512))
        kept = select_chunks(score_tokens(draft, ids), keep_pct=0.3)
        sparse_ok = right(sparse_answer(target, ids, kept, n, eos, step_size=512))
        control = random_selection(rng, len(ids), kept.size, keep_pct=0.3)
        random_right += right(sparse_answer(target, ids, control, n, eos, step_size=512))
        dense_right += dense_ok
        both_right += dense_ok and sparse_ok
    print(f"dense {dense_right}/{n_cases}, both {both_right}, random {random_right}")
    assert dense_right >= 0.8 * n_cases
    assert both_right >= 0.9 * dense_right
    assert random_right <= 0.5 * dense_right


@pytest.mark.parametrize("balanced", [False, True])
def test_chunked_prefill_last_logits_whatever_the_chunking(demo_pair, balanced):
    """Fixed or cost-balanced chunks, a prompt that is no multiple of the step: the
    last token's logits equal one forward's, a prefix cut on the grid is a chunk end
    of every longer prompt (so a cached prefix continues in the same chunks as from
    scratch), and a small last chunk runs without a pause before it."""
    from specprefill_engine.core import chunked_prefill
    from specprefill_engine.core.prefill import chunk_plan, prefill_weight

    target, _, _ = demo_pair
    ids = mx.array(np.random.default_rng(3).integers(10, 4000, 720))
    whole = target(ids[None], cache=make_prompt_cache(target))[:, -1:, :]
    steps = chunked_prefill(target, ids, make_prompt_cache(target), 256, balanced=balanced)
    ends = []
    while True:
        try:
            ends.append(next(steps)[0])
        except StopIteration as done:
            logits = done.value
            break
    assert logits is not None and logits.shape == (1, 1, whole.shape[-1])
    assert mx.abs(logits - whole).max().item() <= 1e-4
    weight = prefill_weight(target, balanced)
    plan = chunk_plan(720, 0, 256, weight)
    assert ends == [end for end, pause in plan if pause]
    chunks = [end for end, _ in plan]
    if balanced:  # later chunks see more entries: they are smaller; 702 -> 720 is small
        assert chunks == [256, 488, 702, 720] and ends == [256, 488, 720]
    else:
        assert chunks == ends == [256, 512, 720]
    grid = [end for end, _ in chunk_plan(100_000, 0, 256, weight)]  # a prefill from 0
    for shared in range(1, 721):
        cut = max([0, *(end for end in grid if end <= shared)])
        assert cut <= shared and (cut == 0 or cut in chunks), shared


@pytest.fixture(scope="module")
def long_ids_and_logits(demo_pair):
    """2400 random ids and the demo target's last logits for them in one forward (both
    cuts below compare with it; the forward takes seconds on a CPU)."""
    target, _, _ = demo_pair
    ids = mx.array(np.random.default_rng(5).integers(10, 4000, 2400))
    whole = target(ids[None], cache=make_prompt_cache(target))[:, -1:, :]
    mx.eval(whole)
    return ids, whole


@pytest.mark.parametrize("cut, ends", [(700, [1024, 1536, 2048, 2400]), (900, [1536, 2048, 2400])])
def test_continued_prefill_runs_the_chunks_of_a_prefill_from_zero(demo_pair, long_ids_and_logits,
                                                                 cut, ends):
    """After a cached prefix of `cut` entries the chunks end on the grid of a prefill
    from 0 (a first piece of at most a quarter unit joins the next chunk), and every
    chunk's keys are a buffer of exactly its end length: a GPU, which plans attention
    per shape and stride, then meets the shapes of earlier prompts. Logits unchanged."""
    from specprefill_engine.core import chunked_prefill

    target, _, _ = demo_pair
    ids, whole = long_ids_and_logits
    cache = make_prompt_cache(target)
    target(ids[None, :cut], cache=cache)  # mlx-lm's own growth: a buffer of 768 or 1024
    steps = chunked_prefill(target, ids[cut:], cache, 512, balanced=False)
    seen = []
    while True:
        try:
            done, _ = next(steps)
        except StopIteration as stop:
            logits = stop.value
            break
        seen.append(cut + done)
        assert all(layer.keys.shape[2] == layer.offset == cut + done for layer in cache)
    assert seen == ends
    assert mx.abs(logits - whole).max().item() <= 1e-4


@pytest.mark.parametrize("n_window", [1, 100])
def test_scoring_progress_ends_at_its_total(demo_pair, n_window):
    """A window that pulls the capturing chunk back leaves a small last prefill chunk,
    which runs without a yield of its own: the count of units must know that."""
    from specprefill_engine.core.scoring import score_steps

    _, draft, _ = demo_pair
    steps = score_steps(draft, mx.array(np.random.default_rng(0).integers(10, 4000, 386)),
                        step_size=128, n_window=n_window)
    yields = []
    while True:
        try:
            yields.append(next(steps))
        except StopIteration:
            break
    total = yields[-1][1]
    assert yields == [(done, total) for done in range(1, total + 1)]


def test_spread_forward_raises_each_token_to_the_best_before_it_but_not_the_quiet():
    from specprefill_engine.core.selection import spread_forward

    values = np.array([9.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 1, 0], np.float32)
    quiet = np.arange(values.size) < 1
    # position 0 (quiet) keeps its own value and passes nothing on; 10 reaches 11-13
    assert spread_forward(values, 3, quiet).tolist() == [9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5,
                                                         5, 1, 1]
    assert spread_forward(values, 0, quiet).tolist() == values.tolist()


def test_the_spread_keeps_what_follows_a_peak_within_an_eighth_of_the_budget():
    """One sharp peak: the chunks after it rank with it, as far as the free budget's
    eighth reaches; without spread only the peak's own chunk is kept."""
    values = np.full(4096, 0.01, np.float32)
    values[1000] = 1.0  # the peak
    values[3000:3100] = 0.5  # a broad second passage
    spread = np.asarray(select_chunks(values, 0.1))  # free budget 370: width 46
    flat = np.asarray(select_chunks(values, 0.1, spread=0))
    assert np.isin(np.arange(1000, 1047), spread).all()
    assert not np.isin(np.arange(1000, 1047), flat).all()
    short = np.full(600, 0.01, np.float32)
    short[300] = 1.0
    kept = np.asarray(select_chunks(short, 0.2))  # free budget 80: width 10
    assert np.isin(np.arange(300, 311), kept).all()
    assert not np.isin(np.arange(330, 340), kept).any()


def test_a_block_between_blank_lines_is_kept_whole_or_not_at_all():
    """A function's body ranks high, its `def` line and the neighbours' bodies low: on the
    grid a chunk may hold the end of one function and the start of the next, so the view
    glues one body to another's name; with `starts` (blank lines) each block is a unit.
    A block longer than `longest_block` chunks is cut on the grid."""
    values = np.full(2048, 0.01, np.float32)
    starts = np.zeros(2048, bool)
    starts[np.arange(0, 2048, 40)] = True  # blocks of 40 tokens
    values[1220:1240] = 1.0  # the second half of the block at 1200-1240
    values[1240:1250] = 0.5  # the next block's first tokens
    blocks = np.asarray(select_chunks(values, 0.1, starts=starts, spread=0))
    grid = np.asarray(select_chunks(values, 0.1, spread=0))
    held = [np.isin(np.arange(a, a + 40), blocks).mean() for a in range(40, 1960, 40)]
    assert set(held) <= {0.0, 1.0} and np.isin(np.arange(1200, 1250), blocks).all()
    assert not np.isin(np.arange(1200, 1216), grid).all()  # the grid cut the block
    long = np.zeros(2048, bool)
    long[[0, 1024]] = True  # two blocks far longer than 4 chunks
    cut = np.asarray(select_chunks(values, 0.1, starts=long, spread=0))
    assert np.array_equal(cut, grid)


def test_the_tail_begins_with_the_first_block_that_starts_inside_it():
    """The last 32 tokens are always kept; where the question's block starts inside
    them, the end of the block before it (a function's bare `return`) is not kept alone:
    it stays with its block, here left out."""
    values = np.full(2048, 0.01, np.float32)
    starts = np.zeros(2048, bool)
    starts[np.arange(0, 2048, 40)] = True
    starts[2030] = True  # the question: the last 18 tokens
    values[1200:1240] = 1.0
    kept = np.asarray(select_chunks(values, 0.1, starts=starts, spread=0))
    assert np.isin(np.arange(2030, 2048), kept).all()
    assert not np.isin(np.arange(2000, 2030), kept).any()
    assert np.isin(np.arange(1200, 1240), kept).all()
    grid = np.asarray(select_chunks(values, 0.1, spread=0))
    assert np.isin(np.arange(2016, 2030), grid).all()  # the grid keeps the last 32
