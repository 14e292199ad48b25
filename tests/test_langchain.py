"""ChatSpecPrefill: LangChain's standard suites plus behaviour on the demo pair.

The standard suites run without a blanket xfail. Four integration tests are strict
xfails, each for a reason a 14M local model cannot meet; the capability flags that
skip tests are the text-only model's (no image, audio or PDF inputs) and the suite's
own (VCR, Anthropic-format inputs, a second model to override with).
"""

import asyncio
import json
import shutil
import time

import pytest
from langchain_core.globals import set_llm_cache
from langchain_core.caches import InMemoryCache
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field

from decoding import split_tool_calls
from langchain_specprefill import ChatSpecPrefill
from langchain_specprefill.chat_model import ToolsNotSupportedError, shared_engine
from langchain_specprefill.messages import UnsupportedContentError
from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent, ToolCallEvent
from specprefill_engine.chat.tool_calls import OutputParser
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
        return False  # one engine holds one model pair; a per-call model= is refused



class TestChatSpecPrefillIntegration(OurModel, ChatModelIntegrationTests):
    @property
    def chat_model_params(self):
        # replies of at most 64 tokens: every check of the suite, forced calls and
        # structured outputs included, ends well inside them
        return {**super().chat_model_params, "max_tokens": 64}

    @property
    def has_tool_choice(self):
        return True

    @property
    def supports_json_mode(self):
        return True

    @pytest.mark.xfail(strict=True, reason=(
        "checks the argument value (magic_function(3) -> {'input': 3}); the call is forced "
        "and schema-valid, but the 14M demo model, never trained on tool use, does not copy "
        "the 3 from the question"))
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model):
        super().test_tool_calling(model)

    @pytest.mark.xfail(strict=True, reason=(
        "same as test_tool_calling: a valid forced call whose argument the demo model "
        "does not copy from the question"))
    async def test_tool_calling_async(self, model):
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(strict=True, reason=(
        "binds tools without tool_choice ('auto'): the demo model answers in text rather "
        "than choosing the tool; test_agent.py runs the same loop with the first call "
        "forced and the model then finishing on its own"))
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model):
        super().test_agent_loop(model)

    @pytest.mark.xfail(strict=True, reason=(
        "needs the model to copy a Chinese name from the prompt into the forced call; the "
        "demo model was trained on English and Python only"))
    def test_unicode_tool_call_integration(self, model):
        super().test_unicode_tool_call_integration(model)


def messages_for(seed=0, n_tokens=500):
    case = make_case(ChatSpecPrefill().tokenizer, seed, "passkey", n_tokens)
    return [HumanMessage(case.messages[0]["content"])], case.answer


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return f"It is sunny in {location}."


@tool
def magic_function(input: int) -> int:
    """Apply a magic function to an input."""
    return input + 2


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


# plain text ----------------------------------------------------------------------


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
    assert not engine.active_request_ids  # gone, not still decoding 400 tokens


# tools ---------------------------------------------------------------------------


def _calls(message):
    return [(c["name"], c["args"]) for c in message.tool_calls]


def test_streamed_tool_calls_agree_across_entry_points():
    llm = ChatSpecPrefill(max_tokens=64).bind_tools([magic_function, get_weather],
                                                    tool_choice="any")
    prompt = "What is the weather in Paris? Use the tool."
    invoked = llm.invoke(prompt)
    assert len(invoked.tool_calls) == 1 and invoked.content == ""
    assert invoked.tool_calls[0]["id"].startswith("call_")
    expected = _calls(invoked)
    assert _calls(asyncio.run(llm.ainvoke(prompt))) == expected

    chunks = list(llm.stream(prompt))
    assert any(c.tool_call_chunks for c in chunks)  # streamed as tool_call_chunks
    assert all("<tool_call>" not in c.content and "</tool_call>" not in c.content
               for c in chunks)
    streamed = sum(chunks[1:], chunks[0])
    assert _calls(streamed) == expected and streamed.content == ""

    async def astream():
        parts = [c async for c in llm.astream(prompt)]
        return sum(parts[1:], parts[0])

    assert _calls(asyncio.run(astream())) == expected

    async def events():
        # astream_events attaches a streaming callback: invoke goes through _astream
        async for event in llm.astream_events(prompt, version="v2"):
            if event["event"] == "on_chat_model_end":
                return event["data"]["output"]

    assert _calls(asyncio.run(events())) == expected


