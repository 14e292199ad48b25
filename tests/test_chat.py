"""render_chat: one render of the chat template gives the prompt's tokens, where each
message and the generation prompt start, the protected segments and the think state."""

from pathlib import Path

import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load

from chat_templates import (
    CODER_TEMPLATE, DEMO_TEMPLATE, GLM_TEMPLATE, RAW_ARGUMENTS_TEMPLATE, THINKING_TEMPLATE,
    demo_variant,
)
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import AGENT_TOOLS, make_agent_session
from specprefill_engine.chat.render import render_chat, wants_object_arguments

TOOLS = list(AGENT_TOOLS)
HISTORY = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where is the parser defined?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "search_code", "arguments": '{"query": "parse_tool_call"}'}}]},
    {"role": "tool", "content": "tool_parsers/json_tools.py: def parse_tool_call(text, tools)",
     "tool_call_id": "call_1"},
    {"role": "user", "content": "And what does it return?"},
]
# Like Qwen3's: an assistant turn that ends the conversation is rendered with an empty
# think block, any other without, so prefixes ending in an assistant turn are not
# prefixes of the whole prompt.
UNSTABLE_TEMPLATE = DEMO_TEMPLATE.replace(
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n",
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{% if loop.last %}<think>\n\n</think>\n\n"
    "{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    templates = {"demo": DEMO_TEMPLATE, "coder": CODER_TEMPLATE, "glm": GLM_TEMPLATE,
                 "thinking": THINKING_TEMPLATE, "raw": RAW_ARGUMENTS_TEMPLATE,
                 "unstable": UNSTABLE_TEMPLATE}
    return {name: load(Path(demo_variant(root / name, template)))
            for name, template in templates.items()}


def tokenized_prefix(tokenizer, messages, tools):
    """A message's start as the old code found it: the tokenized prefix's length."""
    return len(tokenizer.apply_chat_template(messages, tools=tools) if messages else [])


@pytest.mark.parametrize("name", ["demo", "coder", "glm", "thinking"])
def test_one_render_gives_the_tokens_and_every_start(tokenizers, name):
    tokenizer = tokenizers[name]
    chat = [dict(m) for m in HISTORY]
    if name in ("coder", "glm"):  # templates that iterate the arguments take objects
        chat[2] = {**chat[2], "tool_calls": [{**chat[2]["tool_calls"][0], "function": {
            "name": "search_code", "arguments": {"query": "parse_tool_call"}}}]}
    rendered = render_chat(tokenizer, HISTORY, TOOLS, window=None)
    expected = tokenizer.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True)
    assert rendered.tokens.tolist() == expected
    assert rendered.message_starts == [tokenized_prefix(tokenizer, chat[:i], TOOLS)
                                       for i in range(len(chat))]
    assert rendered.generation_start == tokenized_prefix(tokenizer, chat, TOOLS)
    # by default only the starts that are used are rendered: here every one (5 messages)
    assert render_chat(tokenizer, HISTORY, TOOLS).message_starts == rendered.message_starts


def test_a_long_chat_renders_the_starts_it_needs(tokenizers):
    tokenizer = tokenizers["demo"]
    chat = [HISTORY[0]] + [{"role": "user", "content": f"question {i}"} if i % 2 == 0 else
                           {"role": "assistant", "content": f"answer {i}"} for i in range(20)]
    rendered = render_chat(tokenizer, chat, TOOLS, window=3)
    given = [i for i, start in enumerate(rendered.message_starts) if start is not None]
    assert given == [0, 1, 18, 19, 20]  # start, system end, the last three (20: the newest)
    full = render_chat(tokenizer, chat, TOOLS, window=None)
    assert all(full.message_starts[i] == rendered.message_starts[i] for i in given)
    assert np.array_equal(full.protected, rendered.protected)


def test_protected_segments_are_the_old_ones(tokenizers):
    tokenizer = tokenizers["demo"]
    session = make_agent_session(tokenizer, 1, 3000, 2)
    messages = session.messages(1, ["123456"])
    rendered = render_chat(tokenizer, messages, TOOLS)
    system_end = tokenized_prefix(tokenizer, messages[:1], TOOLS)
    newest = tokenized_prefix(tokenizer, messages[:-1], TOOLS)
    assert rendered.protected[:system_end].all() and rendered.protected[newest:].all()
    assert rendered.protected[system_end:newest].mean() < 0.2  # documents left to selection


