"""Client-visible errors: one exception type carrying a reason code, rendered per transport.

Every failure a client can see maps to an `ErrorCode` (worker_runtime/wire.py), which fixes both the
HTTP status and the gRPC status, so the two front doors cannot disagree about what went wrong.
"""

from __future__ import annotations

from worker_runtime.wire import ErrorCode, ErrorInfo

# OpenAI's `error.type` families; clients branch on these more than on the code.
_OPENAI_TYPE = {
    ErrorCode.INVALID_REQUEST: "invalid_request_error",
    ErrorCode.TOO_LARGE: "invalid_request_error",
    ErrorCode.MODEL_NOT_FOUND: "invalid_request_error",
    ErrorCode.UNAUTHENTICATED: "authentication_error",
    ErrorCode.OVERLOADED: "rate_limit_error",
    ErrorCode.CANCELLED: "cancelled",
    ErrorCode.DEADLINE_EXCEEDED: "timeout_error",
}


class APIError(Exception):
    """A request that ends with a reason-coded error (raised anywhere, rendered at the edge)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 retry_after: float | None = None, openai_code: str | None = None,
                 status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, for 429
        self.openai_code = openai_code or _reason(code)
        self.status = status  # an HTTP status other than the code's (404, 405, 415, 431, ...)
        self.reason = reason or _reason(code)  # the `reason` label of the request metrics
        self.counted = False  # set once the request metrics have recorded this error

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "APIError":
        return cls(info.code, info.message or info.code.name.lower())

    @property
    def http_status(self) -> int:
        return self.status or self.code.http_status

    def body(self) -> dict:
        """OpenAI-style error body."""
        return {"error": {"message": self.message,
                          "type": _OPENAI_TYPE.get(self.code, "server_error"),
                          "param": self.param,
                          "code": self.openai_code}}


def invalid(message: str, param: str | None = None, openai_code: str | None = None) -> APIError:
    return APIError(ErrorCode.INVALID_REQUEST, message, param, openai_code=openai_code)


def _reason(code: ErrorCode) -> str:
    return code.name.lower()


def reason_label(code: ErrorCode) -> str:
    """The `reason` label of the request metrics for an error code."""
    return _reason(code)


def shutting_down() -> APIError:
    """What a request gets when the router stops under it (or before admitting it)."""
    return APIError(ErrorCode.NO_WORKER, "the server is shutting down; retry on another replica",
                    openai_code="shutting_down", reason="shutdown")
