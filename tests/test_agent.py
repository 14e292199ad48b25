"""A real agent loop on the demo pair: langchain's create_agent, streamed messages.

The first model call is forced to call a tool (tool_choice="any" from a middleware,
as a real app forces a first lookup); the tool runs, its result goes back through the
tools-aware template, and the model, now with tool_choice "auto", answers in text and
the loop ends on its own.
"""

import asyncio
import sys
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_core.tools import tool

from langchain_specprefill import ChatSpecPrefill

agents = pytest.importorskip("langchain.agents")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from streaming_agent import LookUpFirst  # noqa: E402  (the example's own middleware)

calls = []


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    calls.append(location)
    return f"It is sunny in {location}."


def build_agent():
    return agents.create_agent(ChatSpecPrefill(max_tokens=40), [get_weather],
                               middleware=[LookUpFirst()])


def check(streamed, final_messages):
    model_chunks = [m for m, meta in streamed if meta["langgraph_node"] == "model"]
    assert all(isinstance(m, AIMessageChunk) for m in model_chunks)
    # the tool call was streamed as a tool_call_chunk, never as markup in the text
    call_chunks = [c for m in model_chunks for c in m.tool_call_chunks]
    assert [c["name"] for c in call_chunks] == ["get_weather"]
    assert all("<tool_call>" not in m.content for m in model_chunks)
    tool_results = [m for m, meta in streamed if meta["langgraph_node"] == "tools"]
    assert len(tool_results) == 1 and tool_results[0].content.startswith("It is sunny in ")
    # the answer was streamed token by token after the tool result
    answer_chunks = model_chunks[model_chunks.index(next(
        m for m in model_chunks if m.tool_call_chunks)) + 1:]
    assert "".join(m.content for m in answer_chunks).strip()
    # the loop finished: human, call, tool result, final answer without calls
    kinds = [type(m).__name__ for m in final_messages]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert final_messages[1].tool_calls[0]["name"] == "get_weather"
    assert final_messages[2].tool_call_id == final_messages[1].tool_calls[0]["id"]
    assert isinstance(final_messages[3], AIMessage) and not final_messages[3].tool_calls
    assert final_messages[3].content.strip()


def test_agent_calls_a_tool_gets_the_result_and_finishes():
    agent = build_agent()
    calls.clear()
    question = {"messages": [HumanMessage("What is the weather in Paris?")]}
    streamed = list(agent.stream(question, stream_mode="messages"))
    final = agent.invoke(question)["messages"]
    assert len(calls) == 2  # the tool really ran, once per run
    check(streamed, final)


def test_agent_streams_asynchronously():
    agent = build_agent()
    question = {"messages": [HumanMessage("What is the weather in Paris?")]}

    async def run():
        streamed = [item async for item in agent.astream(question, stream_mode="messages")]
        final = (await agent.ainvoke(question))["messages"]
        return streamed, final

    check(*asyncio.run(run()))
