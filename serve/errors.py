"""The one exception the server's handlers raise for a bad request; app.py turns it
into an OpenAI-shaped error body with the status it carries."""
from __future__ import annotations


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code
        self.headers = headers
