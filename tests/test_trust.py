"""The same request, the same answer: a selection is a function of the prompt.

For a given prompt, keep and draft, the kept positions (`report.selection_digest`) and
the greedy tokens are a fresh engine's whatever ran before: the same request again, a
sibling prompt sharing the document, a lower keep first, a dense request first, other
requests at the same time, a failed request. On 115a5ba each of these changed them: a
repeat repaired the stored view with chunks the first selection did not want (and it
grew with every repeat), a sibling reused another request's view, a higher keep was
extended from a lower keep's view, a cached dense prefix was kept whole, and a warm
draft cache restored off its chunk grid changed the importance itself.
"""

import asyncio
import dataclasses

import pytest
from faults import executor_fault

from specprefill_engine import Engine
from specprefill_engine.chat.render import render_chat
from specprefill_engine.demo_tasks import AGENT_TOOLS, make_case
from specprefill_engine.engine import RequestFailedError

pytestmark = pytest.mark.timeout(600)
LENGTH = 1300  # prompts of ~1.3K tokens: several of the draft's chunks, every defect above shows


def messages(tokenizer, seed: int, suffix: str = "") -> list:
    case = make_case(tokenizer, seed, "passkey", LENGTH).messages
    if suffix:
        case = [*case[:-1], {**case[-1], "content": case[-1]["content"] + suffix}]
    return case


def kept(result) -> tuple:
    return result.specprefill.selection_digest, result.specprefill.kept_tokens, result.token_ids


@pytest.fixture(scope="module")
def fresh():
    """What a fresh engine answers: each request on an engine with no cache at all."""
    engine = Engine(densify="off", prefix_cache_bytes=0).start_sync()
    yield lambda prompt, **options: kept(engine.generate_sync(
        prompt, max_tokens=8, specprefill=True, cache_prompt=False, **options))
    engine.shutdown_sync()


async def test_the_same_request_repeated_keeps_the_first_selection(fresh, fresh_cache_dir):
    async with Engine(densify="off") as engine:
        prompt = messages(engine.tokenizer, 7)
        runs = [kept(await engine.generate(prompt, max_tokens=8, specprefill=True, keep=0.3))
                for _ in range(4)]
        report = (await engine.generate(prompt, max_tokens=8, specprefill=True,
                                        keep=0.3)).specprefill
    assert runs == [fresh(prompt, keep=0.3)] * 4
    assert report.reason == "the same request as before: its kept positions again"
    assert "repaired" not in report.reuse and report.reuse.startswith("sparse prefix")


async def test_a_higher_keep_on_a_seen_prompt_keeps_what_a_fresh_selection_keeps(
        fresh, fresh_cache_dir):
    async with Engine(densify="off") as engine:
        prompt = messages(engine.tokenizer, 8)
        low = kept(await engine.generate(prompt, max_tokens=8, specprefill=True, keep=0.2))
        high = kept(await engine.generate(prompt, max_tokens=8, specprefill=True, keep=0.6))
        again = kept(await engine.generate(prompt, max_tokens=8, specprefill=True, keep=0.2))
    assert high == fresh(prompt, keep=0.6)
    assert low == again == fresh(prompt, keep=0.2)
    assert low[1] < high[1]


async def test_a_sibling_prompt_selects_as_on_a_fresh_engine(fresh, fresh_cache_dir):
    """Same document, another question: the first request's view is no view of its."""
    async with Engine(densify="off") as engine:
        first = messages(engine.tokenizer, 10)
        sibling = messages(engine.tokenizer, 10, " Answer with the number only.")
        await engine.generate(first, max_tokens=8, specprefill=True)
        result = kept(await engine.generate(sibling, max_tokens=8, specprefill=True))
    assert result == fresh(sibling)


async def test_a_prompt_cached_dense_is_still_selected_when_specprefill_is_asked(
        fresh, fresh_cache_dir):
    async with Engine(densify="off") as engine:
        prompt = messages(engine.tokenizer, 9)
        await engine.generate(prompt, max_tokens=8, specprefill=False)
        result = await engine.generate(prompt, max_tokens=8, specprefill=True)
    assert result.specprefill.engaged and result.usage.cached_tokens > 0
    assert kept(result) == fresh(prompt)


