"""Continuous batching: rows join and leave one shared decode, sparse and dense
together, each at its own positions, with its own sampling."""

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import ROPE_CASES, build, kept_chunks, random_tokens, tiny_model, wrappers_left
from specprefill_engine import Engine
from specprefill_engine.core import sparse_prefill_steps
from specprefill_engine.core.scoring import run_steps
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.core.prefill import align_buffers, prefill_chunk
from specprefill_engine.engine import batch as batch_module
from specprefill_engine.engine.batch import DecodeBatch, as_batch_of_one, batching_support
from specprefill_engine.engine.state import Status

pytestmark = pytest.mark.timeout(600)


def chat(tokenizer, seed, n_tokens, kind="passkey"):
    return make_case(tokenizer, seed, kind, n_tokens).messages



async def submit_in_order(engine, requests: list) -> list:
    """Start requests one after another (each submitted before the next), so the
    first-come-first-served prefill order is the list's order; run them together."""
    tasks = []
    for index, (prompt, options) in enumerate(requests):
        request_id = f"r{index}-{id(requests)}"
        tasks.append(asyncio.create_task(engine.generate(prompt, request_id=request_id, **options)))
        while request_id not in engine.active_request_ids and not tasks[-1].done():
            await asyncio.sleep(0.005)
    return await asyncio.gather(*tasks)


async def test_eight_mixed_requests_batched_equal_each_run_alone():
    async with Engine(threshold=256) as solo_engine, Engine(threshold=256) as batch_engine:
        tokenizer = solo_engine.tokenizer
        base = chat(tokenizer, 40, 600)
        follow = [{"role": "assistant", "content": "noted"},
                  {"role": "user", "content": "What is the secret passkey?"}]
        requests = [
            (chat(tokenizer, 41, 300), {"specprefill": False, "max_tokens": 12}),
            (chat(tokenizer, 42, 900), {"specprefill": True, "keep": 0.1, "max_tokens": 8}),
            (chat(tokenizer, 43, 1200), {"specprefill": True, "keep": 0.3, "max_tokens": 20}),
            (base + follow, {"specprefill": False, "max_tokens": 10}),  # cached prefix
            (chat(tokenizer, 44, 500), {"specprefill": False, "max_tokens": 30}),
            (base + follow[:1] + [{"role": "user", "content": chat(tokenizer, 45, 700)[0]["content"]}],
             {"specprefill": True, "keep": 0.3, "max_tokens": 9}),  # shares the cached prefix
            ("import os\n\n\ndef main():\n", {"specprefill": False, "max_tokens": 40}),
            (chat(tokenizer, 46, 400), {"specprefill": True, "keep": 0.1, "max_tokens": 16}),
        ]
        for engine in (solo_engine, batch_engine):  # the same cached prefix in both
            await engine.generate(base, max_tokens=2, specprefill=False)
        alone = [await solo_engine.generate(p, **o) for p, o in requests]
        together = await submit_in_order(batch_engine, requests)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(r.specprefill.batched for r in together)
    assert together[3].usage.cached_tokens > 450  # reused the prefix, cut to the chunk grid
    assert together[5].specprefill.engaged and together[1].specprefill.engaged


@pytest.mark.parametrize("name", ["llama", "llama-traditional", "llama-linear", "llama3", "yarn"])
def test_a_sparse_row_in_a_batch_decodes_at_its_true_positions(name):
    """Layer-0 keys of a sparse row's decode tokens equal the dense model's at M + t,
    next to a dense row of another length, with nothing wrapped on the model."""
    model = build(ROPE_CASES[name])
    assert batching_support(model) == ""
    M, steps = 300, 5
    tokens = random_tokens(M, seed=3)
    decode = mx.array([7, 11, 13, 17, 19])
    dense = make_prompt_cache(model)
    model(tokens[None], cache=dense)
    for t in range(steps):
        model(decode[t : t + 1][None], cache=dense)
    expected = dense[0].keys[..., M : M + steps, :]

    sparse = make_prompt_cache(model)
    kept = kept_chunks(M)
    _, shift = run_steps(sparse_prefill_steps(model, tokens, kept, sparse, step_size=64))
    other = make_prompt_cache(model)
    model(random_tokens(123, seed=4)[None], cache=other)
    batch = as_batch_of_one(other, 0)
    for layer, row in zip(batch, as_batch_of_one(sparse, shift)):
        layer.extend(row)
    assert wrappers_left(model) == []
    for t in range(steps):
        model(mx.stack([decode[t : t + 1], decode[t : t + 1]]), cache=batch)
    got = batch[0].keys[1:2, :, batch[0]._idx - steps : batch[0]._idx, :]
    assert mx.abs(got - expected).max().item() <= 1e-4


