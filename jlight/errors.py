"""The errors a user can cause, under their public name (`jlight.errors.*`); defined in
jlight/core/errors.py, where every room may import them."""
from jlight.core.errors import EngineOverloadedError, JlightError, ModelLoadError, PromptTooLongError, UnsupportedModelError

__all__ = ["EngineOverloadedError", "JlightError", "ModelLoadError", "PromptTooLongError", "UnsupportedModelError"]