def test_tool_choice_auto_any_named_none():
    llm = ChatSpecPrefill(max_tokens=48)
    tools = [magic_function, get_weather]
    prompt = "What is the weather in Paris?"
    named = llm.bind_tools(tools, tool_choice="magic_function").invoke(prompt)
    assert [c["name"] for c in named.tool_calls] == ["magic_function"]
    assert isinstance(named.tool_calls[0]["args"]["input"], int)
    forced = llm.bind_tools(tools, tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}}).invoke(prompt)
    assert [c["name"] for c in forced.tool_calls] == ["get_weather"]
    assert isinstance(forced.tool_calls[0]["args"]["location"], str)
    for choice in ("any", "required", True):
        assert len(llm.bind_tools(tools, tool_choice=choice).invoke(prompt).tool_calls) == 1
    auto = llm.bind_tools(tools, tool_choice="auto").invoke(prompt)  # the demo model: text
    assert auto.tool_calls == [] and auto.invalid_tool_calls == [] and auto.content
    assert "<tool_call>" not in auto.content
    assert llm.bind_tools(tools, tool_choice="none").invoke(prompt).tool_calls == []
    with pytest.raises(ValueError, match="not one of the bound tools"):
        llm.bind_tools(tools, tool_choice="no_such_tool")


def test_parallel_tool_calls_when_allowed():
    llm = ChatSpecPrefill(max_tokens=200)
    result = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=True).invoke(
        "Weather in Paris and in Rome?")
    # the demo model repeats calls; each is complete and valid until max_tokens cuts one
    assert len(result.tool_calls) >= 2
    assert all(c["name"] == "get_weather" and set(c["args"]) == {"location"}
               for c in result.tool_calls)
    assert len(result.invalid_tool_calls) <= 1  # the one max_tokens cut, if any


def test_tool_definitions_calls_and_results_reach_the_prompt():
    llm = ChatSpecPrefill(max_tokens=4)
    base = [HumanMessage("What is the weather in Paris?")]
    plain = llm.get_num_tokens_from_messages(base)
    with_tools = llm.get_num_tokens_from_messages(base, tools=[get_weather])
    assert with_tools > plain + 40  # the tool's schema is rendered
    call = AIMessage("", tool_calls=[{"name": "get_weather", "args": {"location": "Paris"},
                                      "id": "call_1"}])
    result = ToolMessage("x" * 400, tool_call_id="call_1")
    longer = llm.get_num_tokens_from_messages(base + [call, result])
    assert longer > plain + 100  # the call and a 400-character result are both shown
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}] + [
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"location": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>' in chat
    assert "<tool_response>\nsunny\n</tool_response>" in chat and '"name": "get_weather"' in chat
    reply = llm.invoke([SystemMessage("You answer briefly."), *base, call, result])
    assert reply.usage_metadata["input_tokens"] > longer


def test_tools_are_refused_for_a_template_that_cannot_render_tools(tmp_path):
    for path in DEMO_TARGET.iterdir():
        shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n"
                               "{% endfor %}<|assistant|>\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = ChatSpecPrefill(model=str(tmp_path))
    try:
        bound = llm.bind_tools([get_weather])  # loads nothing
        with pytest.raises(ToolsNotSupportedError, match="does not render tools"):
            bound.invoke("hi")
        with pytest.raises(ToolsNotSupportedError, match="does not render tools"):
            asyncio.run(bound.ainvoke("hi"))
        with pytest.raises(ToolsNotSupportedError, match="does not render tools"):
            llm.check_tools_supported()
        assert not llm.engine.active_request_ids
    finally:
        llm.close()


def test_tool_call_parser_streams_like_the_whole_text():
    tokenizer = ChatSpecPrefill().tokenizer
    output = ('Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": {"a": 4}}\n</tool_call>')
    content, calls, invalid = split_tool_calls(output, tokenizer)
    assert content == "Let me add them."
    assert [(c["name"], c["args"]) for c in calls] == [("add", {"a": 2, "b": 3}), ("mul", {"a": 4})]
    assert len({c["id"] for c in calls}) == 2 and invalid == []
    parser = OutputParser(tokenizer, parse_tools=True)
    events = [e for ch in output for e in parser.feed(ch)] + parser.finish()  # char by char
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "Let me add them."
    assert [(e.name, json.loads(e.args)) for e in events if isinstance(e, ToolCallEvent)] == \
        [("add", {"a": 2, "b": 3}), ("mul", {"a": 4})]
    _, calls, invalid = split_tool_calls("<tool_call>{not json</tool_call>", tokenizer)
    assert calls == [] and len(invalid) == 1
    # without bound tools the markup is plain text
    parser = OutputParser(tokenizer, parse_tools=False)
    assert "".join(e.text for e in parser.feed(output) + parser.finish()) == output


# structured output -----------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_structured_output_methods_give_valid_objects(method):
    llm = ChatSpecPrefill(max_tokens=64)
    joke = llm.with_structured_output(Joke, method=method).invoke("Tell me a joke about cats.")
    assert isinstance(joke, Joke)
    as_dict = llm.with_structured_output(Joke.model_json_schema(), method=method)
    streamed = list(as_dict.stream("Tell me a joke about cats."))
    assert set(streamed[-1]) == {"setup", "punchline"}
    raw = llm.with_structured_output(Joke, method=method, include_raw=True).invoke("A joke?")
    assert isinstance(raw["parsed"], Joke) and raw["parsing_error"] is None
    assert isinstance(raw["raw"], AIMessage)


def test_json_mode_without_schema_gives_a_json_object():
    llm = ChatSpecPrefill(max_tokens=96)
    result = llm.with_structured_output(method="json_mode").invoke("Reply in JSON.")
    assert isinstance(result, dict)


# reasoning ------------------------------------------------------------------------


def test_think_blocks_go_to_reasoning_content():
    tokenizer = ChatSpecPrefill().tokenizer
    parser = OutputParser(tokenizer)
    text = "<think>\nThe user wants 42.\n</think>\n\nThe answer is 42."
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, ReasoningEvent)) == "The user wants 42."
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "The answer is 42."


