"""Errors a client can cause. Each names the limit it hit; none of them stops the engine."""


class AuguryError(Exception):
    """Base class of every error Augury raises on purpose."""


class InvalidRequestError(AuguryError, ValueError):
    """The request itself is malformed (bad token ids, empty prompt, bad sampling option).

    `param` names the offending field so the gateway can answer 400 with it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedOptionError(InvalidRequestError):
    """An option we understand but refuse rather than silently ignore."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what was asked to generate) does not fit in the model's context."""


class OutOfKVMemoryError(AuguryError):
    """The paged KV cache has too few free blocks for what was asked."""


class UnsupportedModelError(AuguryError):
    """A checkpoint whose architecture or options our runtime does not implement."""