def test_a_sparse_row_alone_decodes_on_its_plain_cache_at_its_true_positions():
    """A lone SpecPrefill row decodes on its plain cache, as a dense row does (a batch
    cache's mask makes CUDA's decode attention several times slower), its rope moved
    for each step only; its keys are the dense model's at M + t, alone and after a
    second row joins and the batch cache takes over."""
    model = build(ROPE_CASES["llama"])
    M = 300
    tokens = random_tokens(M, seed=3)
    sparse = make_prompt_cache(model)
    _, shift = run_steps(sparse_prefill_steps(model, tokens, kept_chunks(M), sparse, step_size=64))
    assert shift > 0
    batch = DecodeBatch(model)
    batch.add(0, None, sparse, 7, shift)
    assert batch.plain and batch.cache is sparse
    fed = [7]
    for _ in range(4):
        fed += [token for handle, token, _ in batch.step()[0] if handle == 0]
    assert wrappers_left(model) == []
    alone = sparse[0].keys[..., sparse[0].offset - 4 : sparse[0].offset, :]
    other = make_prompt_cache(model)
    model(random_tokens(123, seed=4)[None], cache=other)
    batch.add(1, None, other, 5, 0)
    assert not batch.plain
    for _ in range(2):
        fed += [token for handle, token, _ in batch.step()[0] if handle == 0]
    together = batch.cache[0].keys[0:1, :, batch.cache[0]._idx - 2 : batch.cache[0]._idx, :]
    assert len(fed) == 6
    dense = make_prompt_cache(model)
    model(tokens[None], cache=dense)
    model(mx.array(fed)[None], cache=dense)
    expected = dense[0].keys[..., M : M + 6, :]
    assert mx.abs(alone - expected[..., :4, :]).max().item() <= 1e-4
    assert mx.abs(together - expected[..., 4:, :]).max().item() <= 1e-4


def test_rows_decode_from_buffers_of_whole_growth_steps_with_the_same_tokens():
    """A prefill leaves KV buffers of exact sizes and a batch's merge makes its own;
    decoding starts from buffers of whole growth steps (MLX's CUDA attention reads keys
    fastest from those), one row alone and two together, and makes the tokens a plain
    mlx-lm cache makes."""
    model = build(ROPE_CASES["llama"])
    prompts = [random_tokens(600, seed=5), random_tokens(123, seed=6)]
    expected = []
    for tokens in prompts:
        cache = make_prompt_cache(model)
        logits = model(tokens[None], cache=cache)
        expected.append([int(mx.argmax(logits[0, -1]).item())])
        for _ in range(4):
            logits = model(mx.array([[expected[-1][-1]]]), cache=cache)
            expected[-1].append(int(mx.argmax(logits[0, -1]).item()))
    caches = [make_prompt_cache(model) for _ in prompts]
    for chunk in (prompts[0][:300], prompts[0][300:]):  # a prefill continued, as from a prefix
        prefill_chunk(model, chunk, caches[0])
    assert caches[0][0].keys.shape[2] == 600  # the prefill's exact size
    model(prompts[1][None], cache=caches[1])
    alone = DecodeBatch(model)
    align_buffers(caches[0])  # as the executor does when a row joins
    alone.add(0, None, caches[0], expected[0][0], 0)
    assert all(layer.keys.shape[2] == 768 for layer in alone.cache)
    got = []
    for _ in range(5):
        got += [token for _, token, _ in alone.step()[0]]
    assert got[:4] == expected[0][1:]
    alone.add(1, None, caches[1], expected[1][0], 0)  # merged into a batch
    assert all(layer.keys.shape[2] % 256 == 0 and layer.keys.shape[2] > layer.size()
               for layer in alone.cache)