@pytest.mark.parametrize("how", ["instance", "call", "reasoning"])
def test_enable_thinking_reaches_the_template(how):
    prompt = [HumanMessage("What is the value of x?")]
    plain = ChatSpecPrefill(max_tokens=10).invoke(prompt)
    if how == "instance":
        llm, kwargs = ChatSpecPrefill(max_tokens=10, chat_template_kwargs={"enable_thinking": True}), {}
    elif how == "call":
        llm, kwargs = ChatSpecPrefill(max_tokens=10), {"chat_template_kwargs": {"enable_thinking": True}}
    else:
        llm, kwargs = ChatSpecPrefill(max_tokens=10, reasoning=True), {}
    thinking = llm.invoke(prompt, **kwargs)
    # the demo template opens "<think>\n" for the model: two more prompt tokens
    assert thinking.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"]
    # the demo model never closes the block, so everything it wrote is reasoning
    assert thinking.content == "" and thinking.additional_kwargs["reasoning_content"]
    chunks = list(llm.stream(prompt, **kwargs))
    assert "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks) == \
        thinking.additional_kwargs["reasoning_content"]


# lifecycle and fields ---------------------------------------------------------------


def test_one_engine_per_model_draft_dtype_and_close(fresh_cache_dir):
    a, b = ChatSpecPrefill(keep=0.3), ChatSpecPrefill(keep=0.6, threshold=64, temperature=0.5)
    assert a.engine is b.engine
    assert shared_engine(None, None, "bfloat16") is not a.engine  # built, not started
    shared_engine(None, None, "bfloat16").shutdown_sync()
    messages, _ = messages_for(4, 700)
    kept = b.invoke(messages, max_tokens=2).response_metadata["specprefill"]
    assert kept["engaged"] and kept["keep"] == 0.6  # keep / threshold travel per request
    c = ChatSpecPrefill(model=str(DEMO_TARGET), draft=None)
    first = c.engine
    assert c.invoke("hi", max_tokens=2).usage_metadata["output_tokens"] >= 1
    c.close()
    assert c.engine is not first  # a later use starts a fresh engine
    assert c.invoke("hi", max_tokens=2).usage_metadata["output_tokens"] >= 1
    asyncio.run(c.aclose())


def test_timeout_aborts_and_raises():
    llm = ChatSpecPrefill(max_tokens=200, specprefill=False, timeout=1e-6)
    messages, _ = messages_for(5, 2000)
    with pytest.raises(TimeoutError):
        llm.invoke(messages)
    with pytest.raises(TimeoutError):
        list(llm.stream(messages))
    with pytest.raises(TimeoutError):
        asyncio.run(llm.ainvoke(messages))
    assert ChatSpecPrefill(max_tokens=2).invoke("hi").content is not None  # engine still fine
    assert not llm.engine.active_request_ids


def test_a_request_that_finished_before_the_timeout_fired_is_delivered_whole():
    """The timer fires while the caller is still reading a request that had already
    finished: the final chunk decides, so all of it arrives and nothing is raised."""
    messages, _ = messages_for(6)
    expected = ChatSpecPrefill(max_tokens=16, specprefill=False).invoke(messages).content
    llm = ChatSpecPrefill(max_tokens=16, specprefill=False, timeout=2.0)
    chunks, start = [], time.perf_counter()
    for chunk in llm.stream(messages):
        if not chunks:  # let the request finish, then the timer fire, before reading on
            while llm.engine.active_request_ids:
                time.sleep(0.01)
            time.sleep(max(0.0, start + 2.5 - time.perf_counter()))
        chunks.append(chunk)
    assert "".join(c.content for c in chunks) == expected
    assert chunks[-1].response_metadata["finish_reason"] in ("stop", "length")


