"""`RequestError`: a request the server refuses, with the HTTP status and the offending field.

Raised by the tokenizer manager and the OpenAI layer; the HTTP layer turns it into
`{"error": {"message", "type", "param", "code"}}` with `status_code` and `headers` (a 503 of
an overloaded server, and a 429 of a client over its share, carry `Retry-After`).
"""

from __future__ import annotations

# Seconds an overloaded server asks a refused client to wait before it retries.
RETRY_AFTER_S = 1


class RequestError(ValueError):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.headers = headers

    @classmethod
    def overloaded(cls, message: str) -> RequestError:
        """A 503 asking the client to come back later (queue full, timed out waiting)."""
        return cls(message, None, 503, {"Retry-After": str(RETRY_AFTER_S)})

    @classmethod
    def rate_limited(cls, message: str) -> RequestError:
        """A 429: this client asked for more than its share; it may retry after a while."""
        return cls(message, None, 429, {"Retry-After": str(RETRY_AFTER_S)})

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            405: "MethodNotAllowedError",
            413: "RequestTooLargeError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(self.status_code, "InternalServerError" if self.status_code >= 500 else "Error")

    def to_json(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status_code,
            }
        }
