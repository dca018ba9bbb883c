"""Errors in OpenAI's JSON shape with vLLM's statuses and type names (`Bad Request` for bodies
that fail schema validation, as vLLM's pydantic layer says; `BadRequestError` for refusals)."""

from aiohttp import web

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 500: "InternalServerError"}


class ApiError(Exception):
    """A request the engine refuses: becomes `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def validation_error(loc: str, kind: str, message: str, given: str, context: str | None = None) -> ApiError:
    """A body vLLM's request schema refuses, in pydantic's words (`1 validation error: {…}`)."""
    extra = f", 'ctx': {context}" if context else ""
    return ApiError(
        400,
        f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{message}', 'input': '{given}'{extra}}}",
        param=loc,
        kind="Bad Request",
    )
