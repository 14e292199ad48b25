"""Documents in the system message: its ends are protected, `keep` applies to its middle.

RAG pipelines and agent frameworks (`create_agent(llm, tools, system_prompt=doc)`) put
retrieved text in the system message; protected whole, it left nothing to sparsify.
"""

import numpy as np
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool

from langchain_specprefill import ChatSpecPrefill
from specprefill_engine import Engine
from specprefill_engine.core import select_chunks
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.chat.render import render_chat
from specprefill_engine.engine.policy import expected_kept
from specprefill_engine.engine.runtime import EngineConfig

agents = pytest.importorskip("langchain.agents")
pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


def test_a_long_system_message_keeps_its_ends_and_the_tools_whole(demo_pair):
    _, _, tokenizer = demo_pair
    cap = EngineConfig().system_message_cap
    case = make_case(tokenizer, 0, "registry", 3000)
    messages = [{"role": "system", "content": case.context},
                {"role": "user", "content": case.question}]
    rendered = render_chat(tokenizer, messages, [WEATHER], system_cap=cap)
    protected, start = rendered.protected, rendered.message_starts[1]
    without_tools = render_chat(tokenizer, messages, system_cap=cap)
    tools = start - without_tools.message_starts[1]
    assert tools > 50  # the template renders the tool definitions inside the system turn
    # the system message's own tokens: its first and last cap / 2 (a token either way
    # where text meets the tools), the tools on top
    assert abs(protected[:start].sum() - (cap + tools)) <= 2
    assert protected[: cap // 2].all()
    assert protected[start:].all()  # the question (the request, with a document before)
    assert protected.sum() < 0.35 * protected.size
    # a short system message is still kept whole, and so is one within the cap
    short = render_chat(tokenizer, [{"role": "system", "content": "Answer with digits."},
                                    {"role": "user", "content": case.context}], [WEATHER])
    assert short.protected[: short.message_starts[1]].all()
    whole = render_chat(tokenizer, messages, [WEATHER], system_cap=start)
    assert whole.protected[:start].all()
    # the policy's estimate of the kept tokens matches what the selection keeps
    importance = np.random.default_rng(0).random(protected.size).astype(np.float32)
    for keep in (0.1, 0.3):
        kept = np.asarray(select_chunks(importance, keep, 32, 0.0, 32, must_keep=protected))
        assert np.isin(np.flatnonzero(protected), kept).all()
        estimate = expected_kept(protected.size, keep, protected, 32, 32)
        assert abs(kept.size - estimate) <= 32 + 32 + 8  # a chunk, the tail, the sink


def test_an_agent_with_a_document_in_its_system_prompt_uses_specprefill(demo_pair, tmp_path,
                                                                         monkeypatch):
    _, _, tokenizer = demo_pair
    case = make_case(tokenizer, 0, "registry", 3000)
    # a new user's first request: a fresh engine, no prefill costs observed before it
    monkeypatch.setenv("SPECPREFILL_CACHE_DIR", str(tmp_path))
    llm = ChatSpecPrefill(max_tokens=16)  # the automatic policy decides
    llm.close()
    agent = agents.create_agent(llm, [get_weather], system_prompt=case.context)
    try:
        messages = agent.invoke({"messages": [HumanMessage(case.question)]})["messages"]
    finally:
        llm.close()
    reply = messages[-1]
    assert isinstance(reply, AIMessage) and not reply.tool_calls
    assert reply.content.strip() == case.answer
    report = reply.response_metadata["specprefill"]
    assert report["engaged"], report["reason"]
    assert report["kept_tokens"] < 0.6 * report["total_tokens"]


def test_the_server_renders_with_the_engines_system_cap():
    from specprefill_engine.chat.call import build_call

    with Engine(system_message_cap=64, densify="off") as engine:
        case = make_case(engine.tokenizer, 0, "registry", 1500)
        messages = [{"role": "system", "content": case.context},
                    {"role": "user", "content": case.question}]
        call = build_call(engine, messages, {})
        engine_render = engine.render(messages)
    default = render_chat(engine.tokenizer, messages)  # the default cap, 512
    assert np.array_equal(call.prompt.protected, engine_render.protected)
    start = engine_render.message_starts[1]
    assert engine_render.protected[:start].sum() <= 64 + 2 < default.protected[:start].sum()