async def test_concurrent_requests_sharing_a_document_answer_as_alone(fresh, fresh_cache_dir):
    async with Engine(densify="off") as engine:
        prompts = [messages(engine.tokenizer, 11, f" (question {i}: the passkey)")
                   for i in range(4)]
        results = await asyncio.gather(*(engine.generate(p, max_tokens=8, specprefill=True)
                                         for p in prompts))
        again = await asyncio.gather(*(engine.generate(p, max_tokens=8, specprefill=True)
                                       for p in reversed(prompts)))
    expected = [fresh(p) for p in prompts]
    assert [kept(r) for r in results] == expected
    assert [kept(r) for r in reversed(again)] == expected


async def test_after_a_failed_request_the_next_one_answers_as_on_a_fresh_engine(
        fresh, fresh_cache_dir):
    """A SpecPrefill request fails in its prefill (after the draft stored its prompt's
    KV); the same prompt and a grown one then select and answer as a fresh engine's."""
    async with Engine(densify="off") as engine:
        prompt = messages(engine.tokenizer, 12)
        grown = messages(engine.tokenizer, 12, " Think about it first.")

        def fault(handle):
            raise RuntimeError("injected")

        with executor_fault("prefill", fault):
            with pytest.raises(RequestFailedError):
                await engine.generate(prompt, max_tokens=8, specprefill=True)
        after = [kept(await engine.generate(p, max_tokens=8, specprefill=True))
                 for p in (prompt, grown)]
    assert after == [fresh(prompt), fresh(grown)]


async def test_a_dense_conversations_next_turn_stays_dense_when_its_cache_was_evicted(
        fresh_cache_dir):
    """A conversation the policy ran dense: its next turn, adding fewer tokens than the
    threshold, runs dense whether its earlier turn's KV is cached or gone (evicted under
    load), so it answers as alone (on b8dc896 an evicted turn was weighed as a cold
    prompt and the policy could engage, and answer otherwise)."""
    results = {}
    for budget in (None, 0):  # the default prefix cache, and none at all
        settings = {} if budget is None else {"prefix_cache_bytes": 0}
        async with Engine(densify="off", **settings) as engine:
            first = make_case(engine.tokenizer, 21, "passkey", 700).messages
            one = await engine.generate(first, max_tokens=8)
            grown = first + [{"role": "assistant", "content": one.text},
                             {"role": "user", "content": make_case(
                                 engine.tokenizer, 22, "passkey", 600).messages[-1]["content"]}]
            results[budget] = await engine.generate(grown, max_tokens=8)
    cached, evicted = results[None], results[0]
    assert cached.usage.prompt_tokens >= 1024 > cached.usage.prompt_tokens - 700
    assert not cached.specprefill.engaged and "after a cached prefix" in cached.specprefill.reason
    assert not evicted.specprefill.engaged, evicted.specprefill.reason
    assert "after an earlier turn of" in evicted.specprefill.reason
    assert evicted.token_ids == cached.token_ids


def agent_chat(tokenizer, seed: int) -> list:
    """The demo case as a coding agent sends it: the question, the call, the file read."""
    case = make_case(tokenizer, seed, "passkey", LENGTH)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "read_file", "arguments": {"path": "notes.txt"}}}
    return [{"role": "system", "content": "You answer from the files you read."},
            {"role": "user", "content": case.question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": case.context}]


async def test_an_agents_question_before_the_file_is_read_by_the_draft_and_caches_change_nothing(
        fresh, fresh_cache_dir):
    """The draft reads the user's question again after the prompt (where the call and the
    file follow it): the selection differs from the one without it, and a warm draft
    cache, which holds the prompt's KV and none of the question's copy, selects as a
    fresh engine at another keep and on the same request again."""
    async with Engine(densify="off") as engine:
        chat = render_chat(engine.tokenizer, agent_chat(engine.tokenizer, 32),
                           tools=list(AGENT_TOOLS))
        assert chat.question is not None
        low = await engine.generate(chat, max_tokens=8, specprefill=True, keep=0.2)
        high = await engine.generate(chat, max_tokens=8, specprefill=True, keep=0.5)
        again = await engine.generate(chat, max_tokens=8, specprefill=True, keep=0.2)
    assert high.usage.draft_cached_tokens > 0  # the first scoring's draft KV, restored
    assert kept(low) == kept(again) == fresh(chat, keep=0.2)
    assert kept(high) == fresh(chat, keep=0.5)
    unasked = dataclasses.replace(chat, question=None)
    assert fresh(unasked, keep=0.2)[0] != kept(low)[0]
