"""Expected failures of the domain. The API maps each to one HTTP status in one table."""

from __future__ import annotations


class DomainError(Exception):
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(DomainError):
    pass


class NotFound(DomainError):
    code = "not_found"


class Conflict(DomainError):
    """An illegal status transition, such as cancelling a completed batch."""

    code = "invalid_state"


class TooLarge(DomainError):
    code = "file_too_large"


class Unauthorized(DomainError):
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(DomainError):
    type = "permission_error"
    code = "insufficient_permissions"
