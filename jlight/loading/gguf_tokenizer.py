"""Builds a jlight Tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE from tokens + merges). The
pre-tokenizer follows `tokenizer.ggml.pre`, the way llama.cpp splits text for that model
family (e.g. SmolLM/StarCoder split digits one by one before the GPT-2 regex).
"""
from __future__ import annotations

from jlight.errors import UnsupportedModelError
from jlight.loading.gguf_loader import field_value
from jlight.tokenizer import Tokenizer

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special; USER_DEFINED ones are
# added tokens matched verbatim but kept in decoded text.
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` values whose text splitting is "digits one by one, then GPT-2's regex".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level  # "gpt2", "default" and unknown values: GPT-2's own regex


def gguf_tokenizer(reader, path: str) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as Backend

    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF file {path} has tokenizer type {kind!r}; jlight builds byte-level BPE ('gpt2') tokenizers from GGUF. "
            "Use the model's HF directory (with tokenizer.json) instead"
        )
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tok, special=(t == _CONTROL), normalized=False)
        for tok, t in zip(tokens, types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_tokens([a for a in added if not a.special])
    backend.add_special_tokens([a for a in added if a.special])

    def token(key):
        idx = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    if field_value(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
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
