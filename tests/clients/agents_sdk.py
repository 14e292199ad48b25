"""The OpenAI Agents SDK against `serve` (tests/clients/clients.sh): one agent with a
function tool through chat completions, then the same through the Responses API.

    python tests/clients/agents_sdk.py http://127.0.0.1:8321/v1 sk-local
"""

import sys

from agents import (
    Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
    function_tool, set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


def main() -> None:
    base_url, key = sys.argv[1:3]
    set_tracing_disabled(True)  # traces would otherwise go to OpenAI's servers
    client = AsyncOpenAI(base_url=base_url, api_key=key)
    for model in (OpenAIChatCompletionsModel(model="local", openai_client=client),
                  OpenAIResponsesModel(model="local", openai_client=client)):
        agent = Agent(name="assistant", instructions="Answer briefly.", tools=[get_weather],
                      model=model, model_settings=ModelSettings(max_tokens=64))
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
        print(type(model).__name__, repr(result.final_output))


if __name__ == "__main__":
    main()