def test_a_call_cut_by_max_tokens_is_invalid_and_says_why():
    llm = ChatSpecPrefill(max_tokens=10).bind_tools([get_weather], tool_choice="any")
    for message in (llm.invoke("Weather in Paris?"), asyncio.run(llm.ainvoke("Weather?"))):
        assert message.tool_calls == [] and len(message.invalid_tool_calls) == 1
        error = message.invalid_tool_calls[0]["error"]
        assert "max_tokens" in error and "'length'" in error and "JSONDecodeError" in error
    # streamed, the error travels in response_metadata (LangChain rebuilds invalid
    # calls from chunks without one)
    streamed = list(llm.stream("Weather in Paris?"))
    total = sum(streamed[1:], streamed[0])
    [call] = total.invalid_tool_calls
    assert "max_tokens" in total.response_metadata["tool_call_errors"][call["id"]]


def test_a_malformed_call_carries_its_parse_error():
    tokenizer = ChatSpecPrefill().tokenizer
    _, calls, invalid = split_tool_calls('<tool_call>\n{"name": "nope", "arguments": {}}\n'
                                         '</tool_call><tool_call>{bad</tool_call>', tokenizer,
                                         tools=[{"type": "function", "function": {
                                             "name": "get_weather", "parameters": {}}}])
    assert calls == [] and len(invalid) == 2
    assert "no bound tool is named 'nope'" in invalid[0]["error"]
    assert invalid[1]["error"].startswith("JSONDecodeError")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_cut_by_max_tokens_says_so(method):
    llm = ChatSpecPrefill(max_tokens=6)
    raw = llm.with_structured_output(Joke, method=method, include_raw=True).invoke("A joke?")
    assert raw["raw"].response_metadata["finish_reason"] == "length"
    assert raw["parsed"] is None
    assert "max_tokens" in str(raw["parsing_error"]) and "'length'" in str(raw["parsing_error"])
    with pytest.raises(OutputParserException, match="max_tokens"):
        llm.with_structured_output(Joke, method=method).invoke("A joke?")
    with pytest.raises(OutputParserException, match="max_tokens"):
        list(llm.with_structured_output(Joke.model_json_schema(), method=method).stream("A joke?"))


def test_standard_parameters_are_accepted_and_a_misspelled_one_is_refused():
    """api_key (what init_chat_model configs and langchain-tests pass) is taken and
    unused; a misspelled setting still fails, naming the nearest field."""
    llm = ChatSpecPrefill(api_key="sk-anything", max_retries=2, timeout=60, max_tokens=2)
    assert llm.api_key.get_secret_value() == "sk-anything"
    assert "sk-anything" not in repr(llm) and "api_key" not in llm._identifying_params
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        ChatSpecPrefill(temprature=0.5)
    with pytest.raises(TypeError, match="'api_keys'; did you mean 'api_key'"):
        ChatSpecPrefill(api_keys="x")


def test_per_call_model_and_unknown_kwargs_are_refused():
    llm = ChatSpecPrefill(max_tokens=2)
    with pytest.raises(ValueError, match="per-call model="):
        llm.invoke("hi", model="other/model")
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.invoke("hi", temprature=1.0)


def test_token_counts_use_the_model_tokenizer():
    llm = ChatSpecPrefill()
    text = "def f(x):\n    return 12345"
    assert llm.get_num_tokens(text) == len(llm.tokenizer.encode(text))
    assert llm.get_num_tokens("12345") == 5  # the demo tokenizer splits digits: not GPT-2


def test_identifying_params_cover_output_settings():
    greedy, hot = ChatSpecPrefill(), ChatSpecPrefill(temperature=1.0, seed=3)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                 "max_tokens", "keep", "threshold", "specprefill", "stop", "dtype",
                 "chat_template_kwargs", "reasoning", "reasoning_budget"):
        assert name in greedy._identifying_params
    assert greedy._get_llm_string() != hot._get_llm_string()
    cache = InMemoryCache()
    set_llm_cache(cache)
    try:
        first = ChatSpecPrefill(max_tokens=6).invoke("hi")
        ChatSpecPrefill(max_tokens=6, temperature=1.0, seed=1).invoke("hi")
        assert len(cache._cache) == 2  # the sampled call was not served the greedy answer
        assert ChatSpecPrefill(max_tokens=6).invoke("hi").content == first.content
        assert len(cache._cache) == 2
    finally:
        set_llm_cache(None)


def test_image_blocks_raise_a_clear_error():
    llm = ChatSpecPrefill(max_tokens=2)
    image = HumanMessage(content=[
        {"type": "text", "text": "What is in this image?"},
        {"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"},
    ])
    with pytest.raises(UnsupportedContentError, match="text-only"):
        llm.invoke([image])
    with pytest.raises(ValueError, match="text-only"):
        llm.invoke([HumanMessage(content=[{"type": "image_url",
                                           "image_url": {"url": "http://x/y.png"}}])])
