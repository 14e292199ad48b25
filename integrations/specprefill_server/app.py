"""`create_app(engine)`: the FastAPI app that serves an Engine over HTTP.

The app's lifespan starts the engine (models load before the port accepts
connections) and shuts it down at the end. In front of the routes, one ASGI
middleware checks the API key (constant-time) and the body size before anything
reads the body. Every error leaves as the API's own JSON shape (`errors.py`).
"""

import hmac
import logging
import time
from contextlib import asynccontextmanager
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from specprefill_engine import Engine

from . import anthropic_api, openai_api, responses_api
from .calls import IGNORED_HEADER
from .errors import APIError, classify, error_body
from .streaming import ClientGone, Gate
from .warmup import warm_up

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)  # served without a key: says only whether the engine is up
PARAMS = set(openai_api.ChatRequest.model_fields) | set(openai_api.CompletionRequest.model_fields) \
    | set(anthropic_api.MessagesRequest.model_fields) \
    | set(responses_api.ResponsesRequest.model_fields)


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (engine settings live in the Engine)."""

    model_name: Optional[str] = None  # the id /v1/models lists; default: the model's folder name
    api_key: Optional[str] = None  # required as `Authorization: Bearer` or `x-api-key` when set
    keepalive: float = 5.0  # seconds between keep-alives while a stream waits for its first token
    max_queued: Optional[int] = None  # past max_batch_size + this in flight: 429; None: all wait
    max_body_bytes: int = 32 << 20  # Anthropic's own request limit
    drain_timeout: float = 30.0  # at SIGINT / SIGTERM: seconds running requests may finish in
    # system-prompt lines left out of the prompt: the `x-name: value` lines clients write
    # there per request (Claude Code's billing header), which would change the prompt's
    # prefix on every request and defeat the prefix cache; "" keeps every line
    metadata_lines: str = r"^x-[A-Za-z0-9-]+:"
    warmup: bool = True  # run the model once before the port accepts (`warmup.py`)

    def __post_init__(self):
        if not self.keepalive > 0:
            raise ValueError(f"keepalive must be > 0 seconds, got {self.keepalive!r}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued must be None or >= 0, got {self.max_queued!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes!r}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        try:
            re.compile(self.metadata_lines)
        except re.error as error:
            raise ValueError(f"metadata_lines is not a regular expression: {error}") from None


@dataclass
class ServerState:
    engine: Engine
    config: ServerConfig
    gate: Gate
    model_name: str
    created: int


class Guard:
    """ASGI middleware: the API key, then the body size (the body is read here, up to
    the limit, and handed on), so a refused request costs no parsing."""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = api_key.encode() if api_key else None

    def _authorized(self, headers) -> bool:
        offered = []
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                offered.append(value[7:].strip())
            elif name == b"x-api-key":
                offered.append(value.strip())
        # every offered key is compared, each in constant time
        return any([hmac.compare_digest(key, self.key) for key in offered])

    @staticmethod
    async def _refuse(error: APIError, scope, receive, send) -> None:
        await JSONResponse(error_body(error, scope["path"]), error.status)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.key is not None and scope["path"] not in OPEN_PATHS \
                and not self._authorized(scope["headers"]):
            return await self._refuse(APIError(401, "missing or wrong API key: send "
                                               "'Authorization: Bearer <key>' or 'x-api-key: "
                                               "<key>'", code="invalid_api_key"),
                                      scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than the server's limit of "
                             f"{self.max_body_bytes} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._refuse(too_large, scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._refuse(too_large, scope, receive, send)
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()  # from here on: the disconnect, when it comes
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


class IgnoredFieldsHeader:
    """ASGI middleware: the response lists the request's fields the server ignored
    (`chat.note_ignored` leaves their names in the request's state)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def sending(message):
            names = (scope.get("state") or {}).get("ignored_fields")
            if message["type"] == "http.response.start" and names:
                header = (IGNORED_HEADER.encode(), ", ".join(names).encode())
                message = dict(message, headers=[*message.get("headers", ()), header])
            await send(message)

        await self.app(scope, receive, sending)


def _validation_error(request: Request, error: RequestValidationError) -> Response:
    """Pydantic's first complaint, as a 400 naming the field (every API answers 400)."""
    problem = error.errors()[0]
    loc = [str(part) for part in problem.get("loc", ()) if part != "body"]
    if problem.get("type") == "json_invalid":
        api = APIError(400, f"the request body is not valid JSON: {problem.get('msg')}")
    else:
        name = ".".join(loc) or "body"
        api = APIError(400, f"{name}: {problem.get('msg')}", loc[0] if loc else None)
    return JSONResponse(error_body(api, request.url.path), 400)


def create_app(engine: Engine, config: Optional[ServerConfig] = None) -> FastAPI:
    """The OpenAI- and Anthropic-compatible app over `engine` (the app owns it: its
    lifespan starts it and shuts it down)."""
    config = config or ServerConfig()
    limit = None if config.max_queued is None else engine.config.max_batch_size + config.max_queued
    name = config.model_name or Path(engine.model_path).name
    state = ServerState(engine, config, Gate(engine, limit), name, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        if config.warmup:
            await warm_up(engine)
        logger.info("serving %s", name)
        try:
            yield
        finally:
            await state.gate.drain(0)  # whatever still runs here is aborted
            await engine.shutdown()
            logger.info("engine shut down")

    app = FastAPI(title="specprefill-engine", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        headers = {"retry-after": "1"} if error.status == 429 else None
        return JSONResponse(error_body(error, request.url.path), error.status, headers)

    async def engine_error(request: Request, error: Exception):
        return await api_error(request, classify(error, PARAMS))

    for kind in (ValueError, TypeError, RuntimeError):
        app.add_exception_handler(kind, engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return await api_error(request, APIError(error.status_code, str(error.detail)))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return Response(status_code=400)  # never read: the client has left

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, 503)
        if state.gate.draining:
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ok", "model": name, "requests": len(state.gate.active)}

    def model_card() -> dict:
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created))
        return {"id": name, "object": "model", "created": state.created,
                "owned_by": "specprefill-engine", "type": "model", "display_name": name,
                "created_at": created_at, "context_length": engine.info.context_length,
                "max_model_len": engine.info.context_length}  # vLLM's name for it

    @app.get("/v1/models")
    async def models():
        """The one model served, in both APIs' list shapes at once."""
        return {"object": "list", "data": [model_card()], "has_more": False,
                "first_id": name, "last_id": name}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"the model {model_id!r} is not served here; this server "
                           f"serves {name!r}", "model", "model_not_found")
        return model_card()

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    return app
