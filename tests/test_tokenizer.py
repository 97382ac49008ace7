"""Tokenizer: HF directory loading, chat templates rendered like transformers, and the
IncrementalDetokenizer's streaming guarantees (no broken UTF-8, deltas add up to decode)."""
import pytest

from jlight.tokenizer import IncrementalDetokenizer, Tokenizer

STREAM_TEXTS = [
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵!",
    "中文分词测试，日本語のテキスト、한국어 문장.",
    "Mixed: café 😀 naïve 日本 ok",
]


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf):
    from jlight.loading.gguf_loader import open_gguf
    from jlight.loading.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(open_gguf(smollm2_gguf), smollm2_gguf)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model("LlamaForCausalLM"), {"eos_token_id": [0, 2]})


def stream(tokenizer, ids, skip_special_tokens=True):
    """Feed ids one at a time; return the list of deltas (flush included)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add([i]) for i in ids]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_never_emits_broken_utf8(smol_tokenizer, text):
    ids = smol_tokenizer.encode(text)
    # The byte-level vocabulary splits these characters across tokens: that's what is under test.
    partial = [i for i in ids if "\ufffd" in smol_tokenizer.decode([i])]
    assert partial, "test text should contain characters split across tokens"
    deltas = stream(smol_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smol_tokenizer.decode(ids) == text
    assert deltas[-1] == ""  # nothing was left held back


def test_stream_with_special_tokens(smol_tokenizer):
    ids = smol_tokenizer.encode("<|im_start|>assistant\nHi 😀 there<|im_end|>")
    assert "".join(stream(smol_tokenizer, ids)) == smol_tokenizer.decode(ids) == "assistant\nHi 😀 there"
    kept = "".join(stream(smol_tokenizer, ids, skip_special_tokens=False))
    assert kept == "<|im_start|>assistant\nHi 😀 there<|im_end|>"


def test_stream_in_chunks_and_incomplete_tail(smol_tokenizer):
    ids = smol_tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(smol_tokenizer)
    assert detok.add(ids[:1]) + detok.add(ids[1:]) == "ok 😀"
    # A stream cut inside a character: held back by add(), released by flush() as decode() shows it.
    cut = smol_tokenizer.encode("a😀")[:-1]
    detok = IncrementalDetokenizer(smol_tokenizer)
    assert "".join(detok.add([i]) for i in cut) == "a"
    assert "a" + detok.flush() == smol_tokenizer.decode(cut)


def test_from_dir(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [0, 2]  # tokenizer eos (2) + generation_config
    assert tok.all_special_ids == [0, 1, 2]
    ids = tok.encode("Paris is the capital of France.")
    assert tok.decode(ids) == "Paris is the capital of France."
    assert tok.vocab_size == len(tok.backend.get_vocab())
    with pytest.raises(ValueError, match="str"):
        tok.encode(["not", "a", "string"])



def test_long_texts_go_through_the_gil_releasing_calls_unchanged(smol_tokenizer):
    """encode runs tokenizers' batch call and long decodes theirs (both release the GIL, so the server's
    worker threads leave its event loop running): the ids and the text are the single calls'."""
    from jlight.tokenizer import LONG_DECODE_IDS
    text = "<|im_start|>user\n" + " ".join(STREAM_TEXTS) * 40 + "<|im_end|>"
    for special in (True, False):
        assert smol_tokenizer.encode(text, special) == smol_tokenizer.backend.encode(text, add_special_tokens=special).ids
    ids = smol_tokenizer.encode(text)
    assert len(ids) > LONG_DECODE_IDS
    for skip in (True, False):
        assert smol_tokenizer.decode(ids, skip) == smol_tokenizer.backend.decode(ids, skip_special_tokens=skip)

def test_from_dir_without_tokenizer_json(tmp_path):
    from jlight.core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))


# A template using what transformers' environment provides: trim/lstrip blocks, loop controls,
# raise_exception, tojson (unicode kept), strftime_now, bos/eos variables, extra kwargs and
# the {% generation %} tag.
FEATURE_TEMPLATE = """{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}
    {% if m['content'] == 'skip' %}{% continue %}{% endif %}
<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}year={{ strftime_now('%Y') }}"""


