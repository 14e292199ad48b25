"""`ChatSpecPrefill`: a langchain-core chat model backed by a shared Engine.

All four entry points (`_generate`, `_agenerate`, `_stream`, `_astream`) stream from
the engine's worker thread and run the same output parser (content, `<think>`
reasoning, tool calls), so invoke, stream and astream_events give the same message.
Every chat model with the same (model, draft, dtype) shares one engine; `keep`,
`threshold` and the sampling settings travel with each request. Constructing a chat
model loads nothing, and the async entry points never wait on the event loop: the
model load and the chat template's one render (`chat/render.py`) run in a thread.
"""

import asyncio
import atexit
import json
import threading
import uuid
from operator import itemgetter
from typing import Any, AsyncIterator, Iterator, Literal, Optional, Sequence, Union

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.utils import message_chunk_to_message
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field, SecretStr, field_validator, model_validator

from specprefill_engine import Engine

from specprefill_engine.engine import RequestOptions
from specprefill_engine.chat.call import Call, build_call
from specprefill_engine.chat.render import tools_problem
from specprefill_engine.chat.parser_events import ReasoningEvent, TextEvent
from specprefill_engine.engine.sampling import check_keywords
from specprefill_engine.chat.tool_calls import ToolsNotSupportedError, check_tool_choice
from specprefill_engine.loading import DTYPES, resolve_dtype

from .messages import to_chat_messages
from .parsers import (
    CutAwareJsonParser, CutAwarePydanticParser, CutAwarePydanticToolsParser, CutAwareToolArgsParser,
)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "seed")
REQUEST_FIELDS = SAMPLING_FIELDS + ("keep", "threshold", "specprefill", "num_draft_tokens")
# What a call (or `bind`) may pass besides the fields above.
CALL_KWARGS = set(REQUEST_FIELDS) | {
    "stop", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "chat_template_kwargs", "reasoning", "reasoning_budget", "timeout",
}
_engines: dict = {}
_engines_lock = threading.Lock()


def shared_engine(model: Optional[str], draft: Optional[str], dtype: Optional[str] = "auto") -> Engine:
    """One engine per (model, draft, dtype), for every chat model that names them."""
    key = (model, draft, dtype)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model=model, draft=draft, dtype=dtype)
        return _engines[key]


def _release_engine(model, draft, dtype) -> Optional[Engine]:
    with _engines_lock:
        return _engines.pop((model, draft, dtype), None)