def _prefilled(model, length: int, seed: int) -> list:
    cache = make_prompt_cache(model)
    model(random_tokens(length, seed=seed)[None], cache=cache)
    align_buffers(cache)
    mx.eval([layer.state for layer in cache])
    return cache


def _kv_bytes(cache: list) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache)


def test_a_join_holds_one_layers_copy_beside_the_batch_never_a_second_batch():
    """A row joining a batch of three long rows: the memory above what was held before
    peaks at the batch's growth and a fraction of the batch (a layer's copy and the row's
    own batch-of-one copy), where copying every layer at once held the old batch whole
    beside the new one (1.2 batches above the growth on this model)."""
    model = tiny_model("llama", num_hidden_layers=8, num_key_value_heads=4, head_dim=64)
    batch = DecodeBatch(model)
    for handle, length in enumerate((600, 800, 700)):
        batch.add(handle, None, _prefilled(model, length, handle), 5, 0)
    held = _kv_bytes(batch.cache)
    row = _prefilled(model, 760, 9)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    batch.add(3, None, row, 5, 0)
    growth = _kv_bytes(batch.cache) - held
    assert mx.get_peak_memory() - before < growth + held / 2


def test_a_join_failing_part_way_leaves_the_batch_as_it_was(monkeypatch):
    """The second layer's copy fails as a row joins: the first layer gives the row
    back, the error reaches the caller, and the batch's rows decode the tokens they
    decode where no row tried to join."""
    model = build(ROPE_CASES["llama"])

    def two_rows():
        batch = DecodeBatch(model)
        batch.add(0, None, _prefilled(model, 300, 1), 7, 0)
        batch.add(1, None, _prefilled(model, 123, 2), 5, 0)
        return batch

    def decoded(batch):
        return [batch.step()[0] for _ in range(4)]

    expected = decoded(two_rows())
    batch = two_rows()
    aligned = []

    def failing_second(cache):
        aligned.append(cache)
        if len(aligned) == 2:
            raise RuntimeError("cannot allocate the copy")
        align_buffers(cache)

    monkeypatch.setattr(batch_module, "align_buffers", failing_second)
    with pytest.raises(RuntimeError, match="cannot allocate"):
        batch.add(2, None, _prefilled(model, 500, 3), 9, 0)
    monkeypatch.undo()
    assert batch.rows == [0, 1]
    assert decoded(batch) == expected


def test_a_row_that_leaves_gives_back_its_slot_and_the_others_padding_at_the_next_step():
    """The longest of three rows leaves: at the next step the batch holds two rows at the
    length of the longer of them (no vacant slot, no left padding kept for the row that
    left), and they decode what they decode in a batch the long row was never in."""
    model = build(ROPE_CASES["llama"])

    def batch_of(*rows):
        batch = DecodeBatch(model)
        for handle, (length, seed, token) in rows:
            batch.add(handle, None, _prefilled(model, length, seed), token, 0)
        return batch

    short = [(1, (300, 2, 5)), (2, (400, 3, 9))]
    expected = batch_of(*short)
    batch = batch_of((0, (1200, 1, 7)), *short)
    for _ in range(2):
        expected.step(), batch.step()
    batch.remove({0})
    got, want = batch.step()[0], expected.step()[0]
    assert batch.slots == [1, 2]
    assert all(layer.keys.shape[2] <= 512 for layer in batch.cache)  # 1,280 before
    for _ in range(3):
        got += batch.step()[0]
        want += expected.step()[0]
    assert got == want


async def test_cancelling_one_row_leaves_the_others_and_seeded_rows_match_their_solo_runs():
    async with Engine() as engine:
        tokenizer = engine.tokenizer
        rows = [
            (chat(tokenizer, 50, 400), {"max_tokens": 24}),
            (chat(tokenizer, 51, 300), {"max_tokens": 24, "temperature": 0.9, "seed": 7}),
            ("import os\n\n\ndef main():\n", {"max_tokens": 30, "temperature": 0.7, "top_p": 0.9,
                                              "top_k": 20, "seed": 3}),
            (chat(tokenizer, 52, 350), {"max_tokens": 24, "repetition_penalty": 1.3}),
        ]
        alone = [await engine.generate(p, **o) for p, o in rows]
        victim_text = "def run():\n    for i in range(10):\n"
        victim = engine.stream(victim_text, max_tokens=500, request_id="victim")

        async def cancel_after_three():
            received = 0
            async for _ in victim:
                received += 1
                if received == 3:
                    break
            await victim.aclose()

        cancel = asyncio.create_task(cancel_after_three())
        together = await submit_in_order(engine, rows)
        await cancel
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len(set(map(tuple, (r.token_ids for r in together[1:3])))) == 2  # sampled rows differ