def test_chat_template_renders_like_transformers(tiny_model):
    from transformers import PreTrainedTokenizerFast

    path = tiny_model("LlamaForCausalLM")
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    ours.chat_template = hf.chat_template = FEATURE_TEMPLATE
    messages = [
        {"role": "user", "content": "héllo 😀"},
        {"role": "assistant", "content": "skip"},
        {"role": "assistant", "content": "Bonjour !"},
    ]
    tools = [{"name": "get_weather", "description": "météo ☀"}]
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools) == want
    assert "météo ☀" in want  # tojson kept the unicode


def test_chat_template_errors_are_value_errors(tiny_tokenizer):
    tok = Tokenizer(tiny_tokenizer.backend, chat_template=FEATURE_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="role bad is not allowed"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ValueError, match="messages must be"):
        tok.apply_chat_template("just a string")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny_tokenizer.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_save_pretrained_round_trip(smol_tokenizer, tmp_path):
    smol_tokenizer.save_pretrained(str(tmp_path))
    again = Tokenizer.from_dir(str(tmp_path))
    text = "Hello 😀 <|im_end|> 123"
    assert again.encode(text) == smol_tokenizer.encode(text)
    assert again.eos_token_ids == smol_tokenizer.eos_token_ids and again.bos_token_id == smol_tokenizer.bos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == smol_tokenizer.apply_chat_template(msgs)


# --- SentencePiece ("llama") vocabularies from GGUF, checked against sentencepiece itself ----

SPM_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello  world,\n\ttabs and  double  spaces ",
    "café naïve 😀 日本 — bytes the vocab lacks",
    "def add(a, b):\n    return a + b  # 12345",
    " leading space and trailing space ",
]


def vocab_gguf_tokenizer(path, arch: str, model: str, tokens, scores, types, extra):
    """A GGUF at path holding only a vocabulary (tokenizer.ggml.model `model`, its tokens, scores and types, then
    what extra(writer) adds), read back by jlight's gguf_tokenizer."""
    import gguf

    from jlight.loading.gguf_loader import open_gguf
    from jlight.loading.gguf_tokenizer import gguf_tokenizer

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_tokenizer(open_gguf(str(path)), str(path))


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """(sentencepiece processor trained here, jlight Tokenizer built from a GGUF of its vocab)."""
    import io

    spm = pytest.importorskip("sentencepiece")

    corpus = [
        "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, Berlin of Germany.",
        "def add(a, b):\n    return a + b\n", "Once upon a time there was a small model that answered questions.",
    ] * 20
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=proto, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    def ids(w):
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    path = tmp_path_factory.mktemp("spm") / "spm_vocab.gguf"
    return sp, vocab_gguf_tokenizer(path, "llama", "llama", [sp.id_to_piece(i) for i in range(n)],
                                    [sp.get_score(i) for i in range(n)], types, ids)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_tokenizer_matches_sentencepiece(spm_pair, text):
    sp, tok = spm_pair
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.encode(text) == [1] + sp.encode(text)  # BOS added by default for SentencePiece GGUFs
    assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))
    assert "".join(stream(tok, tok.encode(text))) == tok.decode(tok.encode(text))


# tiktoken 0.9.0's o200k_base pat_str (tiktoken_ext/openai_public.py), the split of gpt-oss's and Llama 4's
# tokenizers, which GGUF files name "gpt-4o" / "llama4" in tokenizer.ggml.pre.
O200K_PAT_STR = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


@pytest.mark.parametrize("pre", ["gpt-4o", "llama4"])
def test_gguf_gpt4o_pre_tokenizer_splits_as_o200k(pre):
    """A GGUF tokenizer with tokenizer.ggml.pre "gpt-4o" (gpt-oss) or "llama4" splits text where tiktoken's
    o200k_base pattern does: case changes inside words, contractions kept on their word, digits in threes,
    punctuation taking a trailing newline or slash (GPT-2's regex, the fallback, splits this text elsewhere)."""
    import regex

    from jlight.loading.gguf_tokenizer import _pre_tokenizer

    text = "HelloWorld's JSON-parser DON'T 1234567 naïve CAFÉs\n/usr/bin\r\n  x  ¿Qué? 3.14159"
    want = [m.span() for m in regex.finditer(O200K_PAT_STR, text)]
    assert [span for _, span in _pre_tokenizer(pre).pre_tokenize_str(text)] == want
    assert [span for _, span in _pre_tokenizer("gpt2").pre_tokenize_str(text)] != want


