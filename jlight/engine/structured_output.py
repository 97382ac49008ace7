"""Structured outputs: sampling held to a JSON schema, any JSON object, a regex, a list of choices or a grammar.

Each constrained sequence carries a grammar matcher (llguidance) on the host. Before a step in
which the sequence samples, its matcher writes the bitmask of the tokens allowed next; the
sampler sets every other logit to -inf before temperature, top-k and top-p. After the step the
host feeds the sampled token back to the matcher. The next mask depends on the token just
sampled, so a constrained sequence is scheduled only when the host has its last token: while
other sequences keep the device busy it runs every other step (the engine otherwise runs one
step ahead), and it never holds back the rest of the batch.

llguidance is imported on first use only, so engines that never see a constrained request do
not need it.
"""
from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np

_FIELDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_REMEMBERED_GRAMMARS = 256


@dataclasses.dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one of the fields. The names are vLLM's (`StructuredOutputsParams`)."""
    json: dict | str | None = None  # a JSON schema (a dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a Lark grammar, or a GBNF one (llama.cpp's)

    @classmethod
    def coerce(cls, value) -> "StructuredOutputParams":
        """A StructuredOutputParams from itself or a dict of its fields; ValueError naming what is wrong."""
        if isinstance(value, cls):
            return value.validate()
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a dict with one of {', '.join(_FIELDS)} "
                             f"(or a StructuredOutputParams), not {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                             f"give one of {', '.join(_FIELDS)}")
        return cls(**value).validate()

    def validate(self) -> "StructuredOutputParams":
        given = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_FIELDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict, or its JSON text)")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON ({e})") from None
        if self.json_object not in (True, False):
            raise ValueError("structured_outputs.json_object must be true or false")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return self

    def kind(self) -> str:
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) for these constraints."""
        # llguidance loads only for requests with structured outputs.
        from llguidance import grammar_from

        kind = self.kind()
        if kind == "json":
            return grammar_from("json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if kind == "json_object":
            return grammar_from("json_schema", '{"type": "object"}')
        if kind == "choice":
            return grammar_from("choice", json.dumps(list(self.choice)))
        return grammar_from("regex" if kind == "regex" else "grammar", getattr(self, kind))


def _import_llguidance():
    try:
        # llguidance loads only for requests with structured outputs.
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise ValueError("structured outputs need the llguidance package; install it with "
                         "`pip install llguidance`") from None
    return llguidance


class GrammarCompiler:
    """Builds matchers for one engine's tokenizer and fills their masks (host side, thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        # The model's logits may be wider than the tokenizer's vocabulary (padding) or, rarely, narrower:
        # masks cover both, and tokens the tokenizer lacks are never allowed.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._executor = None
        self._lock = threading.Lock()
        self._checked: dict[str, str] = {}  # params as JSON -> grammar text, for valid params

    def _tok(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _import_llguidance()
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this model has none")
                if not self._eos:
                    raise ValueError("structured outputs need an EOS token id; this model's config and tokenizer name none")
                # About half a second for SmolLM2's 49k vocabulary; once per engine.
                try:
                    self._ll_tokenizer = llg.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
                except ValueError as e:  # e.g. a WordLevel vocabulary without a byte-level decoder
                    raise ValueError(f"structured_outputs are not available with this model's tokenizer: llguidance "
                                     f"cannot read it ({_one_line(e)})") from None
                self._executor = llg.LLExecutor()
            return self._ll_tokenizer

    def check(self, params: StructuredOutputParams) -> str:
        """The grammar text of valid params; ValueError with llguidance's message otherwise.
        Valid ones are remembered (a server sees the same few schemas again and again)."""
        key = json.dumps(dataclasses.asdict(params), sort_keys=True, default=repr)
        with self._lock:
            text = self._checked.get(key)
        if text is not None:
            return text
        llg = _import_llguidance()
        kind = params.kind()
        try:
            text = params.grammar_text()
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_one_line(e)}") from None
        error = llg.LLMatcher.validate_grammar(text, self._tok())
        if error:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_one_line(error)}")
        with self._lock:
            if len(self._checked) >= MAX_REMEMBERED_GRAMMARS:
                self._checked.pop(next(iter(self._checked)))  # the oldest
            self._checked[key] = text
        return text

    def matcher(self, params: StructuredOutputParams):
        llg = _import_llguidance()
        m = llg.LLMatcher(self._tok(), self.check(params), log_level=0)
        if m.is_error():  # validate_grammar passed, so this is unexpected; still said, not ignored
            raise ValueError(f"structured_outputs.{params.kind()} is invalid: {_one_line(m.get_error())}")
        return m

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def fill_masks(self, matchers: list[tuple[object, int]], bitmask: np.ndarray) -> None:
        """Write each (matcher, row)'s allowed tokens into bitmask[row] (bit t of word t // 32)."""
        # llguidance loads only for requests with structured outputs.
        from llguidance.numpy import fill_next_token_bitmask_par

        self._tok()
        fill_next_token_bitmask_par(self._executor, matchers, bitmask)


def _one_line(e) -> str:
    """llguidance's message on one line (its regex errors put the reason on a later line), shortened."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