@atexit.register
def _shutdown_all() -> None:
    """Stop every shared engine's worker before the interpreter goes away."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        try:
            engine.shutdown_sync()
        except Exception:  # pragma: no cover - best effort at exit
            pass


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
    dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]] = "auto"
    """Weights dtype: "auto" (float32 on the CPU, stored dtype on a GPU), None (stored),
    or a name (an `mx` dtype is taken by its name)."""
    keep: Optional[float] = None
    """Fraction of prompt tokens SpecPrefill keeps (per request); None: the engine's,
    under its draft check (a keep given runs a draft not vouched for)."""
    threshold: Optional[int] = None
    """SpecPrefill may engage from this many new prompt tokens (None: the engine's)."""
    specprefill: Optional[bool] = None
    """None: the engine's automatic policy; True / False: always / never."""
    num_draft_tokens: Optional[int] = None
    """Speculative decoding: tokens the draft proposes a round for a greedy reply decoded
    alone (the same reply, fewer target forwards); 0: off; None: the engine's."""
    max_tokens: Optional[int] = None
    """None: the engine's default (`SamplingParams`); likewise the sampling fields below."""
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = Field(default=None, alias="stop_sequences")
    max_retries: int = 0
    """Accepted (LangChain's standard parameter) but unused: a local engine has no
    transient network failures to retry. Use `.with_retry()` to retry a Runnable."""
    api_key: Optional[SecretStr] = Field(default=None, exclude=True, repr=False)
    """Accepted (LangChain's standard parameter, which `init_chat_model` configs and
    langchain-tests pass) but unused: a local model has no key."""
    timeout: Optional[float] = None
    """Seconds for a whole request; past it the request is aborted and TimeoutError raised."""
    chat_template_kwargs: Optional[dict] = None
    """Passed to the chat template on every request (e.g. {"enable_thinking": True})."""
    reasoning: Optional[bool] = None
    """True / False sets the template's `enable_thinking`; None leaves the template's default.
    `<think>` blocks always go to additional_kwargs["reasoning_content"]."""
    reasoning_budget: Optional[int] = None
    """Most tokens a constrained reply may think before `</think>` is forced (None:
    half of max_tokens). Applies when the prompt opens a think block."""
    streaming: bool = False
    """LangChain's flag: True makes `invoke` stream, so callbacks see each token."""
    parallel_tool_calls: bool = False
    """Let a forced tool-call turn hold several calls (llama.cpp's default is off too:
    small models otherwise repeat a call until max_tokens)."""

    model_config = {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, values: Any) -> Any:
        """An unknown (misspelled) setting fails here rather than being ignored."""
        if isinstance(values, dict):
            names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            check_keywords("ChatSpecPrefill()", values, names)
        return values

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """An `mx` dtype is taken by its name (the engine's key stays a string)."""
        resolved = resolve_dtype(value)  # a ValueError naming dtype
        if value is None or isinstance(value, str):
            return value
        return next(name for name, dtype in DTYPES.items() if dtype == resolved)

    @model_validator(mode="after")
    def _engine_rules(self) -> "ChatSpecPrefill":
        """The engine's own checks of the request settings, at construction rather than
        at the first call."""
        given = self._given(("keep", "threshold", "num_draft_tokens") + SAMPLING_FIELDS)
        RequestOptions.of("ChatSpecPrefill()", {**given, "stop": tuple(self.stop or ())})
        return self

    def _given(self, names, kwargs: Optional[dict] = None) -> dict:
        """The settings a call or the model sets; None leaves the engine's default."""
        values = {name: (kwargs or {}).get(name, getattr(self, name)) for name in names}
        return {name: value for name, value in values.items() if value is not None}

    @property
    def _llm_type(self) -> str:
        return "specprefill"

    @property
    def model_name(self) -> str:
        return self.model or "specprefill-demo"

    @property
    def _identifying_params(self) -> dict:
        """Every setting that changes the output (LangChain's cache keys on these)."""
        params = {"model": self.model_name, "draft": self.draft, "dtype": self.dtype}
        params.update({name: getattr(self, name) for name in REQUEST_FIELDS})
        params.update(stop=self.stop, chat_template_kwargs=self.chat_template_kwargs,
                      reasoning=self.reasoning, reasoning_budget=self.reasoning_budget,
                      parallel_tool_calls=self.parallel_tool_calls)
        return params

    @property
    def engine(self) -> Engine:
        return shared_engine(self.model, self.draft, self.dtype)

    @property
    def tokenizer(self):
        """The target's tokenizer (starts the engine: models load on first use)."""
        return self.engine.tokenizer

    # lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Shut down the engine this model shares with every chat model of the same
        (model, draft, dtype); requests in flight on it are aborted. A later call
        on any of them starts a fresh engine."""
        engine = _release_engine(self.model, self.draft, self.dtype)
        if engine is not None:
            engine.shutdown_sync()

    async def aclose(self) -> None:
        engine = _release_engine(self.model, self.draft, self.dtype)
        if engine is not None:
            await engine.shutdown()

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> dict:
        params = super()._get_ls_params(stop=stop, **kwargs)
        # A per-call model= is refused when the call runs; the trace shows what was asked.
        params.update(ls_provider="specprefill", ls_model_name=kwargs.get("model", self.model_name),
                      ls_temperature=kwargs.get("temperature", self.temperature),
                      ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # tokens ---------------------------------------------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (offline; no GPT-2 fallback)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Optional[Sequence] = None) -> int:
        """Prompt tokens of these messages as a request sends them (chat template,
        tools and generation prompt included)."""
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        rendered = self.engine.render(to_chat_messages(messages), formatted,
                                      self._template_kwargs({}))
        return int(rendered.tokens.size)

    # request building -------------------------------------------------------------

    def _template_kwargs(self, kwargs: dict) -> dict:
        merged = dict(self.chat_template_kwargs or {})
        reasoning = kwargs.get("reasoning", self.reasoning)
        if reasoning is not None:
            merged["enable_thinking"] = bool(reasoning)
        merged.update(kwargs.get("chat_template_kwargs") or {})
        return merged

    def _request(self, messages: list[BaseMessage], stop: Optional[list[str]],
                 kwargs: dict) -> tuple:
        """(the engine call, its output parser, timeout) for one call (`chat/call.py`,
        as the server builds its calls). Loads the model on first use and renders the
        chat template: async callers run it in a thread."""
        kwargs = dict(kwargs)
        kwargs.pop("ls_structured_output_format", None)
        if "model" in kwargs:
            raise ValueError(
                f"ChatSpecPrefill does not take a per-call model= (got {kwargs['model']!r}): "
                "one engine holds one model pair; make another ChatSpecPrefill(model=...)")
        check_keywords("a ChatSpecPrefill call", kwargs, CALL_KWARGS)
        chat = to_chat_messages(messages)
        options = self._given(REQUEST_FIELDS, kwargs)
        stops = list(self.stop or []) + list(stop or []) + list(kwargs.get("stop") or [])
        if stops:
            options["stop"] = stops
        try:
            call = build_call(
                self.engine, chat, options, tools=kwargs.get("tools") or None,
                tool_choice=kwargs.get("tool_choice"),
                parallel=kwargs.get("parallel_tool_calls", self.parallel_tool_calls),
                response_format=kwargs.get("response_format"),
                reasoning_budget=kwargs.get("reasoning_budget", self.reasoning_budget),
                template_kwargs=self._template_kwargs(kwargs))
        except ToolsNotSupportedError as error:
            raise ToolsNotSupportedError(f"{self.model_name}: {error}") from None
        return call, call.parser(self.engine.tokenizer), kwargs.get("timeout", self.timeout)

    # messages -------------------------------------------------------------------

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
            "warnings": list(final.warnings),
        }

    @staticmethod
    def _event_chunk(event) -> AIMessageChunk:
        """An output event as a message chunk; an invalid tool call stays one (LangChain
        has a place for it: invalid_tool_calls)."""
        if isinstance(event, TextEvent):
            return AIMessageChunk(content=event.text)
        if isinstance(event, ReasoningEvent):
            return AIMessageChunk(content="", additional_kwargs={"reasoning_content": event.text})
        call = {"name": event.name, "args": event.args, "id": event.id, "index": event.index,
                "type": "tool_call_chunk"}
        if event.error is None:
            return AIMessageChunk(content="", tool_call_chunks=[call])
        # A malformed or truncated call: its raw text as a JSON string, which LangChain
        # files under invalid_tool_calls (raw text could partly parse as an object).
        # LangChain rebuilds invalid calls from chunks without their error, so the
        # error travels in response_metadata and is put back on the final message.
        return AIMessageChunk(content="",
                              tool_call_chunks=[{**call, "args": json.dumps(event.args)}],
                              response_metadata={TOOL_CALL_ERRORS: {event.id: event.error}})

    def _chunks(self, chunk, call: Call, parser, timed_out, timeout) -> list:
        """Engine chunk -> message chunks (the last carries usage and metadata). The
        final chunk decides: a request aborted by the timeout raises TimeoutError, one
        that finished is delivered whole."""
        if chunk.finish_reason == "abort" and timed_out.is_set():
            raise TimeoutError(f"ChatSpecPrefill request exceeded timeout={timeout}s "
                               "and was aborted")
        events = call.read(parser, chunk.text, chunk.finish_reason)
        messages = [self._event_chunk(event) for event in events]
        if chunk.finish_reason is None:
            return messages
        messages.append(AIMessageChunk(content="", usage_metadata=self._usage(chunk.usage),
                                       response_metadata=self._metadata(chunk),
                                       chunk_position="last"))
        return messages

    # timeouts -------------------------------------------------------------------

    def _arm(self, timeout: Optional[float], request_id: str, done: threading.Event,
             timed_out: threading.Event):
        """A timer that aborts the request at its deadline (retrying until it is known)."""
        if timeout is None:
            return None
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        engine = self.engine

        def fire():
            timed_out.set()
            while not done.is_set() and not engine.abort(request_id):
                done.wait(0.01)

        timer = threading.Timer(timeout, fire)
        timer.daemon = True
        timer.start()
        return timer

    # the four entry points -------------------------------------------------------

    def _sync_chunks(self, messages, stop, kwargs) -> Iterator[AIMessageChunk]:
        call, parser, timeout = self._request(messages, stop, kwargs)
        request_id = f"lc-{uuid.uuid4().hex[:16]}"
        done, timed_out = threading.Event(), threading.Event()
        timer = self._arm(timeout, request_id, done, timed_out)
        try:
            for chunk in self.engine.stream_sync(call.prompt, request_id=request_id,
                                                 **call.options):
                yield from self._chunks(chunk, call, parser, timed_out, timeout)
        finally:
            done.set()
            if timer is not None:
                timer.cancel()

    async def _async_chunks(self, messages, stop, kwargs) -> AsyncIterator[AIMessageChunk]:
        call, parser, timeout = await asyncio.to_thread(self._request, messages, stop, kwargs)
        request_id = f"lc-{uuid.uuid4().hex[:16]}"
        done, timed_out = threading.Event(), threading.Event()
        timer = self._arm(timeout, request_id, done, timed_out)
        stream = self.engine.stream(call.prompt, request_id=request_id, **call.options)
        try:
            async for chunk in stream:
                for message in self._chunks(chunk, call, parser, timed_out, timeout):
                    yield message
        finally:
            done.set()
            if timer is not None:
                timer.cancel()
            await stream.aclose()

    def _generate_with_cache(self, *args, **kwargs) -> ChatResult:
        return _with_call_errors(super()._generate_with_cache(*args, **kwargs))

    async def _agenerate_with_cache(self, *args, **kwargs) -> ChatResult:
        return _with_call_errors(await super()._agenerate_with_cache(*args, **kwargs))

    @staticmethod
    def _result(chunks: list) -> ChatResult:
        total = chunks[0]
        for chunk in chunks[1:]:
            total = total + chunk
        return ChatResult(generations=[ChatGeneration(message=message_chunk_to_message(total))])

    def _generate(self, messages, stop=None, run_manager: Optional[CallbackManagerForLLMRun] = None,
                  **kwargs: Any) -> ChatResult:
        return self._result(list(self._sync_chunks(messages, stop, kwargs)))

    async def _agenerate(self, messages, stop=None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                         **kwargs: Any) -> ChatResult:
        return self._result([c async for c in self._async_chunks(messages, stop, kwargs)])

    def _stream(self, messages, stop=None, run_manager: Optional[CallbackManagerForLLMRun] = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for message in self._sync_chunks(messages, stop, kwargs):
            generation = ChatGenerationChunk(message=message)
            if run_manager:
                run_manager.on_llm_new_token(message.content, chunk=generation)
            yield generation

    async def _astream(self, messages, stop=None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        chunks = self._async_chunks(messages, stop, kwargs)
        try:
            async for message in chunks:
                generation = ChatGenerationChunk(message=message)
                if run_manager:
                    await run_manager.on_llm_new_token(message.content, chunk=generation)
                yield generation
        finally:
            await chunks.aclose()

    # tools and structured output --------------------------------------------------

    def check_tools_supported(self) -> None:
        """Raise ToolsNotSupportedError unless the chat template shows tools to the model
        and the tokenizer knows how the model writes a tool call. Loads the model; a
        request with tools runs the same check (in its thread) before anything runs."""
        problem = tools_problem(self.tokenizer)
        if problem is not None:
            raise ToolsNotSupportedError(f"{self.model_name}: {problem}")

    def bind_tools(self, tools: Sequence[Any], *,
                   tool_choice: Optional[Union[str, dict, bool]] = None,
                   parallel_tool_calls: Optional[bool] = None, **kwargs: Any):
        """Bind tools: the template shows them to the model, calls are parsed from the
        output (also while streaming), and tool_choice is enforced by constrained
        decoding: "auto" (text, or valid calls), "any"/"required" (calls only), a tool
        name (exactly that call), "none" (no calls parsed). Loads nothing: a model
        whose template or tool format cannot serve the tools fails the first call with
        ToolsNotSupportedError, before anything runs."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        names = [t["function"]["name"] for t in formatted]
        check_tool_choice(tool_choice, names)  # validate now, not at the first call
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self, schema: Optional[Union[dict, type]] = None, *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False, strict: Optional[bool] = None, **kwargs: Any,
    ):
        """Structured output through constrained decoding.

        method "json_schema" (default): the reply is JSON matching the schema.
        "json_mode": a JSON object; when a schema is given it is matched too (a local
        engine can enforce it for free). "function_calling": a forced call of a tool
        made from the schema. `strict` is accepted for compatibility: decoding is
        always strict here. A thinking model thinks first (see `reasoning_budget`).
        The output parses unless max_tokens cuts it: then the parser raises an
        OutputParserException that says so (finish_reason "length").
        """
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format={
                "kwargs": {"method": method}, "schema": tool})
            parser = (CutAwarePydanticToolsParser(tools=[schema], first_tool_only=True)
                      if is_pydantic
                      else CutAwareToolArgsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if schema is None and method == "json_schema":
                raise ValueError("method='json_schema' needs a schema")
            json_schema = convert_to_json_schema(schema) if schema is not None else None
            if method == "json_schema":
                response_format = {"type": "json_schema", "json_schema": {
                    "name": json_schema.get("title", "response"), "schema": json_schema}}
            else:
                response_format = {"type": "json_object"}
                if json_schema is not None:
                    response_format["schema"] = json_schema
            llm = self.bind(response_format=response_format, ls_structured_output_format={
                "kwargs": {"method": method}, "schema": json_schema})
            parser = (CutAwarePydanticParser(pydantic_object=schema) if is_pydantic
                      else CutAwareJsonParser())
        else:
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', "
                             f"got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                            parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback],
                                                             exception_key="parsing_error")


TOOL_CALL_ERRORS = "tool_call_errors"  # response_metadata: {call id: parse error}


def _with_call_errors(result: ChatResult) -> ChatResult:
    """Put each invalid tool call's parse error (carried in response_metadata) on it."""
    for generation in result.generations:
        message = getattr(generation, "message", None)
        errors = getattr(message, "response_metadata", {}).get(TOOL_CALL_ERRORS)
        if errors:
            for call in message.invalid_tool_calls:
                if call.get("error") is None:
                    call["error"] = errors.get(call.get("id"))
    return result
