"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

Wraps a `tokenizers.Tokenizer` built from a HF `tokenizer.json` or from GGUF metadata
(jlight/loading/gguf_tokenizer.py). Chat templates are rendered with jinja2 the way
transformers renders them (same environment options, filters and globals), so a prompt
jlight builds matches `apply_chat_template(..., tokenize=False)`.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Iterable, Sequence

from jlight.core.errors import ModelLoadError

REPLACEMENT_CHAR = "\ufffd"
# Lists longer than this decode through tokenizers' batch call, which releases the GIL (its single
# decode holds it); shorter ones, the incremental detokenizer's, take the cheaper single call.
LONG_DECODE_IDS = 1024


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (printable stand-ins for the 256 bytes), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_DECODER = _byte_level_decoder()


class Tokenizer:
    def __init__(
        self,
        backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        special_tokens_map: dict[str, str] | None = None,
    ):
        """backend: a tokenizers.Tokenizer. special_tokens_map: template variables such as
        pad_token/unk_token (bos_token/eos_token are added from the arguments)."""
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_tokens_map = {k: v for k, v in (special_tokens_map or {}).items() if v is not None}
        self.special_tokens_map.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None})
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos = {backend.token_to_id(eos_token)} if eos_token else set()
        self.eos_token_ids = sorted(i for i in eos | set(extra_eos_token_ids) if i is not None)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str, generation_config: dict | None = None) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from a HF directory."""
        # tokenizers loads only when a tokenizer is built.
        from tokenizers import Tokenizer as Backend

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{model_dir} has no tokenizer.json; jlight needs a fast (tokenizers) tokenizer file")
        try:
            backend = Backend.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path} could not be read ({e}); re-download it") from None
        cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        template = _pick_template(cfg.get("chat_template"))
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        tokens = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        gen_eos = (generation_config or {}).get("eos_token_id") or []
        return cls(
            backend,
            chat_template=template,
            bos_token=tokens["bos_token"],
            eos_token=tokens["eos_token"],
            extra_eos_token_ids=gen_eos if isinstance(gen_eos, list) else [gen_eos],
            special_tokens_map=tokens,
        )

    def save_pretrained(self, directory: str) -> None:
        """Write tokenizer.json + tokenizer_config.json (chat template, special tokens), so a
        GGUF model's tokenizer survives `jlight convert` and loads back with from_dir."""
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        cfg = {**self.special_tokens_map, "chat_template": self.chat_template}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=1, ensure_ascii=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`. It runs in tokenizers' batch call, which releases the GIL (the single
        `encode` holds it: a megabyte of text would stop every other thread, the server's event loop
        among them, for a second), and without character offsets, which nothing here reads."""
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a str, got {type(text).__name__}; pass token ids to the engine directly instead")
        batch_encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # _fast: tokenizers >= 0.20
        return batch_encode([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > LONG_DECODE_IDS:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. Decoding a token alone gives U+FFFD when it holds
        part of a multi-byte character; OpenAI's logprobs report its bytes instead, so the
        client can join them. Byte-level BPE pieces map back through GPT-2's byte alphabet,
        SentencePiece byte-fallback pieces are `<0xHH>`."""
        text = self.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return text.encode("utf-8")
        piece = self.backend.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if piece and all(ch in _BYTE_LEVEL_DECODER for ch in piece):
            return bytes(_BYTE_LEVEL_DECODER[ch] for ch in piece)
        return text.encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt (completions) instead of chat messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        # jinja2 loads only for chat templates.
        import jinja2

        variables = {**self.special_tokens_map, **kwargs}
        try:
            template = _compile_template(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError) as e:
            # Templates reject bad conversations with raise_exception (e.g. roles not alternating), and fail
            # with TypeError on contents they cannot concatenate (None, a list of parts): the caller's input.
            raise ValueError(f"the chat template rejected these messages: {e}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Only complete text is emitted: while the decoded tail ends in U+FFFD (a multi-byte
    character split across tokens), it is held back. Decoding re-runs over a short window
    (`prefix_offset`..end) rather than the whole sequence, and deltas are measured against
    the window's already-emitted part, so tokenizers whose decode depends on the first
    token (SentencePiece's leading space) still concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: ids before it are fully emitted
        self.read_offset = 0  # ids before it have been emitted as text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return the text they complete (possibly "")."""
        self.ids.extend(int(t) for t in token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        emitted = decode(self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.ids[self.prefix_offset :])
        if len(window) <= len(emitted) or window.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(emitted) :]

    def flush(self) -> str:
        """Text still held back at the end of a stream (e.g. a truly invalid byte sequence)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        emitted = decode(self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(emitted) :]


# --- chat template rendering (mirrors transformers' jinja environment) ---------------------

_TEMPLATE_CACHE: dict[str, object] = {}


def _compile_template(source: str):
    if source not in _TEMPLATE_CACHE:
        # jinja2 loads only for chat templates.
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' tojson: no HTML escaping, unicode kept as is.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


def _make_generation_tag():
    # jinja2 loads only for chat templates.
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTag


_GenerationTag = _make_generation_tag()


def _pick_template(value) -> str | None:
    """tokenizer_config's chat_template is a string or a list of {name, template}; take 'default'."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default") or next(iter(named.values()), None)
    return value


def _token_text(value) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download it") from None
