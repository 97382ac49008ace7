"""jlight: a JAX/XLA inference engine for large language models.

`jlight.generate(...)` for one call, `jlight.LLM(model)` to keep a model loaded.
Heavy modules load lazily, so `import jlight` is cheap.
"""
from jlight.core.errors import JlightError, ModelLoadError, PromptTooLongError, UnsupportedModelError
from jlight.engine.outputs import CompletionOutput, RequestOutput
from jlight.engine.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("LLM", "generate"):
        # The engine loads on first use, so `import jlight` stays cheap.
        from jlight import api

        return getattr(api, name)
    raise AttributeError(f"module 'jlight' has no attribute {name!r}")


__all__ = ["LLM", "generate", "SamplingParams", "RequestOutput", "CompletionOutput", "JlightError",
           "ModelLoadError", "PromptTooLongError", "UnsupportedModelError", "__version__"]