async def test_no_wrapper_is_on_either_model_between_decode_steps():
    """Checked on the worker, at every decode step of a stream (its logits processor
    runs inside the step) while SpecPrefill requests score and prefill around it."""
    async with Engine(threshold=256) as engine:
        runtime = engine._worker.runtime
        seen = []

        def check(generated, logits):
            seen.append(wrappers_left(runtime.model) + wrappers_left(runtime.scorer.model))
            return logits

        prompts = [chat(engine.tokenizer, 60 + i, 600) for i in range(3)]
        watched = engine.generate(chat(engine.tokenizer, 59, 300), max_tokens=60, ignore_eos=True,
                                  logits_processors=[check], specprefill=False)
        await asyncio.gather(watched, *(engine.generate(p, max_tokens=8, specprefill=True)
                                        for p in prompts))
    assert len(seen) >= 60 and all(found == [] for found in seen), seen


async def test_admission_beyond_the_batch_size_or_kv_budget_waits_and_never_fails():
    async with Engine(max_batch_size=2) as engine:
        prompts = [chat(engine.tokenizer, 70 + i, 300) for i in range(5)]
        alone = [await engine.generate(p, max_tokens=12, specprefill=False) for p in prompts]
        seen = []

        async def watch():
            while True:
                seen.append(sum(s.status is Status.DECODING
                               for s in list(engine._worker.scheduler.requests.values())))
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(
            *(engine.generate(p, max_tokens=12, specprefill=False) for p in prompts))
        watcher.cancel()
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert max(seen) <= 2
    assert max(r.timings.queue_wait for r in results) > min(r.timings.queue_wait for r in results)
    # room for one request at a time (~312 tokens of 8 KiB each: 2.6 MB; the prefix cache
    # gives its entries back to make room)
    async with Engine(kv_cache_bytes=4_000_000) as tight:
        results = await asyncio.gather(
            *(tight.generate(p, max_tokens=12, specprefill=False) for p in prompts[:3]))
    assert [r.token_ids for r in results] == [r.token_ids for r in alone[:3]]


def test_a_model_that_cannot_batch_decodes_alone_and_says_why(tmp_path):
    from models import save_with_demo_tokenizer

    dynamic = save_with_demo_tokenizer(ROPE_CASES["dynamic-ntk"], tmp_path / "dynamic")
    with Engine(model=str(dynamic), draft=None) as engine:
        assert not engine.info.batching and engine.info.batch_reason
        results = [engine.generate_sync(p, max_tokens=6) for p in ("def f():", "import os")]
        together = []

        async def both():
            return await asyncio.gather(*(engine.generate(p, max_tokens=6)
                                          for p in ("def f():", "import os")))

        together = asyncio.run(both())
    assert [r.token_ids for r in together] == [r.token_ids for r in results]
    assert not together[0].specprefill.batched
    assert together[0].specprefill.batch_reason == engine.info.batch_reason
    assert np.all([len(r.token_ids) >= 1 for r in together])


def test_a_loops_mailbox_hands_over_a_steps_events_in_one_call_and_in_order():
    import threading

    from specprefill_engine.engine.delivery import Mailbox

    async def run():
        loop = asyncio.get_running_loop()
        mailbox, queues = Mailbox(loop), [asyncio.Queue() for _ in range(4)]
        calls = []
        original = loop.call_soon_threadsafe

        def counted(*args):
            calls.append(args)
            return original(*args)

        loop.call_soon_threadsafe = counted

        def worker():  # one "step": every stream gets its tokens while the loop waits
            for token in range(3):
                for index, events in enumerate(queues):
                    assert mailbox.post(events, (index, token))

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()  # the loop runs nothing until the worker is done
        got = [[await events.get() for _ in range(3)] for events in queues]
        del loop.call_soon_threadsafe
        return got, len(calls)

    got, calls = asyncio.run(run())
    assert got == [[(index, token) for token in range(3)] for index in range(4)]
    assert calls == 1

    loop = asyncio.new_event_loop()
    mailbox = Mailbox(loop)
    loop.close()
    assert not mailbox.post(asyncio.Queue(), "late")  # a closed loop: the caller cancels