@pytest.mark.parametrize("name", ["demo", "coder"])
def test_the_question_is_the_newest_user_message_where_the_call_and_its_result_follow(
        tokenizers, name):
    """An agent's prompt: the user's question, the call, the file it read; the question's
    own words (not its role markers) are the draft's query. A prompt that ends with the
    user's message has none: its last tokens are the question."""
    tokenizer = tokenizers[name]
    rendered = render_chat(tokenizer, HISTORY[:4], TOOLS)
    assert tokenizer.decode(rendered.tokens[rendered.question].tolist()).strip() == \
        HISTORY[1]["content"]
    assert render_chat(tokenizer, HISTORY, TOOLS).question is None
    assert render_chat(tokenizer, HISTORY[:2], TOOLS).question is None


def test_a_template_that_is_not_prefix_stable_falls_back(tokenizers):
    tokenizer = tokenizers["unstable"]
    chat = HISTORY[:2] + [{"role": "assistant", "content": "In json_tools.py."},
                          {"role": "user", "content": "Thanks. And the return value?"}]
    rendered = render_chat(tokenizer, chat, window=None)
    assert rendered.tokens.tolist() == tokenizer.apply_chat_template(chat,
                                                                     add_generation_prompt=True)
    # messages[:3] ends with the assistant turn, rendered with a think block here only
    assert rendered.message_starts[3] is None
    assert rendered.message_starts[:3] == [tokenized_prefix(tokenizer, chat[:i], None)
                                           for i in range(3)]
    assert rendered.generation_start == tokenized_prefix(tokenizer, chat, None)
    # the newest message's start is unknown, so it is not kept whole as it is with a
    # stable template (the same chat, the same tokens up to there)
    stable = render_chat(tokenizers["demo"], chat)
    newest = stable.message_starts[3]
    assert stable.protected[newest:].all() and not rendered.protected[newest:].all()


def test_think_state_of_the_generation_prompt(tokenizers):
    question = [{"role": "user", "content": "What is x?"}]
    demo = tokenizers["demo"]
    assert render_chat(demo, question).think is None
    assert render_chat(demo, question, chat_template_kwargs={"enable_thinking": True}).think_open
    assert render_chat(tokenizers["thinking"], question).think == "open"
    # a user message that mentions <think> leaves the generation prompt as it is
    tricky = [{"role": "user", "content": "Explain the <think> tag."}]
    assert render_chat(demo, tricky).think is None


def test_history_tool_arguments_reach_the_template_as_it_takes_them(tokenizers):
    assert wants_object_arguments(tokenizers["coder"]) and wants_object_arguments(tokenizers["glm"])
    assert not wants_object_arguments(tokenizers["raw"])
    as_object = [{**m, "tool_calls": [{**m["tool_calls"][0], "function": {
        "name": "search_code", "arguments": {"query": "parse_tool_call"}}}]}
        if m.get("tool_calls") else m for m in HISTORY]
    for chat in (HISTORY, as_object):  # JSON strings or objects, from any caller
        coder = render_chat(tokenizers["coder"], chat, TOOLS).text
        assert "<parameter=query>\nparse_tool_call\n</parameter>" in coder
        glm = render_chat(tokenizers["glm"], chat, TOOLS).text
        assert "<arg_key>query</arg_key><arg_value>parse_tool_call</arg_value>" in glm
        raw = render_chat(tokenizers["raw"], chat).text
        assert '<call name="search_code">{"query": "parse_tool_call"}</call>' in raw


def test_the_engine_takes_a_rendered_chat():
    with Engine() as engine:
        tokenizer = engine.tokenizer
        rendered = render_chat(tokenizer, HISTORY, TOOLS)
        direct = engine.generate_sync(HISTORY, tools=TOOLS, max_tokens=6)
        again = engine.generate_sync(rendered, max_tokens=6)
        assert again.token_ids == direct.token_ids
        assert again.usage.prompt_tokens == rendered.tokens.size
        with pytest.raises(ValueError, match="render_chat"):
            engine.generate_sync(rendered, tools=TOOLS)
        with pytest.raises(ValueError, match="role"):
            render_chat(tokenizer, [{"role": "robot", "content": "hi"}])
