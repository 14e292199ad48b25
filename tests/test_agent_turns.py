"""SpecPrefill across an agent's turns (densify off: these are the sparse turns' own rules): the
draft's prefix cache, reuse of a sparse turn, the coverage gate, protected chat segments,
determinism, no wasted scoring."""

import numpy as np
import pytest

from specprefill_engine import Engine
from specprefill_engine.core import select_chunks
from specprefill_engine.demo_tasks import AGENT_TOOLS, make_agent_session, make_case
from specprefill_engine.chat.render import render_chat

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def session(demo_pair):
    _, _, tokenizer = demo_pair
    return make_agent_session(tokenizer, 0, 3000, 4)


def run_turns(engine, session, steps, **options):
    replies, results = [], []
    for step in range(steps):
        result = engine.generate_sync(session.messages(step, replies), max_tokens=12,
                                      tools=list(session.tools), **options)
        replies.append(result.text)
        results.append(result)
    return results



def protected_tokens(tokenizer, messages: list, ids: np.ndarray, tools=None) -> np.ndarray:
    """The protected mask of `ids`, the chat's rendered prompt."""
    rendered = render_chat(tokenizer, messages, tools)
    assert np.array_equal(rendered.tokens, ids)
    return rendered.protected

def test_a_grown_prompt_reuses_the_draft_and_the_sparse_turn(session):
    with Engine(reuse_coverage=0.5, densify="off") as engine:  # the gate open enough here
        first, second, third = run_turns(engine, session, 3, specprefill=True)
        step = engine.info.step_size
    assert first.specprefill.engaged and first.usage.draft_cached_tokens == 0
    for before, after in ((first, second), (second, third)):
        # the draft prefilled only what is new, from the chunk grid on
        shared = before.usage.prompt_tokens
        assert after.usage.draft_cached_tokens >= (shared // step) * step - step
        assert after.specprefill.reuse.startswith("sparse prefix"), after.specprefill.reuse
        # the target computed about the new tokens and the passages repaired: the reused
        # entries are the last turn's kept prompt and its reply
        assert after.usage.cached_tokens >= before.specprefill.kept_tokens
        new = after.specprefill.kept_tokens - after.usage.cached_tokens
        reuse = after.specprefill.reuse
        repaired = int(reuse.split("chunks (")[1].split(" tokens")[0]) if "repaired" in reuse else 0
        assert new <= after.usage.prompt_tokens - before.usage.prompt_tokens + repaired


def test_a_question_about_what_the_last_turn_dropped_repairs_the_view(demo_pair, fresh_cache_dir):
    _, _, tokenizer = demo_pair
    # turn 1 asks for the fact near the start, turn 2 for the one near the end: the
    # stored selection lacks what turn 2 needs, and it is added to the stored view
    session = make_agent_session(tokenizer, 3, 3000, 2)
    with Engine(reuse_coverage=0.999, keep=0.1, densify="off") as engine:
        first, second = run_turns(engine, session, 2, specprefill=True)
    assert second.specprefill.engaged
    reuse = second.specprefill.reuse
    assert reuse.startswith("sparse prefix") and "repaired: +" in reuse, reuse
    assert float(reuse.split("coverage ")[1].split(",")[0]) < 0.999  # the gate alone: anew


def test_tool_definitions_and_the_system_prompt_are_never_dropped(demo_pair):
    _, _, tokenizer = demo_pair
    session = make_agent_session(tokenizer, 1, 3000, 2)
    messages = session.messages(1, ["123456"])
    tools = list(AGENT_TOOLS)
    ids = np.array(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
    protected = protected_tokens(tokenizer, messages, ids, tools)
    without_tools = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    system_end = len(tokenizer.apply_chat_template(messages[:1], tools=tools))
    assert len(ids) - len(without_tools) > 100  # the template renders the tools
    assert protected[:system_end].all()  # system prompt and tool schemas
    newest = len(tokenizer.apply_chat_template(messages[:-1], tools=tools))
    assert protected[newest:].all()  # the newest message, with the generation prompt
    documents = protected[system_end:newest]
    assert documents.mean() < 0.2  # the documents are left to the selection
    importance = np.random.default_rng(0).random(ids.size).astype(np.float32)
    kept = np.asarray(select_chunks(importance, 0.1, 32, must_keep=protected))
    assert np.isin(np.flatnonzero(protected), kept).all()
    others = np.setdiff1d(kept, np.flatnonzero(protected))
    budget = np.ceil(0.1 * (ids.size - protected.sum()))
    assert budget <= others.size <= budget + 32 + 32  # a chunk of rounding, the tail


def test_plain_prompts_and_token_ids_get_no_segments(demo_pair):
    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 2, "passkey", 1500)
    ids = np.array(tokenizer.apply_chat_template(case.messages, add_generation_prompt=True))
    protected = protected_tokens(tokenizer, case.messages, ids)
    assert protected.sum() < 8  # the template's control tokens only: one user turn


def test_the_same_prompt_keeps_the_same_tokens_whatever_came_before(demo_pair):
    _, _, tokenizer = demo_pair
    prompt = make_case(tokenizer, 21, "registry", 1500).messages
    with Engine() as fresh:
        alone = fresh.generate_sync(prompt, max_tokens=10, specprefill=True)
    with Engine(densify="off") as used:  # the timing of a densify would change history
        # unrelated traffic that shares the chat template's start, dense and sparse
        used.generate_sync(make_case(tokenizer, 22, "passkey", 600).messages, max_tokens=4,
                           specprefill=False)
        used.generate_sync(make_case(tokenizer, 23, "passkey", 1800).messages, max_tokens=4,
                           specprefill=True)
        used.generate_sync(prompt[0]["content"][:3000], max_tokens=4, specprefill=False)
        later = used.generate_sync(prompt, max_tokens=10, specprefill=True)
    assert later.specprefill.selection_digest == alone.specprefill.selection_digest
    assert later.specprefill.kept_tokens == alone.specprefill.kept_tokens
    assert later.token_ids == alone.token_ids


def test_too_little_left_to_prefill_after_a_cached_prefix_is_not_scored(demo_pair):
    _, _, tokenizer = demo_pair
    turn1 = make_case(tokenizer, 24, "passkey", 1500).messages
    with Engine(densify="off") as engine:
        first = engine.generate_sync(turn1, max_tokens=8, specprefill=False)
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "Say it again."}]
        second = engine.generate_sync(turn2, max_tokens=8, specprefill=True)
    assert not second.specprefill.engaged
    assert "too few to sparsify" in second.specprefill.reason
    assert second.timings.scoring == 0 and second.usage.cached_tokens > 1000
