"""A tool-using agent that streams: langchain's create_agent on ChatSpecPrefill.

Tokens, tool calls and tool results arrive as the agent runs (stream_mode="messages").
The first model call is forced to use the tool (tool_choice="any", from a middleware),
later calls are free ("auto"); constrained decoding keeps every call valid JSON for the
tool's schema. Offline, on the demo pair: a 14M model, so its words are toy words, but
the loop (call, tool, result, answer) is the real one. Needs the `agent` extra.
"""

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_specprefill import ChatSpecPrefill


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


class LookUpFirst(AgentMiddleware):
    """Force a tool call until the conversation holds a tool result."""

    @staticmethod
    def _forced(request):
        if any(isinstance(m, ToolMessage) for m in request.messages):
            return request
        return request.override(tool_choice="any")

    def wrap_model_call(self, request, handler):
        return handler(self._forced(request))

    async def awrap_model_call(self, request, handler):
        return await handler(self._forced(request))


def main() -> None:
    llm = ChatSpecPrefill(max_tokens=40)
    agent = create_agent(llm, [get_weather], middleware=[LookUpFirst()])
    question = {"messages": [HumanMessage("What is the weather in Paris?")]}
    text = []
    for message, meta in agent.stream(question, stream_mode="messages"):
        if meta["langgraph_node"] == "tools":
            print(f"tool result: {message.content}")
            continue
        for call in message.tool_call_chunks:
            print(f"tool call: {call['name']}({call['args']})")
        if message.content:
            text.append(message.content)
            print(message.content, end="", flush=True)
    print(f"\nfinal: {''.join(text).strip()!r}")
    llm.close()


if __name__ == "__main__":
    main()