def test_a_steps_events_reach_a_running_loop_in_one_hand_over():
    """While the loop runs freely it would drain after the first post and wake again
    for each later one; inside `one_delivery` (each decode step) it wakes once."""
    import time

    from specprefill_engine.engine.delivery import Mailbox, one_delivery

    async def run():
        loop = asyncio.get_running_loop()
        mailbox, queues = Mailbox(loop), [asyncio.Queue() for _ in range(4)]
        drains = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args):
            if callback == mailbox._drain:
                drains.append(time.perf_counter())
            return original(callback, *args)

        loop.call_soon_threadsafe = counted

        def step():
            with one_delivery():
                for index, events in enumerate(queues):
                    assert mailbox.post(events, index)
                    time.sleep(0.02)  # the loop is free to run meanwhile

        await asyncio.to_thread(step)
        got = [await events.get() for events in queues]
        del loop.call_soon_threadsafe
        return got, len(drains)

    got, drains = asyncio.run(run())
    assert got == [0, 1, 2, 3]
    assert drains == 1


def test_a_request_gets_its_first_token_in_the_turn_of_its_last_prefill_unit():
    """Between a request's last prefill unit and its first token no decode step runs:
    a stream decoding alongside gets no token in between (it did, one turn later)."""
    order = []

    async def run():
        async with Engine(draft=None) as engine:
            decoding = asyncio.Event()

            async def alongside():
                async for chunk in engine.stream([5, 6, 7, 8], max_tokens=200, ignore_eos=True,
                                                 cache_prompt=False):
                    if chunk.token_ids:
                        order.append("A")
                        decoding.set()

            task = asyncio.create_task(alongside())
            await decoding.wait()
            prompt = np.random.default_rng(0).integers(10, 4000, 700).tolist()
            async for chunk in engine.stream(
                    prompt, max_tokens=2, specprefill=False, cache_prompt=False,
                    on_progress=lambda p: order.append(("B", p.phase, p.done, p.total))):
                if chunk.token_ids:
                    order.append("B")
            task.cancel()

    asyncio.run(run())
    progress = [i for i, event in enumerate(order) if isinstance(event, tuple)]
    assert len(progress) >= 2 and order[progress[-1]][2] == order[progress[-1]][3]
    assert "A" in order[progress[0]:progress[-1]]  # A decodes while B prefills
    assert order[progress[-1] + 1] == "B"


def test_short_prompts_waiting_together_are_prefilled_four_to_a_turn():
    """Short prompts queued behind a long prefill are prefilled four to a turn, so they
    start decoding together: a stream decoding alongside gets no token between the first
    tokens of the first four (it got one between each), and one before the fifth's (a
    turn's unit is spent: tiny prompts would otherwise stall it for many forwards)."""
    order, answers = [], {}
    rng = np.random.default_rng(1)
    shorts = {name: rng.integers(10, 4000, 40).tolist() for name in "BCDFG"}

    async def run():
        async with Engine(draft=None) as engine:
            solo = {name: (await engine.generate(prompt, max_tokens=4, cache_prompt=False)).token_ids
                    for name, prompt in shorts.items()}
            decoding, prefilling = asyncio.Event(), asyncio.Event()

            async def follow(name, prompt, **options):
                tokens = []
                async for chunk in engine.stream(prompt, cache_prompt=False, **options):
                    if chunk.token_ids:
                        order.append(name)
                        tokens.extend(chunk.token_ids)
                        decoding.set()
                answers[name] = tokens

            alongside = asyncio.create_task(follow("A", [5, 6, 7, 8], max_tokens=400,
                                                   ignore_eos=True))
            await decoding.wait()
            long_prompt = rng.integers(10, 4000, 2000).tolist()
            tasks = [asyncio.create_task(follow(
                "E", long_prompt, max_tokens=1, specprefill=False,
                on_progress=lambda p: prefilling.set()))]
            await prefilling.wait()  # the short ones queue behind E's prefill
            for name, prompt in shorts.items():
                tasks.append(asyncio.create_task(follow(name, prompt, max_tokens=4)))
            await asyncio.gather(*tasks)
            alongside.cancel()
            return solo

    solo = asyncio.run(run())
    assert "E" in order
    firsts = [order.index(name) for name in "BCDFG"]
    assert firsts == sorted(firsts)  # first come, first served
    assert "A" not in order[firsts[0]:firsts[3]]
    assert "A" in order[firsts[3]:firsts[4]]
    assert {name: answers[name] for name in "BCDFG"} == solo


