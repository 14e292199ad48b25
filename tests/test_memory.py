"""The memory budget on the demo pair: refusals by name, the caches giving back first,
each request's KV in its report and in `stats()`."""

import asyncio
import time

import anthropic
import mlx.core as mx
import openai
import pytest

from specprefill_engine import Engine, MemoryBudgetError
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.memory import HEADROOM, device_memory, free_ram

pytestmark = pytest.mark.timeout(300)
TARGET_BYTES = 8 * 2 * 64 * 2 * 4  # the demo target's KV per token: 8 layers, 2 heads, float32


def chat(tokenizer, seed, n_tokens):
    return make_case(tokenizer, seed, "passkey", n_tokens).messages


def cached_bytes(engine, timeout=10.0) -> int:
    """The target's prefix cache once the last request's entry is stored (the turn after
    its result)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        memory = engine.stats()["memory"]
        if memory.prefix_cache and not memory.requests:
            return memory.prefix_cache
        time.sleep(0.01)
    raise AssertionError("the prefix cache stayed empty")


def test_the_default_budget_is_the_devices_memory_less_the_weights(fresh_cache_dir):
    with Engine() as engine:
        memory = engine.stats()["memory"]
    assert memory.weights_bytes > 0 and memory.device_bytes > 0
    assert 0 < memory.budget < memory.device_bytes - memory.weights_bytes
    assert device_memory()[1] in ("free RAM", "MLX's memory limit") and free_ram() > 0
    assert memory.source.startswith(device_memory()[1])


def test_the_default_budget_stays_within_mlxs_memory_limit(fresh_cache_dir):
    """Past MLX's memory limit its allocator fails (on CUDA, mid-request: 32 agent
    sessions on an 80 GB H100 ran out of memory with the budget read from the whole
    device), so the default budget is taken from within it."""
    previous = mx.set_memory_limit(3 * 10**9)
    try:
        with Engine() as engine:
            memory = engine.stats()["memory"]
    finally:
        mx.set_memory_limit(previous)
    assert memory.device_bytes == 3 * 10**9 and memory.source.startswith("MLX's memory limit")
    assert memory.budget == int(3 * 10**9 * (1 - HEADROOM)) - memory.weights_bytes


async def test_a_request_beyond_the_budget_is_refused_while_a_concurrent_one_completes(
        fresh_cache_dir):
    async with Engine(kv_cache_bytes=6_000_000) as engine:
        small = chat(engine.tokenizer, 1, 300)
        alone = await engine.generate(small, max_tokens=32, specprefill=False)
        big = chat(engine.tokenizer, 2, 3000)
        results = await asyncio.gather(
            engine.generate(small, max_tokens=32, specprefill=False),
            engine.generate(big, max_tokens=16, specprefill=False),
            return_exceptions=True)
        after = await engine.generate(small, max_tokens=8, specprefill=False)
    assert results[0].token_ids == alone.token_ids
    refused = results[1]
    assert isinstance(refused, MemoryBudgetError)
    assert "needs 0.02" in str(refused) and "more than the 0.006 GB available for KV " \
        "(kv_cache_bytes)" in str(refused)
    assert after.token_ids == alone.token_ids[:8]


@pytest.mark.parametrize("draft_tokens", [0, 3], ids=["batched", "speculative"])
async def test_a_request_waits_where_the_batch_would_pad_it_past_the_budget(
        fresh_cache_dir, draft_tokens):
    """mlx-lm's batch caches pad every row to the longest: two requests whose own KV fit
    the budget may not fit it side by side (32 agent sessions on an H100 ran out of GPU
    memory), so the short one waits for the long one and then answers as it does alone.
    A long one decoding alone with its draft would join the batch when the short one did."""
    budget, order, held = 20_000_000, [], []
    async with Engine(kv_cache_bytes=budget, densify="off",
                      num_draft_tokens=draft_tokens) as engine:
        short = chat(engine.tokenizer, 7, 300)
        alone = await engine.generate(short, max_tokens=8, specprefill=False)

        async def run(name, prompt, max_tokens):
            tokens = []
            async for chunk in engine.stream(prompt, max_tokens=max_tokens, specprefill=False,
                                             cache_prompt=False, ignore_eos=name == "long"):
                tokens += chunk.token_ids
                held.append(engine.stats()["memory"])
                if name == "long" and not order:
                    order.append("long started")
            order.append(name)
            return tokens

        long = asyncio.create_task(run("long", chat(engine.tokenizer, 8, 1500), 40))
        while not order:
            await asyncio.sleep(0.01)
        beside = await run("short", short, 8)
        await long
    # own KV: 1540 and 308 entries of 8 KB fit 20 MB (15 MB); padded to the longest, 25 MB
    assert order == ["long started", "long", "short"]
    assert beside == alone.token_ids
    assert held and all(m.held <= budget for m in held)


def test_the_prefix_caches_give_memory_back_before_a_request_is_refused(fresh_cache_dir):
    budget = 12_000_000
    with Engine(kv_cache_bytes=budget, densify="off") as engine:
        engine.generate_sync(chat(engine.tokenizer, 3, 1000), max_tokens=8, specprefill=False)
        full = cached_bytes(engine)
        assert full > 7_000_000  # the first turn's KV, kept for a next turn
        # an unrelated request that fits the budget only once that entry is given back
        other = chat(engine.tokenizer, 4, 500)
        served = engine.generate_sync(other, max_tokens=8, specprefill=False)
        assert served.usage.prompt_tokens * TARGET_BYTES + full > budget
        assert cached_bytes(engine) < full
        assert engine.stats()["memory"].evicted >= 1
        with pytest.raises(MemoryBudgetError, match="needs"):  # more than the whole budget
            engine.generate_sync(chat(engine.tokenizer, 5, 2000), max_tokens=8,
                                 specprefill=False)
        assert engine.generate_sync(other, max_tokens=8, specprefill=False).token_ids == \
            served.token_ids


def test_each_request_reports_its_kv_and_the_sparse_views_saving(fresh_cache_dir):
    seen = []
    with Engine(densify="off") as engine:
        prompt = chat(engine.tokenizer, 6, 2000)

        def watch(generated, logits):  # on the worker, mid-decode
            seen.append(engine.stats()["memory"].requests)
            return logits

        dense = engine.generate_sync(prompt, max_tokens=8, specprefill=False,
                                     logits_processors=[watch])
        sparse = engine.generate_sync(prompt, max_tokens=8, specprefill=True, keep=0.1,
                                      cache_prompt=False)
    with Engine(kv_bits=8, quantized_kv_start=0) as quantized:
        both = quantized.generate_sync(prompt, max_tokens=8, specprefill=True, keep=0.1)
    prompt_bytes = dense.usage.prompt_tokens * TARGET_BYTES
    assert dense.specprefill.kv_bytes == dense.specprefill.dense_kv_bytes
    assert prompt_bytes <= dense.specprefill.kv_bytes <= prompt_bytes + 8 * TARGET_BYTES
    assert dense.specprefill.draft_kv_bytes == 0  # never scored
    report = sparse.specprefill
    assert report.engaged and report.kv_bytes < 0.2 * report.dense_kv_bytes
    assert report.draft_kv_bytes > 0  # the draft's KV while it scored
    assert both.specprefill.kv_bytes < 0.35 * report.kv_bytes  # 8-bit of float32: 1.125 / 4
    assert any(r and next(iter(r.values()))["target"] >= prompt_bytes for r in seen)


def test_the_servers_answer_is_a_400_in_each_apis_shape(fresh_cache_dir):
    from test_server import KEY, Served
    from specprefill_server import ServerConfig

    served = Served(Engine(kv_cache_bytes=4_000_000), ServerConfig(api_key=KEY))
    try:
        long = [dict(m) for m in chat(served.engine.tokenizer, 7, 2000)]
        with pytest.raises(openai.BadRequestError, match="needs") as refused:
            served.openai().chat.completions.create(model="m", messages=long, max_tokens=4)
        assert refused.value.body["code"] == "memory_budget_exceeded"
        assert refused.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="needs"):  # a stream: no 200 first
            list(served.openai().chat.completions.create(model="m", messages=long,
                                                         max_tokens=4, stream=True))
        with pytest.raises(anthropic.BadRequestError, match="available for KV") as too_big:
            served.anthropic().messages.create(model="m", messages=long, max_tokens=4)
        assert too_big.value.body["error"]["type"] == "invalid_request_error"
        short = [{"role": "user", "content": "Hello"}]
        assert served.openai().chat.completions.create(model="m", messages=short,
                                                       max_tokens=2).choices
    finally:
        served.stop()