def test_gguf_unknown_pre_tokenizer_is_named_in_a_warning(caplog):
    from jlight.loading.gguf_tokenizer import _pre_tokenizer

    with caplog.at_level("WARNING", logger="jlight.loading.gguf_tokenizer"):
        _pre_tokenizer("some-new-model")
    assert "'some-new-model'" in caplog.text and "GPT-2's regex" in caplog.text


# --- Gemma 4 ("gemma4") vocabularies from GGUF, checked against transformers' GemmaTokenizer ----

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<|channel>"]
GEMMA4_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello  world,\n\ttabs and  double  spaces ",
    " leading space, trailing space ",
    "one\n\ntwo\n\n\nthree\n\n\n\nfour\n",
    "café naïve 😀 日本 — bytes the vocab lacks",
    "def add(a, b):\n    return a + b  # 12345 0.5",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n<|channel>thought<eos>",
]


@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory):
    """(transformers GemmaTokenizer on a BPE trained here, jlight Tokenizer built from the GGUF that
    llama.cpp's Gemma4Model.set_vocab writes for it)."""
    import json
    import random

    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer as Backend, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, GemmaTokenizer

    rng = random.Random(0)
    words = ("the quick brown fox jumps over lazy dog Paris is capital of France Berlin Germany def add(a, b): "
             "return a + b once upon time there was small model that answered questions 12345 0.5 one two three").split()
    corpus = ["".join(rng.choice(words) + rng.choice([" ", " ", "  ", "\n", "\n\n"]) for _ in range(12)) for _ in range(200)]
    trainer_tok = Backend(models.BPE(byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    # Gemma's merges never join a newline to other text, which llama.cpp's newline-run split relies on.
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    # Gemma's layout: special tokens, then <0x00>..<0xFF>, then the pieces; "\n\n\n" is a piece no merge
    # builds, an added (not special) token in the HF tokenizer, as Gemma's newline runs are.
    pieces = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["\n\n\n"]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    vocab = {p: i for i, p in enumerate(pieces)}
    hf_dir = tmp_path_factory.mktemp("gemma4_tok")
    hf = GemmaTokenizer(vocab=vocab, merges=[tuple(m) for m in trained["merges"]],
                        extra_special_tokens=["<start_of_turn>", "<end_of_turn>", "<|channel>"], add_bos_token=True)
    hf._tokenizer.add_tokens([AddedToken("\n\n\n", special=False, normalized=False)])
    hf.save_pretrained(hf_dir)
    hf = AutoTokenizer.from_pretrained(hf_dir)

    # convert_hf_to_gguf.py Gemma4Model.set_vocab
    hf_vocab = gguf.LlamaHfVocab(hf_dir)
    visible = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
    tokens, scores, types = [], [], []
    for text, score, toktype in hf_vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in visible else toktype)
    assert len(tokens) == hf_vocab.vocab_size == len(pieces)
    path = tmp_path_factory.mktemp("gemma4_gguf") / "gemma4_vocab.gguf"
    def special(w):
        gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w)
        w.add_add_space_prefix(False)
        w.add_add_bos_token(True)

    return hf, vocab_gguf_tokenizer(path, "gemma4", "gemma4", tokens, scores, types, special)


@pytest.mark.parametrize("text", GEMMA4_TEXTS)
def test_gemma4_gguf_tokenizer_matches_transformers(gemma4_pair, text):
    hf, tok = gemma4_pair
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text) == hf.encode(text) == [hf.bos_token_id] + hf.encode(text, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == text


def test_gemma4_gguf_tokenizer_special_tokens(gemma4_pair):
    hf, tok = gemma4_pair
    assert tok.bos_token == "<bos>" and tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_ids == [hf.eos_token_id]
    assert {"<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"} <= {tok.backend.id_to_token(i) for i in tok.all_special_ids}
    assert tok.encode("😀", add_special_tokens=False) == [tok.backend.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert tok.encode("a\n\n\nb", add_special_tokens=False)[1] == tok.backend.token_to_id("\n\n\n")
