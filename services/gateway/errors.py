"""The gateway's errors: OpenAI's error object with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")
