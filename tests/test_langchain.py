"""ChatSpecPrefill: LangChain's standard suites plus behaviour on the demo pair."""

import asyncio
import shutil

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from mlx_lm.tokenizer_utils import load as load_tokenizer

from langchain_specprefill import ChatSpecPrefill
from langchain_specprefill.tool_calls import split_tool_calls
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.loading import DEMO_TARGET


class OurModel:
    """What both standard suites need to know about ChatSpecPrefill."""

    @property
    def chat_model_class(self):
        return ChatSpecPrefill

    @property
    def chat_model_params(self):
        return {"temperature": 0.0}


class TestChatSpecPrefillUnit(OurModel, ChatModelUnitTests):
    @property
    def supports_model_override(self):
        return False  # one engine holds one model pair; switch models with a new instance


class TestChatSpecPrefillIntegration(OurModel, ChatModelIntegrationTests):
    @property
    def has_tool_choice(self):
        return False

    @property
    def supports_json_mode(self):
        return False


DEMO_CANNOT_CALL_TOOLS = [
    "test_tool_calling", "test_tool_calling_async", "test_bind_runnables_as_tools",
    "test_tool_calling_with_no_arguments", "test_structured_output",
    "test_structured_output_async", "test_structured_output_pydantic_2_v1",
    "test_structured_output_optional_param", "test_agent_loop",
    "test_unicode_tool_call_integration",
]
for _name in DEMO_CANNOT_CALL_TOOLS:
    setattr(TestChatSpecPrefillIntegration, _name, pytest.mark.xfail(
        reason="the 14M demo model was never trained to emit tool calls or JSON; the parsing "
               "path is proven in test_tool_calls_are_parsed_from_real_model_output",
    )(getattr(ChatModelIntegrationTests, _name)))


def messages_for(seed=0, n_tokens=500):
    tokenizer = load_tokenizer(DEMO_TARGET)
    case = make_case(tokenizer, seed, "passkey", n_tokens)
    return [HumanMessage(case.messages[0]["content"])], case.answer


def test_every_entry_point_gives_the_engine_greedy_text():
    llm = ChatSpecPrefill(max_tokens=12)
    messages, _ = messages_for(1)
    expected = llm.engine.generate_sync([{"role": "user", "content": messages[0].content}],
                                        max_tokens=12).text
    assert llm.invoke(messages).content == expected
    assert asyncio.run(llm.ainvoke(messages)).content == expected
    assert "".join(c.content for c in llm.stream(messages)) == expected

    async def astream():
        return "".join([c.content async for c in llm.astream(messages)])

    assert asyncio.run(astream()) == expected
    assert [m.content for m in llm.batch([messages, messages])] == [expected] * 2
    assert [m.content for m in asyncio.run(llm.abatch([messages, messages]))] == [expected] * 2


def test_final_chunk_carries_usage_and_report():
    llm = ChatSpecPrefill(max_tokens=8, threshold=256)
    messages, answer = messages_for(2, 1200)
    chunks = list(llm.stream(messages))
    assert all(c.usage_metadata is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.usage_metadata["input_tokens"] > 1000
    assert final.response_metadata["specprefill"]["engaged"]
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(c.content for c in chunks).strip() == answer


def test_breaking_out_of_astream_aborts_the_engine_request():
    llm = ChatSpecPrefill(max_tokens=400, specprefill=False)
    messages, _ = messages_for(3)
    engine = llm.engine

    async def consume_two():
        received = 0
        stream = llm.astream(messages)
        async for _ in stream:
            received += 1
            if received == 2:
                break
        await stream.aclose()
        await asyncio.sleep(0.2)
        return received

    assert asyncio.run(consume_two()) == 2
    assert not engine._requests  # the request is gone, not still decoding 400 tokens


def test_message_roles_and_tool_messages_render():
    llm = ChatSpecPrefill(max_tokens=4)
    result = llm.invoke([
        SystemMessage("You answer briefly."),
        HumanMessage("x = 1"),
        HumanMessage("y = 2"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "call_1"}]),
        ToolMessage("3", tool_call_id="call_1"),
        HumanMessage("What is x?"),
    ])
    assert isinstance(result.content, str)
    assert result.usage_metadata["output_tokens"] >= 1


def test_tool_calls_are_parsed_from_real_model_output(tmp_path):
    """The parsing path the demo model cannot reach, on a real mlx-lm tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, tmp_path / name)
    tokenizer = load_tokenizer(tmp_path, tokenizer_config_extra={"tool_parser_type": "json_tools"})
    output = ('Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": {"a": 4}}\n</tool_call>')
    content, calls, invalid = split_tool_calls(output, tokenizer)
    assert content == "Let me add them."
    assert [(c["name"], c["args"]) for c in calls] == [("add", {"a": 2, "b": 3}), ("mul", {"a": 4})]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    _, calls, invalid = split_tool_calls("<tool_call>{not json</tool_call>", tokenizer)
    assert calls == [] and len(invalid) == 1
