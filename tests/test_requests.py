"""How a request's prompt is read and what its stream says: a plain string is raw
text (mlx-lm's convention) unless `chat=True`; the last chunk carries the warnings."""

import pytest

from specprefill_engine import Engine

pytestmark = pytest.mark.timeout(300)
QUESTION = "What is the secret passkey?"


@pytest.fixture(scope="module")
def engine():
    engine = Engine().start_sync()
    yield engine
    engine.shutdown_sync()


def test_a_string_is_raw_text_and_chat_true_applies_the_template(engine):
    tokenizer = engine.tokenizer
    raw = engine.generate_sync(QUESTION, max_tokens=8)
    assert raw.usage.prompt_tokens == len(tokenizer.encode(QUESTION))
    as_chat = engine.generate_sync(QUESTION, chat=True, max_tokens=8)
    messages = engine.generate_sync([{"role": "user", "content": QUESTION}], max_tokens=8)
    template = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True)
    assert as_chat.usage.prompt_tokens == len(template) > raw.usage.prompt_tokens
    assert as_chat.token_ids == messages.token_ids and as_chat.text.strip()
    with pytest.raises(ValueError, match="chat=True applies to a string prompt; token ids"):
        engine.generate_sync([1, 2, 3], chat=True)
    with pytest.raises(TypeError, match="chat must be True or False"):
        engine.generate_sync(QUESTION, chat="yes")


def test_the_last_chunk_carries_the_warnings(engine):
    context = engine.info.context_length
    chunks = list(engine.stream_sync(QUESTION, chat=True, max_tokens=context))
    assert all(chunk.warnings == [] for chunk in chunks[:-1])
    assert len(chunks[-1].warnings) == 1
    assert chunks[-1].warnings[0].startswith(f"max_tokens clamped from {context} to ")
    result = engine.generate_sync(QUESTION, chat=True, max_tokens=context)
    assert result.warnings == chunks[-1].warnings
