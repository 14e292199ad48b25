"""Errors at the call, in the caller's words: the method named, the nearest valid name,
settings checked when they are given rather than at the first request."""

import asyncio

import mlx.core as mx
import pytest

import langchain_specprefill
import specprefill_engine
from langchain_specprefill import ChatSpecPrefill
from specprefill_engine import Engine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine():
    engine = Engine().start_sync()
    yield engine
    engine.shutdown_sync()


def test_a_misspelled_request_keyword_names_the_method_and_the_right_name(engine):
    hint = "got an unexpected keyword argument 'temprature'; did you mean 'temperature'?"
    with pytest.raises(TypeError, match=r"^Engine\.generate_sync\(\) " + hint):
        engine.generate_sync("hi", temprature=0.5)
    with pytest.raises(TypeError, match=r"^Engine\.stream_sync\(\) " + hint):
        next(engine.stream_sync("hi", temprature=0.5))
    with pytest.raises(TypeError, match=r"^Engine\.generate\(\) " + hint):
        asyncio.run(engine.generate("hi", temprature=0.5))

    async def stream():
        return [chunk async for chunk in engine.stream("hi", temprature=0.5)]

    with pytest.raises(TypeError, match=r"^Engine\.stream\(\) " + hint):
        asyncio.run(stream())
    with pytest.raises(TypeError, match="did you mean 'max_tokens'"):
        engine.generate_sync("hi", max_token=3)
    assert engine.generate_sync("hi", max_tokens=2).usage.completion_tokens <= 2  # still serving


def test_engine_settings_and_dtype_are_checked_at_construction():
    with pytest.raises(TypeError, match=r"^Engine\(\) got an unexpected keyword argument "
                                        r"'max_batch'; did you mean 'max_batch_size'\?"):
        Engine(max_batch=4)
    with pytest.raises(ValueError, match="dtype must be .*got 'bf16'"):
        Engine(dtype="bf16")
    with pytest.raises(ValueError, match="dtype"):
        Engine(dtype=mx.int8)
    for dtype in ("float16", mx.float16):  # a name or the mx dtype: the same engine
        with Engine(dtype=dtype) as engine:
            result = engine.generate_sync("What is the secret passkey?", chat=True, max_tokens=3)
        assert result.usage.completion_tokens >= 1


def test_top_k_past_the_vocabulary_is_refused_at_the_call(engine):
    vocab = engine.info.vocab_size
    for top_k in (vocab, vocab + 1):
        with pytest.raises(ValueError, match=f"top_k must be below the vocabulary size \\({vocab};"):
            engine.generate_sync("hi", top_k=top_k, temperature=1.0)
    assert engine.generate_sync("hi", top_k=vocab - 1, temperature=1.0, seed=0,
                                max_tokens=2).finish_reason in ("stop", "length")


def test_chat_model_settings_are_checked_at_construction():
    with pytest.raises(TypeError, match=r"^ChatSpecPrefill\(\) got an unexpected keyword "
                                        r"argument 'temprature'; did you mean 'temperature'\?"):
        ChatSpecPrefill(temprature=1.0)
    with pytest.raises(ValueError, match=r"keep must be in \(0, 1\], got 3"):
        ChatSpecPrefill(keep=3)
    with pytest.raises(ValueError, match="threshold must be an integer >= 1"):
        ChatSpecPrefill(threshold=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        ChatSpecPrefill(top_p=0)
    with pytest.raises(ValueError, match="dtype must be"):
        ChatSpecPrefill(dtype="bf16")
    assert ChatSpecPrefill(dtype=mx.bfloat16).dtype == "bfloat16"
    assert ChatSpecPrefill(stop_sequences=["\n"]).stop == ["\n"]  # the alias still works
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        ChatSpecPrefill(max_tokens=2).invoke("hi", temprature=1.0)


def test_the_public_exceptions_are_importable_from_the_packages():
    from specprefill_engine.core.adapters import UnsupportedModelError
    from specprefill_engine.engine import EngineFailedError, RequestFailedError
    from specprefill_engine.chat.tool_calls import ToolsNotSupportedError
    from specprefill_engine.loading import ModelLoadError
    from langchain_specprefill.messages import UnsupportedContentError

    engine_errors = {"RequestFailedError": RequestFailedError, "EngineFailedError": EngineFailedError,
                     "ModelLoadError": ModelLoadError, "UnsupportedModelError": UnsupportedModelError,
                     "ToolsNotSupportedError": ToolsNotSupportedError}
    for name, error in engine_errors.items():
        assert getattr(specprefill_engine, name) is error and name in specprefill_engine.__all__
        assert getattr(langchain_specprefill, name) is error
    assert langchain_specprefill.UnsupportedContentError is UnsupportedContentError
    assert "UnsupportedContentError" in langchain_specprefill.__all__
