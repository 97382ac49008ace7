"""A random-weight Llama checkpoint that `jlight serve DIR` can serve (serving benchmarks).

Writes into DIR:
  config.json, model-*.safetensors, model.safetensors.index.json
      random bfloat16 weights from load_time.write_random_safetensors (random bit patterns,
      magnitudes in [2^-15, 2)). By default one layer's values are repeated in every layer (each
      layer still has its own tensors), which makes the 16 GB Llama-3-8B checkpoint several
      times faster to write and changes nothing a speed measurement sees; --distinct-layers
      draws every layer. The lm_head rows of the special tokens are zero, so their logits are
      exactly 0 while the ~128k other logits are random of either sign: greedy decoding never
      picks one (their text is empty, which would hide tokens from a streaming client).
  generation_config.json
      eos_token_id = [<|end_of_text|>, <|eot_id|>] as in Llama-3-Instruct.
  tokenizer.json, tokenizer_config.json
      a `tokenizers` WordLevel tokenizer that covers every id below vocab_size: the last 256
      ids are Llama-3's special tokens in Llama-3's order (<|begin_of_text|>, <|end_of_text|>,
      ..., <|start_header_id|>, <|end_header_id|>, <|eom_id|>, <|eot_id|>, <|python_tag|>,
      reserved tokens), id 0 is <unk>, and every other id is a distinct lowercase word
      (user, assistant, system, then a, b, ..., z, aa, ab, ...). Words are split on
      whitespace and decoded joined by single spaces, so decode(ids) encodes back to the same
      ids, and every non-special id decodes to non-empty text. encode() adds
      <|begin_of_text|> as Llama-3's does; the chat template is Llama-3's.

  python benchmarks/make_random_checkpoint.py --shape llama3-8b --out /tmp/ckpt   # ~16 GB
  python benchmarks/make_random_checkpoint.py --shape small --out /tmp/ckpt       # ~0.24 GB
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load_time import LLAMA3_8B, SMALL, hf_config, write_random_safetensors

SHAPES = {"llama3-8b": LLAMA3_8B, "small": SMALL}
NUM_SPECIAL = 256  # Llama-3: ids 128000..128255
# Llama-3.1's first special tokens; the rest are <|reserved_special_token_3|>, ... in order.
_FIRST_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
UNK = "<unk>"
_FIRST_WORDS = ["user", "assistant", "system"]  # the chat template's role names tokenize as words
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def special_tokens(vocab_size: int) -> dict[str, int]:
    """Llama-3's special tokens on the last NUM_SPECIAL ids of the vocabulary."""
    if vocab_size < NUM_SPECIAL + 1 + len(_FIRST_WORDS):
        raise ValueError(f"vocab_size {vocab_size} is too small: the tokenizer needs > {NUM_SPECIAL + len(_FIRST_WORDS)} ids")
    names = _FIRST_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + NUM_SPECIAL - len(_FIRST_SPECIALS))]
    first = vocab_size - NUM_SPECIAL
    return {name: first + i for i, name in enumerate(names)}


def _words():
    """user, assistant, system, then a..z, aa..zz, aaa..."""
    yield from _FIRST_WORDS
    length = 1
    while True:
        for n in range(26 ** length):
            w = "".join(chr(97 + (n // 26 ** k) % 26) for k in reversed(range(length)))
            if w not in _FIRST_WORDS:
                yield w
        length += 1


def build_tokenizer(vocab_size: int):
    """A tokenizers.Tokenizer whose vocabulary holds exactly ids 0..vocab_size-1."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = special_tokens(vocab_size)
    vocab = {UNK: 0}
    words = _words()
    while len(vocab) < vocab_size - NUM_SPECIAL:
        vocab[next(words)] = len(vocab)
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: tokenizers joins decoded tokens with single spaces.
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials[bos])])
    return tok


def write_tokenizer(directory: str, vocab_size: int) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json + generation_config.json; returns the special ids."""
    os.makedirs(directory, exist_ok=True)
    build_tokenizer(vocab_size).save(os.path.join(directory, "tokenizer.json"))
    specials = special_tokens(vocab_size)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
           "unk_token": UNK, "clean_up_tokenization_spaces": False, "model_max_length": 131072,
           "chat_template": LLAMA3_CHAT_TEMPLATE}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    ids = {"bos_token_id": specials["<|begin_of_text|>"],
           "eos_token_id": [specials["<|end_of_text|>"], specials["<|eot_id|>"]]}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({**ids, "do_sample": False}, f, indent=1)
    return ids


def write_checkpoint(directory: str, shape: dict, *, distinct_layers: bool = False, seed: int = 0) -> int:
    """The whole servable checkpoint; returns the weight bytes written."""
    V = shape["vocab_size"]
    ids = write_tokenizer(directory, V)
    config = hf_config(shape, **ids)
    return write_random_safetensors(directory, shape, config=config, seed=seed,
                                    same_weights_every_layer=not distinct_layers,
                                    zero_lm_head_rows=range(V - NUM_SPECIAL, V))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--out", required=True, help="directory to write (created)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--distinct-layers", action="store_true", help="draw every layer's weights (slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers {args.layers} must be >= 1")
        shape["num_hidden_layers"] = args.layers
    start = time.perf_counter()
    nbytes = write_checkpoint(args.out, shape, distinct_layers=args.distinct_layers, seed=args.seed)
    print(f"wrote a random {args.shape}-shaped checkpoint ({shape['num_hidden_layers']} layers, vocab "
          f"{shape['vocab_size']}, {nbytes / 1e9:.2f} GB bf16) to {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
