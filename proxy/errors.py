"""Errors as part of the interface: a status, a message, and each dialect's own error shape."""

from __future__ import annotations

from typing import Any, Literal

Dialect = Literal["openai", "anthropic", "google"]  # OpenAI Chat and Responses share one shape

# Anthropic names an error by its kind; OpenAI by a free-form type plus the status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
# Google names an error by its canonical gRPC status (google.rpc.Code) beside the HTTP one.
_GOOGLE_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class ProxyError(Exception):
    """A request the proxy answers with an error instead of a completion."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.close_connection = close_connection  # the connection is closed once the error is sent


def error_body(dialect: Dialect, status: int, message: str) -> dict[str, Any]:
    """The JSON body each SDK parses into its own exception type."""
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    if dialect == "google":
        return {"error": {"code": status, "message": message, "status": _GOOGLE_STATUSES.get(status, "UNKNOWN")}}
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "api_error"), "param": None,
                      "code": status}}
