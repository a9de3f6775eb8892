"""Errors a user can cause and act on. Each carries a one-line message that names the problem."""

from __future__ import annotations


class ArleError(Exception):
    """Base of every error arle reports to a user (CLI: one line on stderr; HTTP: error JSON)."""

    #: OpenAI-style error type and the HTTP status the server maps it to.
    error_type: str = "internal_error"
    http_status: int = 500
    #: CLI exit status.
    exit_code: int = 1


class ModelLoadError(ArleError):
    """A model file or directory that cannot be used: names the path and the problem."""

    error_type = "model_error"
    exit_code = 2

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class InvalidRequestError(ArleError):
    """A request the engine refuses before admitting it (bad parameter, prompt too long)."""

    error_type = "invalid_request_error"
    http_status = 400
    exit_code = 2

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class OverloadedError(ArleError):
    """The waiting queue is full: retry later."""

    error_type = "overloaded_error"
    http_status = 503
    exit_code = 3


class EngineStepError(ArleError):
    """A failure inside one engine step; the requests of that step fail, the engine goes on."""

    error_type = "internal_error"
    http_status = 500
