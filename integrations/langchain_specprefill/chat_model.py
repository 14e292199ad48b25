"""`ChatSpecPrefill`: a langchain-core chat model backed by a shared Engine.

All four entry points (`_generate`, `_agenerate`, `_stream`, `_astream`) go to the
engine's worker thread directly, so no MLX work reaches LangChain's thread-pool
defaults. Instances with the same model settings (including `bind` and
`with_config` copies) share one engine; constructing one loads nothing.
"""

import threading
from dataclasses import fields
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field

from specprefill_engine import Engine
from specprefill_engine.engine import SamplingParams

from .messages import to_chat_messages
from .tool_calls import split_tool_calls

# Sampling settings this model exposes as fields; stops are merged separately.
SAMPLING_FIELDS = [f.name for f in fields(SamplingParams) if f.name not in ("stop", "stop_token_ids")]
_engines: dict = {}
_engines_lock = threading.Lock()


def shared_engine(model: Optional[str], draft: Optional[str], keep: float, threshold: int) -> Engine:
    """One engine per model pair and policy, for every chat model that names them."""
    key = (model, draft, keep, threshold)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model=model, draft=draft, keep=keep, threshold=threshold)
        return _engines[key]


class ChatSpecPrefill(BaseChatModel):
    """Local MLX chat model with SpecPrefill for long prompts.

    Example:
        llm = ChatSpecPrefill(keep=0.3)            # the bundled demo pair
        llm.invoke("What is the secret passkey?")
    """

    model: Optional[str] = None
    """Target model: local path or Hugging Face id (None: bundled demo)."""
    draft: Optional[str] = None
    """Draft model sharing the target's tokenizer (None with no model: bundled demo)."""
    keep: float = 0.3
    threshold: int = 1024
    specprefill: Optional[bool] = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = Field(default=None, alias="stop_sequences")
    timeout: Optional[float] = None
    max_retries: int = 0

    model_config = {"populate_by_name": True}

    @property
    def _llm_type(self) -> str:
        return "specprefill"

    @property
    def model_name(self) -> str:
        return self.model or "specprefill-demo"

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.model_name, "draft": self.draft, "keep": self.keep}

    @property
    def engine(self) -> Engine:
        return shared_engine(self.model, self.draft, self.keep, self.threshold)

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> dict:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="specprefill", ls_model_name=kwargs.get("model", self.model_name),
                      ls_temperature=kwargs.get("temperature", self.temperature),
                      ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # request building ----------------------------------------------------------

    def _request(self, messages: list[BaseMessage], stop: Optional[list[str]], kwargs: dict):
        tools = kwargs.pop("tools", None)
        kwargs.pop("tool_choice", None)
        options = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        options["specprefill"] = self.specprefill
        options.update({k: v for k, v in kwargs.items() if k in options or k == "keep"})
        stops = list(self.stop or []) + list(stop or [])
        if stops:
            options["stop"] = stops
        if tools:
            options["tools"] = tools
        return to_chat_messages(messages), options, tools

    def _message(self, text: str, result, tools) -> AIMessage:
        content, calls, invalid = split_tool_calls(text, self.engine.tokenizer, tools)
        return AIMessage(
            content=content, tool_calls=calls, invalid_tool_calls=invalid,
            usage_metadata=self._usage(result.usage),
            response_metadata=self._metadata(result),
        )

    @staticmethod
    def _usage(usage) -> UsageMetadata:
        return UsageMetadata(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            input_token_details={"cache_read": usage.cached_tokens},
        )

    def _metadata(self, final) -> dict:
        return {
            "model_name": self.model_name,
            "model_provider": "specprefill",
            "finish_reason": final.finish_reason,
            "specprefill": vars(final.specprefill).copy(),
            "timings": vars(final.timings).copy(),
        }

    # the four entry points -------------------------------------------------------

    def _generate(self, messages, stop=None, run_manager: Optional[CallbackManagerForLLMRun] = None,
                  **kwargs: Any) -> ChatResult:
        chat, options, tools = self._request(messages, stop, kwargs)
        result = self.engine.generate_sync(chat, **options)
        return ChatResult(generations=[ChatGeneration(message=self._message(result.text, result, tools))])

    async def _agenerate(self, messages, stop=None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                         **kwargs: Any) -> ChatResult:
        chat, options, tools = self._request(messages, stop, kwargs)
        result = await self.engine.generate(chat, **options)
        return ChatResult(generations=[ChatGeneration(message=self._message(result.text, result, tools))])

    def _chunk(self, chunk, run_manager) -> ChatGenerationChunk:
        message = AIMessageChunk(content=chunk.text)
        if chunk.finish_reason is not None:
            message = AIMessageChunk(content=chunk.text, usage_metadata=self._usage(chunk.usage),
                                     response_metadata=self._metadata(chunk), chunk_position="last")
        return ChatGenerationChunk(message=message)

    def _stream(self, messages, stop=None, run_manager: Optional[CallbackManagerForLLMRun] = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        chat, options, _ = self._request(messages, stop, kwargs)
        for chunk in self.engine.stream_sync(chat, **options):
            generation = self._chunk(chunk, run_manager)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=generation)
            yield generation

    async def _astream(self, messages, stop=None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        chat, options, _ = self._request(messages, stop, kwargs)
        stream = self.engine.stream(chat, **options)
        try:
            async for chunk in stream:
                generation = self._chunk(chunk, run_manager)
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=generation)
                yield generation
        finally:
            await stream.aclose()

    # tools -----------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Optional[Any] = None, **kwargs: Any):
        """Pass tool schemas to the chat template; calls are parsed from the output."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        return self.bind(tools=formatted, tool_choice=tool_choice, **kwargs)
