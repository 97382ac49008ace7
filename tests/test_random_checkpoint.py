"""The random servable checkpoint (benchmarks/make_random_checkpoint.py) and the serving
benchmark's helpers around it: the tokenizer covers every id and round-trips, jlight loads
and serves the checkpoint, greedy decoding never picks a special token, the carried-wheel
requirement check, and the benchmark's distinct prompts per rate."""
import json
import os
import random
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import install_carried_wheels
import make_random_checkpoint as mrc

from jlight.tokenizer import IncrementalDetokenizer, Tokenizer

TINY = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 500000.0}


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("random_ckpt"))
    mrc.write_checkpoint(d, TINY)
    return d


def test_llama3_8b_tokenizer_layout():
    """128,256 ids; Llama-3's special ids (begin_of_text 128000, eot_id 128009)."""
    tok = mrc.build_tokenizer(128256)
    assert tok.get_vocab_size(with_added_tokens=True) == 128256
    assert tok.token_to_id("<|begin_of_text|>") == 128000 and tok.token_to_id("<|end_of_text|>") == 128001
    assert tok.token_to_id("<|start_header_id|>") == 128006 and tok.token_to_id("<|eot_id|>") == 128009
    assert tok.token_to_id("<|reserved_special_token_247|>") == 128255
    assert tok.id_to_token(127999) is not None and tok.id_to_token(128256) is None
    with pytest.raises(ValueError):
        mrc.build_tokenizer(200)


def test_files_and_config(ckpt):
    names = set(os.listdir(ckpt))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "model-globals.safetensors"} <= names
    cfg = read_json(os.path.join(ckpt, "config.json"))
    V = TINY["vocab_size"]
    assert cfg["vocab_size"] == V and cfg["bos_token_id"] == V - 256 and cfg["eos_token_id"] == [V - 255, V - 247]
    assert read_json(os.path.join(ckpt, "generation_config.json"))["eos_token_id"] == [V - 255, V - 247]


def test_tokenizer_covers_every_id_and_round_trips(ckpt):
    V = TINY["vocab_size"]
    tok = Tokenizer.from_dir(ckpt, {"eos_token_id": [V - 255, V - 247]})
    assert tok.vocab_size == V and tok.bos_token_id == V - 256 and tok.eos_token_ids == [V - 255, V - 247]
    assert tok.all_special_ids == list(range(V - 256, V))
    texts = [tok.decode([i]) for i in range(V)]
    # Every id the model can sample decodes: text ids to distinct single words, specials to "".
    assert all(t and " " not in t for t in texts[:V - 256]) and len(set(texts[:V - 256])) == V - 256
    assert all(t == "" for t in texts[V - 256:])
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(V) for _ in range(rng.randint(1, 100))]
        detok, parts, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            parts.append(detok.add(ids[i:i + k]))
            i += k
        assert "".join(parts) + detok.flush() == tok.decode(ids)
        text_ids = [t for t in ids if t < V - 256]
        assert tok.encode(tok.decode(text_ids), add_special_tokens=False) == text_ids  # prompt length holds
    assert tok.encode("a b zz") == [V - 256, *(tok.backend.token_to_id(w) for w in ("a", "b", "zz"))]
    assert tok.encode("not-a-word")[1:] == [0]  # <unk>
    chat = tok.apply_chat_template([{"role": "user", "content": "a b"}])
    ids = tok.encode(chat, add_special_tokens=False)
    header, end_header, eot = V - 250, V - 249, V - 247
    assert ids == [V - 256, header, tok.backend.token_to_id("user"), end_header, *tok.encode("a b")[1:], eot,
                   header, tok.backend.token_to_id("assistant"), end_header]


def test_weights(ckpt, tmp_path):
    V, E = TINY["vocab_size"], TINY["hidden_size"]
    g = load_file(os.path.join(ckpt, "model-globals.safetensors"))
    lm_head = g["lm_head.weight"].view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    assert lm_head.shape == (V, E) and not lm_head[V - 256:].any() and (lm_head[:V - 256] != 0).all()
    mag = np.abs(g["model.embed_tokens.weight"].astype(np.float32))
    assert mag.min() >= 2.0 ** -15 and mag.max() < 2.0 and (g["model.embed_tokens.weight"].astype(np.float32) < 0).mean() > 0.45
    l0, l1 = (load_file(os.path.join(ckpt, f"model-layer00{i}.safetensors")) for i in (0, 1))
    q0, q1 = l0["model.layers.0.self_attn.q_proj.weight"], l1["model.layers.1.self_attn.q_proj.weight"]
    assert np.array_equal(q0.view(np.uint16), q1.view(np.uint16))  # one layer's values repeated (default)
    distinct = str(tmp_path / "distinct")
    mrc.write_checkpoint(distinct, TINY, distinct_layers=True)
    d0, d1 = (load_file(os.path.join(distinct, f"model-layer00{i}.safetensors")) for i in (0, 1))
    assert not np.array_equal(d0["model.layers.0.self_attn.q_proj.weight"].view(np.uint16),
                              d1["model.layers.1.self_attn.q_proj.weight"].view(np.uint16))


def test_jlight_serves_it_and_greedy_never_picks_a_special_token(ckpt):
    from jlight import LLM, SamplingParams

    V = TINY["vocab_size"]
    llm = LLM(ckpt, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
              max_model_len=128)  # one step bucket to compile
    rng = random.Random(1)
    prompts = [[rng.randrange(100, V) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 24 and max(ids) < V - 256
        assert out.outputs[0].text == llm.tokenizer.decode(ids) and len(out.outputs[0].text.split()) == 24


def test_carried_wheel_requirements(tmp_path, monkeypatch):
    """The check reads a target's wheels' Requires-Dist against what Python sees with the target first."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    info = tmp_path / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                                   "Requires-Dist: numpy>=1.0\nRequires-Dist: packaging>=999\n"
                                   "Requires-Dist: surely-not-installed-pkg>=1\n"
                                   "Requires-Dist: also-not-installed; extra == \"x\"\n"
                                   "Requires-Dist: old-python-only; python_version < \"3.0\"\n")
    unmet = install_carried_wheels.unmet_requirements(str(tmp_path))
    assert sorted(name for name, _, _ in unmet) == ["packaging", "surely-not-installed-pkg"]
    assert {n: h for n, _, h in unmet}["surely-not-installed-pkg"] == "not installed"


def test_benchmark_prompts_are_distinct_per_rate():
    """Each rate gets its own prompts, so no rate hits the prefix cache of an earlier one."""
    from jlight.serve.bench_cli import random_requests, split_requests

    pool = random_requests(2 + 3 * 5, input_len=30, output_len=8, range_ratio=0.3333, vocab_size=1000, seed=0)
    warmup, per_rate, reused = split_requests(pool, 5, 3, 2)
    assert not reused and len(warmup) == 2 and [len(r) for r in per_rate] == [5, 5, 5]
    firsts = [tuple(r.prompt[:8]) for r in warmup + [r for rate in per_rate for r in rate]]
    assert len(set(firsts)) == len(firsts)
    assert all(20 <= r.prompt_len == len(r.prompt) <= 39 and 5 <= r.output_len <= 10 for r in pool)
    warmup, per_rate, reused = split_requests(pool[:6], 5, 3, 2)  # too few: one set for every rate
    assert reused and per_rate == [pool[:5]] * 3
