"""The size budget a request must fit before the server does work that grows with it.

A prompt must fit the model's context: max_model_len tokens, one of them left to generate.
Tokenizing tells exactly but costs about a second per megabyte of text; counting costs nothing.
No token of the vocabulary stands for more than `longest_token_bytes` bytes, so a text of more
than (max_model_len - 1) * longest_token_bytes bytes tokenizes to max_model_len tokens or more:
it is refused untokenized, with the exact check's field and code (context_length_exceeded).
Characters are counted first (a character is at least one byte), bytes only below that.

The bound holds where the tokenizer's pre-processing does not shrink text: byte-level BPE (GPT-2,
Llama 3, Qwen) and SentencePiece (a piece's leading space is counted as one more byte). A
normalizer that deletes characters (BERT's control-character cleaning) could fit a longer text,
and so could a WordLevel vocabulary's unknown token, which stands for a word of any length (the
benchmarks' random checkpoints); chat models' tokenizers have neither.

On the raw JSON, before pydantic validates item by item (`*_shape`), counts are checked: a batch
of more than MAX_PROMPTS_PER_REQUEST prompts, a token-id prompt of max_model_len ids or more, a
token list to detokenize longer than the context, and a chat of more messages than the context
has tokens (a template renders every message as one token at least: its role marker).
"""
from __future__ import annotations

from jlight.serve.errors import RequestError
from jlight.serve.protocol import MAX_PROMPTS_PER_REQUEST


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token can stand for: the longest token's bytes, plus one for the
    space a SentencePiece piece carries in front (decoding a piece alone drops it)."""
    return 1 + max((len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)), default=0)


class PromptBudget:
    def __init__(self, max_model_len: int, longest_token: int | None):
        """longest_token: longest_token_bytes(tokenizer); None (no tokenizer): texts are not counted."""
        self.max_model_len = max_model_len
        self.longest_token = longest_token
        self.max_text_bytes = None if longest_token is None else (max_model_len - 1) * longest_token

    def _too_long(self, param: str, size: str) -> RequestError:
        return RequestError(
            f"{param} is {size} of text; no more than {self.max_text_bytes:,} bytes can fit the model's context of "
            f"{self.max_model_len} tokens (no token of this model stands for more than {self.longest_token} bytes), "
            f"so it was refused without tokenizing; shorten {param}", param=param, code="context_length_exceeded")

    def check_text(self, text: str, param: str) -> None:
        if self.max_text_bytes is None:
            return
        if len(text) > self.max_text_bytes:
            raise self._too_long(param, f"{len(text):,} characters")
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_text_bytes:
            raise self._too_long(param, f"{size:,} bytes")

    def check_token_count(self, count: int, param: str, limit: int, what: str) -> None:
        if count > limit:
            raise RequestError(f"{param} has {count:,} {what}; the model's context is {self.max_model_len} tokens, "
                               f"so at most {limit:,} fit; shorten {param}", param=param,
                               code="context_length_exceeded")

    def check_messages(self, data) -> None:
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list):
            self.check_token_count(len(messages), "messages", self.max_model_len - 1,
                                   "messages (each takes a token at least)")

    # ---- the raw JSON of each endpoint ----

    def completion_shape(self, data) -> None:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, str):
            self.check_text(prompt, "prompt")
            return
        if not isinstance(prompt, list) or not prompt:
            return
        if isinstance(prompt[0], int):
            prompt = [prompt]
        elif len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise RequestError(f"prompt is a batch of {len(prompt):,} prompts; send at most "
                               f"{MAX_PROMPTS_PER_REQUEST} in one request", param="prompt")
        for item in prompt:
            if isinstance(item, str):
                self.check_text(item, "prompt")
            elif isinstance(item, list):
                self.check_token_count(len(item), "prompt", self.max_model_len - 1, "token ids")

    def chat_shape(self, data) -> None:
        self.check_messages(data)

    def detokenize_shape(self, data) -> None:
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list):
            self.check_token_count(len(tokens), "tokens", self.max_model_len, "token ids")
