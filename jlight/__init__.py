"""jlight: a JAX/XLA inference engine for large language models."""
from jlight.errors import JlightError, ModelLoadError, PromptTooLongError, UnsupportedModelError

__version__ = "0.1.0"

__all__ = ["JlightError", "ModelLoadError", "PromptTooLongError", "UnsupportedModelError", "__version__"]
