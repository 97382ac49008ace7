"""Errors a user can cause. Each message names the input at fault and how to fix it.

The CLI prints these as one line and the server turns them into a 4xx; anything else
is a bug in jlight.
"""


class JlightError(ValueError):
    """Base class for errors caused by user input (a subclass of ValueError)."""


class ModelLoadError(JlightError):
    """The model path, hub id or checkpoint file cannot be used."""


class UnsupportedModelError(JlightError):
    """The checkpoint's architecture or quantization type is not supported."""


class PromptTooLongError(JlightError):
    """A prompt (plus the tokens asked for) does not fit in the model's context."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""
