"""Errors that reach a client. Each knows its HTTP status; each API renders it in its own shape.

    ApiError (500, api_error)                        internal_error(exc): a bug, not the client's
    ├── BadRequest (400, invalid_request_error)      the message says what to fix
    │   ├── ContextOverflow (400, context_length_exceeded)
    │   │   └── TextTooLong                          refused before it was tokenized
    │   └── TooLarge (413; Anthropic: request_too_large)   the body is over max_body_bytes
    ├── Unauthorized (401, authentication_error)
    ├── NotFound (404, not_found_error)
    ├── MethodNotAllowed (405, invalid_request_error)
    ├── QueueFull (429, rate_limit_error)            with Retry-After
    ├── NotSupported (501, not_supported_error)      llama-server's: a feature not served
    └── WorkerFailed (503/500, api_error)             the worker died or is unreachable

Cache faults are not here: they never reach a client (they degrade to a miss).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class ApiError(Exception):
    status = 500
    kind = "api_error"  # OpenAI `type`; mapped to Anthropic's error type below
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(ApiError):
    status = 400
    kind = "invalid_request_error"


class ContextOverflow(BadRequest):
    code = "context_length_exceeded"

    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        super().__init__(
            f"This model's maximum context length is {n_ctx} tokens, but the prompt is "
            f"{n_prompt} tokens (prompt is too long: {n_prompt} tokens > {n_ctx} maximum). "
            "Shorten the conversation or start prefixgate with a larger --n-ctx.",
            param="messages",
        )
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


class TextTooLong(ContextOverflow):
    """A text that cannot fit the context whatever its tokens: more characters than `n_ctx`
    of the vocabulary's longest token cover. Refused before it is tokenized; `n_prompt` is a
    lower bound of its tokens."""

    def __init__(self, n_chars: int, n_ctx: int, max_token_chars: int, param: str) -> None:
        at_least = -(-n_chars // max_token_chars)
        BadRequest.__init__(
            self,
            f"This model's maximum context length is {n_ctx} tokens, but the text is "
            f"{n_chars} characters, at least {at_least} tokens (no token of this model is "
            f"longer than {max_token_chars} characters): prompt is too long: {at_least} tokens "
            f"> {n_ctx} maximum. Send less text, or start prefixgate with a larger --n-ctx.",
            param=param,
        )
        self.n_prompt = at_least
        self.n_ctx = n_ctx


class TooLarge(BadRequest):
    status = 413


def internal_error(exc: BaseException) -> ApiError:
    """What a client sees of an exception that is not an ApiError: its type, nothing more."""
    return ApiError(f"internal error: {type(exc).__name__}; this is a bug, please report it")


class Unauthorized(ApiError):
    status = 401
    kind = "authentication_error"


class NotFound(ApiError):
    status = 404
    kind = "not_found_error"


class MethodNotAllowed(ApiError):
    status = 405
    kind = "invalid_request_error"


class NotSupported(ApiError):
    status = 501
    kind = "not_supported_error"


class QueueFull(ApiError):
    status = 429
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class WorkerFailed(ApiError):
    status = 503
    kind = "api_error"


class Loading(ApiError):
    """Everything but /health while the model loads (llama-server's 503 "Loading model")."""

    status = 503
    kind = "unavailable_error"

    def __init__(self, phase: str) -> None:
        super().__init__(f"Loading model ({phase}); /health says when it is ready")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "api_error": "api_error",
}


def openai_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def anthropic_body(e: ApiError) -> dict[str, Any]:
    message = e.message
    if isinstance(e, ContextOverflow):  # Claude Code compacts on exactly this text
        message = f"prompt is too long: {e.n_prompt} tokens > {e.n_ctx} maximum"
    if e.status == 503:
        return {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    if e.status == 413:
        return {"type": "error", "error": {"type": "request_too_large", "message": message}}
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES[e.kind], "message": message}}


def openai_response(e: ApiError) -> web.Response:
    return web.json_response(openai_body(e), status=e.status, headers=e.headers())


def anthropic_response(e: ApiError) -> web.Response:
    return web.json_response(anthropic_body(e), status=e.status, headers=e.headers())
