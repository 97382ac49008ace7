"""Builds a jlight Tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

Supported:
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE from tokens + merges. The pre-tokenizer
  follows `tokenizer.ggml.pre`, the way llama.cpp splits text for that model family (e.g.
  SmolLM/StarCoder split digits one by one before the GPT-2 regex).
- `"llama"`: SentencePiece BPE (Llama 2, Mistral). GGUF stores pieces and scores, not
  merges; SentencePiece merges the adjacent pair whose joined piece scores highest, which
  is a BPE whose merge ranks are the joined pieces' scores, so merges are rebuilt from them.
- `"gemma4"` (Gemma 4): a BPE over raw UTF-8 characters from tokens + merges, SentencePiece-style.
  llama.cpp reads it as a BPE vocabulary with pre-tokenizer "gemma4" whatever `tokenizer.ggml.pre`
  says: spaces become "\u2581" (no space prepended), text splits into runs of newlines and runs of
  everything else, merges apply lowest rank first within each run, a character with no token falls
  back to its bytes' <0xXX> tokens, a newline run that is itself a token is that token whole, and
  BOS is always added.
"""
from __future__ import annotations

import logging

from jlight.core.errors import UnsupportedModelError
from jlight.loading.gguf_loader import field_value
from jlight.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special; USER_DEFINED ones are
# added tokens matched verbatim but kept in decoded text.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# `tokenizer.ggml.pre` values whose text splitting is "digits one by one, then GPT-2's regex".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k_base (gpt-oss, Llama 4: llama.cpp's GPT4O pre-tokenizer): case-aware letter runs with their
# contraction, digits in threes, a punctuation run taking a trailing newline or slash.
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_PRE = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX, "gpt-4o": _GPT4O_REGEX,
              "llama4": _GPT4O_REGEX}


def _pre_tokenizer(pre: str | None):
    # tokenizers loads only when a tokenizer is built.
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = _REGEX_PRE.get(pre)
    if regex is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in (None, "gpt2", "default"):
        logger.warning("GGUF tokenizer.ggml.pre %r is not one jlight knows; splitting text with GPT-2's regex, which may "
                       "tokenize some text differently from the model's own tokenizer", pre)
    return byte_level  # "gpt2", "default" and unknown values: GPT-2's own regex


def gguf_tokenizer(reader, path: str) -> Tokenizer:
    # tokenizers loads only when a tokenizer is built.
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as Backend

    kind = field_value(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise UnsupportedModelError(
            f"GGUF file {path} has tokenizer type {kind!r}; jlight builds 'gpt2' (byte-level BPE), 'llama' "
            "(SentencePiece BPE) and 'gemma4' (Gemma 4's BPE) tokenizers from GGUF. Use the model's HF directory "
            "(with tokenizer.json) instead"
        )
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "gemma4":
        backend = _gemma4_backend(reader, path, tokens, vocab)
        add_bos_default = True
    else:
        backend = _sentencepiece_backend(reader, tokens, types, vocab)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    added = [
        AddedToken(tok, special=(t in (_CONTROL, _UNKNOWN)), normalized=False)
        for tok, t in zip(tokens, types)
        if t in (_CONTROL, _UNKNOWN, _USER_DEFINED)
    ]
    if kind == "gemma4":
        # llama.cpp emits a newline run that is itself a token whole, merges or not. Such runs
        # are matched as added tokens, which the newline-run split keeps apart from other text.
        # A run that is no token (longer than any) splits into the longest newline tokens here,
        # as in the HF tokenizer, where llama.cpp merges it.
        added += [
            AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(tokens, types)
            if t == _NORMAL and tok and tok.strip("\n") == ""
        ]
    backend.add_tokens([a for a in added if not a.special])
    backend.add_special_tokens([a for a in added if a.special])

    def token(key):
        idx = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    # llama.cpp adds BOS for "gemma4" even where the file says not to.
    add_bos = kind == "gemma4" or field_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    return Tokenizer(
        backend,
        chat_template=field_value(reader, "tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        special_tokens_map={"pad_token": token("padding"), "unk_token": token("unknown")},
    )


def _gemma4_backend(reader, path, tokens, vocab):
    """Gemma 4's BPE as llama.cpp runs it: " " -> "\u2581" (nothing prepended), the text split into
    runs of newlines and runs of everything else, merges (ranked by their order in the file) over
    raw UTF-8 characters, <0xXX> byte tokens for characters with no token. Decoding turns
    "\u2581" back into spaces and joins byte tokens into UTF-8."""
    # tokenizers loads only when a tokenizer is built.
    from tokenizers import Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    merges = field_value(reader, "tokenizer.ggml.merges")
    if not merges:
        raise UnsupportedModelError(f"GGUF file {path} has a 'gemma4' tokenizer without tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut > 0:
            pairs.append((m[:cut], m[cut + 1:]))
    unk_id = field_value(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _sentencepiece_backend(reader, tokens, types, vocab):
    """SentencePiece BPE as a tokenizers BPE: merges ranked by the joined piece's score,
    byte fallback (<0xXX> pieces), "▁" for spaces and one prepended to the text."""
    # tokenizers loads only when a tokenizer is built.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    scores = field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    ranked = []  # (score, id, left, right)
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != _NORMAL:
            continue  # control, byte and unused pieces are never produced by merging
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    unk_id = field_value(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = Backend(
        models.BPE(vocab=vocab, merges=[(l, r) for _, _, l, r in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = field_value(reader, "tokenizer.ggml.add_space_prefix", True)
    # SentencePiece prepends "▁" even when the text already starts with a space (Metaspace
    # would not), so spell the normalization out, as HF's Llama tokenizer does.
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the space prepended at encode time
    backend.decoder = decoders.Sequence(steps)
    return backend