async def _four_tokens(engine, order: list, name: str, prompt: list, **options) -> list:
    """A stream's 4 tokens; `name` goes into `order` as each chunk with tokens arrives."""
    tokens = []
    async for chunk in engine.stream(prompt, max_tokens=4, **options):
        if chunk.token_ids:
            order.append(name)
            tokens.extend(chunk.token_ids)
    return tokens


def test_a_cached_sessions_next_turn_is_not_held_back_by_a_long_prefill():
    """A prompt whose prefix is cached (an agent session's next turn) has little left to
    prefill: it is prefilled beside the units of a long prefill already under way, so
    its first token comes before the long one's (it waited for the whole long prefill),
    and both answer as they do alone."""
    rng = np.random.default_rng(3)
    session = rng.integers(10, 4000, 600).tolist()
    next_turn = session + rng.integers(10, 4000, 20).tolist()
    long_prompt = rng.integers(10, 4000, 3000).tolist()
    order = []

    async def run():
        async with Engine(draft=None, step_size=256) as engine:
            await engine.generate(session, max_tokens=1)  # the session's first turn, cached
            prefilling = asyncio.Event()

            def follow(name, prompt, **options):
                return _four_tokens(engine, order, name, prompt, **options)

            long_task = asyncio.create_task(follow(
                "long", long_prompt, cache_prompt=False,
                on_progress=lambda p: prefilling.set() if p.done else None))
            await prefilling.wait()
            short = await follow("next", next_turn)
            return short, await long_task

    short, long = asyncio.run(run())
    assert order.index("next") < order.index("long"), order
    with Engine(draft=None, step_size=256) as fresh:
        assert fresh.generate_sync(next_turn, max_tokens=4, cache_prompt=False).token_ids == short
        assert fresh.generate_sync(long_prompt, max_tokens=4, cache_prompt=False).token_ids == long


def test_a_short_prefill_goes_ahead_only_where_it_delays_no_one():
    """Under a KV budget for two padded rows, not three: a session's mostly cached next
    turn (S) that arrives behind a waiting long prompt (B) while another long prefill
    (A) runs does not take the memory B waits for: B's first token comes before S's (S
    went beside A's units and B waited for S to end), and all answer as alone."""
    rng = np.random.default_rng(4)
    session = rng.integers(10, 4000, 600).tolist()
    next_turn = session + rng.integers(10, 4000, 20).tolist()
    first, second = (rng.integers(10, 4000, 1500).tolist() for _ in range(2))
    order = []

    async def run():
        async with Engine(draft=None, step_size=256) as probe:
            row = probe.info.rates.target_bytes(1504)
        async with Engine(draft=None, step_size=256, kv_cache_bytes=int(2.5 * row)) as engine:
            await engine.generate(session, max_tokens=1)  # cached: S has 20 tokens left
            prefilling = asyncio.Event()

            def follow(name, prompt, **options):
                return _four_tokens(engine, order, name, prompt, **options)

            a = asyncio.create_task(follow("A", first, cache_prompt=False, on_progress=lambda p:
                                           prefilling.set() if p.done else None))
            await prefilling.wait()
            b = asyncio.create_task(follow("B", second, cache_prompt=False))
            await asyncio.sleep(0)
            s = asyncio.create_task(follow("S", next_turn))
            return await asyncio.gather(a, b, s)

    answers = asyncio.run(run())
    assert order.index("B") < order.index("S"), order
    with Engine(draft=None, step_size=256) as fresh:
        alone = [fresh.generate_sync(p, max_tokens=4, cache_prompt=False).token_ids
                 for p in (first, second, next_turn)]
    assert list(answers) == alone
