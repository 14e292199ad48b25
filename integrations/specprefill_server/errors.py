"""Errors as each API shapes them: one `APIError`, two JSON forms.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic: `{"type": "error",
"error": {"type", "message"}}`. Statuses follow both references: 400 bad request, 401
bad key, 404, 413 body too large, 429 overload, 500 a failed request, 503 the engine
cannot serve or the device ran out of memory (both retryable). `classify` turns whatever
a request raised into an `APIError`.
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import specprefill_engine
from specprefill_engine.engine import EngineFailedError, MemoryBudgetError, RequestFailedError

logger = logging.getLogger(__name__)

# status -> (OpenAI type, Anthropic type)
KINDS = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}
_LEADING_NAME = re.compile(r"([a-z_]+)\b")
# the project's own code: a ValueError or TypeError raised there is one of its checks
OWN_CODE = (str(Path(specprefill_engine.__file__).parent), str(Path(__file__).parent))


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None

    def __str__(self) -> str:
        return self.message


def classify(error: BaseException, fields=()) -> APIError:
    """The HTTP answer to an exception; `fields` are the request's parameter names
    (a ValueError that starts with one of them names that parameter)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, MemoryBudgetError):  # the request alone exceeds the KV budget
        return APIError(400, str(error), code="memory_budget_exceeded")
    if isinstance(error, (ValueError, TypeError)) and raised_by_a_check(error):
        match = _LEADING_NAME.match(str(error))  # the engine's checks name the parameter
        param = match.group(1) if match and match.group(1) in fields else None
        return APIError(400, str(error), param)
    if isinstance(error, EngineFailedError):
        return APIError(503, f"the engine cannot serve requests: {error}", code="engine_failed")
    if isinstance(error, RequestFailedError) and out_of_memory(error):
        return APIError(503, f"{error}: the device ran out of memory under this load; retry, "
                        "or give serve a smaller --kv-cache-gb", code="out_of_memory")
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), code="request_failed")
    if isinstance(error, RuntimeError) and "shut down" in str(error):
        return APIError(503, "the engine is shut down", code="engine_shut_down")
    logger.exception("request failed", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


def out_of_memory(error: BaseException) -> bool:
    """Whether a request failed for want of device memory (CUDA, Metal or host)."""
    text = str(error).lower().replace(" ", "")
    return isinstance(error.__cause__, MemoryError) or any(
        sign in text for sign in ("outofmemory", "insufficientmemory", "bad_alloc"))


def raised_by_a_check(error: BaseException) -> bool:
    """Whether the project's own code raised `error` (a check of the request: a 400), not
    a library it called (a failure of the server's: a 500, never the client's fault)."""
    frame, innermost = error.__traceback__, None
    while frame is not None:
        innermost, frame = frame.tb_frame.f_code.co_filename, frame.tb_next
    return innermost is None or innermost.startswith(OWN_CODE)


def openai_body(error: APIError) -> dict:
    return {"error": {"message": error.message, "type": KINDS.get(error.status, KINDS[500])[0],
                      "param": error.param, "code": error.code}}


def anthropic_body(error: APIError) -> dict:
    return {"type": "error", "error": {"type": KINDS.get(error.status, KINDS[500])[1],
                                       "message": error.message}}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(error: APIError, path: str) -> dict:
    return anthropic_body(error) if is_anthropic(path) else openai_body(error)
