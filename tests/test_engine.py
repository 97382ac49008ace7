"""The engine end to end on a tiny float32 Llama: batching, preemption, prefix caching,
stop strings, abort, seeds and zero recompiles after warm-up."""
import numpy as np
import pytest
import torch

import jax
import jlight
from jlight import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def llm(model_dir):
    return jlight.LLM(model_dir, dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, page_size=8, num_pages=400)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def hf_greedy(hf_model, prompt, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_with_arrivals(engine, prompts, params, per_step=3):
    """Add requests a few at a time while earlier ones run; return token ids per prompt."""
    results, pending, i = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        for idx, p in pending[:per_step]:
            engine.add_request(f"arrive-{idx}", None, params, prompt_token_ids=p)
        pending = pending[per_step:]
        for out in engine.step():
            if out.finished:
                results[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        i += 1
    return [results[k] for k in range(len(prompts))]


def test_batched_equals_alone_equals_transformers(llm, hf_model):
    prompts = random_prompts(32, 1, 150, seed=1)
    batched = run_with_arrivals(llm.engine, prompts, GREEDY)
    for k in (0, 5, 17):
        alone = llm.generate([prompts[k]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == batched[k]
        assert hf_greedy(hf_model, prompts[k], 24) == batched[k]
    for k, p in enumerate(prompts[:8]):
        assert hf_greedy(hf_model, p, 24) == batched[k], f"prompt {k} differs from transformers"
    assert llm.engine.block_manager.num_used_pages == 0


def test_preemption_keeps_outputs_identical(model_dir, llm):
    prompts = random_prompts(12, 20, 60, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # One 64-token step bucket (min_token_bucket): one compile, where all five buckets took most of the test's time.
    small = jlight.LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, min_token_bucket=64, page_size=8,
                       num_pages=24)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.stats().num_preemptions > 0
    assert got == expected
    assert small.engine.block_manager.num_used_pages == 0


def test_prefix_cache_computes_only_the_suffix(llm):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, size=512).tolist()
    first = prefix + rng.integers(3, 500, size=7).tolist()
    second = prefix + rng.integers(3, 500, size=9).tolist()
    llm.generate([first], GREEDY, use_tqdm=False)
    engine = llm.engine
    steps_before = engine.num_steps
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 512  # every full page of the shared prefix came from the cache
    # Only the 9 new tokens (plus decode) were computed: one prefill step, not 512/64 = 8 chunks.
    assert engine.num_steps - steps_before <= 24 + 1
    engine.block_manager.reset_prefix_cache()
    fresh = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == out.outputs[0].token_ids


def test_n_samples_share_the_prompt_and_are_reproducible(llm):
    prompt = random_prompts(1, 40, 41, seed=4)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(a.outputs) == 4
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # different samples
    # Same seed, different company in the batch: identical samples.
    others = random_prompts(6, 5, 80, seed=5)
    outs = llm.generate(others + [prompt], [SamplingParams(temperature=0.8, max_tokens=20)] * 6 + [params], use_tqdm=False)
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in a.outputs]


def test_seeded_sampling_independent_of_batch(llm):
    prompts = random_prompts(5, 10, 60, seed=6)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [params] + [SamplingParams(temperature=1.0, max_tokens=30, seed=s) for s in range(4)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_stop_strings_cut_exactly_across_tokens(llm):
    tok = llm.tokenizer
    base = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    boundary = next(len(p) for p in pieces if len(p) >= 6)
    stop = text[boundary - 2: boundary + 3]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    # Streaming never leaks a partial stop string.
    streamed = "".join(llm.stream([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])))
    assert streamed == out.text


def test_output_kinds_carry_the_same_answer(llm):
    """cumulative: everything at every step; delta: only the new part (their concatenation is the answer);
    final_only: one output, at the finish. Stop strings, n=2 and logprobs too."""
    base = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    params = dict(temperature=0, n=2, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=2)
    runs = {}
    for kind in ("cumulative", "delta", "final_only"):
        engine = llm.engine
        engine.add_request(f"kind-{kind}", None, SamplingParams(**params, output_kind=kind), prompt_token_ids=[5, 6, 7, 8])
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == f"kind-{kind}"]
        runs[kind] = outs
    final = runs["cumulative"][-1]
    assert final.finished and len(runs["cumulative"]) > 2
    assert len(runs["final_only"]) == 1 and runs["final_only"][0].finished
    assert len(runs["delta"]) == len(runs["cumulative"]) and runs["delta"][-1].finished
    for i, c in enumerate(sorted(final.outputs, key=lambda c: c.index)):
        f = sorted(runs["final_only"][0].outputs, key=lambda c: c.index)[i]
        assert (f.text, f.token_ids, f.logprobs, f.finish_reason, f.stop_reason) == (
            c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
        deltas = [next(d for d in o.outputs if d.index == c.index) for o in runs["delta"]]
        assert "".join(d.text for d in deltas) == c.text
        assert [t for d in deltas for t in d.token_ids] == c.token_ids
        assert [e for d in deltas for e in d.logprobs] == c.logprobs
        assert all(d.text == d.text_delta and d.token_ids == d.token_ids_delta for d in deltas)
        assert deltas[-1].finish_reason == c.finish_reason and deltas[-1].cumulative_logprob == c.cumulative_logprob
    assert any(c.finish_reason == "stop" for c in final.outputs)
    with pytest.raises(ValueError, match="output_kind='FINAL'"):
        SamplingParams(output_kind="FINAL").validate()


def test_a_stop_string_in_the_text_before_min_tokens_does_not_stop(llm):
    base = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    tok = llm.tokenizer
    early = tok.decode(base.token_ids[:3])
    stop = early[-3:]
    assert stop and stop not in tok.decode(base.token_ids)[len(early):]  # it occurs only in the first tokens' text
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=30, min_tokens=10, ignore_eos=True,
                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids


def test_text_is_the_decode_of_token_ids_when_a_character_is_cut_off(llm):
    """A finish that cuts a multi-byte character (max_tokens here) still gives text == decode(token_ids):
    the bytes the detokenizer held back for a next token are flushed (as U+FFFD), in the stream too."""
    tok = llm.tokenizer
    lone_byte = next(t for t in range(3, 512) if tok.decode([t]) == "\ufffd")  # half of a UTF-8 character
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={lone_byte: 100.0})
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [lone_byte] * 3 and out.finish_reason == "length"
    assert out.text == tok.decode(out.token_ids) != ""
    assert "".join(llm.stream([5, 6, 7], params)) == out.text


def test_abort_frees_every_page(llm):
    engine = llm.engine
    for i, p in enumerate(random_prompts(10, 30, 120, seed=8)):
        engine.add_request(f"abort-{i}", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=p)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_pages > 0
    for i in range(10):
        engine.abort_request(f"abort-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_pages == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_logprobs_match_log_softmax_of_transformers(llm, hf_model):
    prompt = random_prompts(1, 20, 21, seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=5, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1).numpy()
    for i, (tok, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert len(lps) >= 5
        assert abs(lps[tok] - ref[len(prompt) - 1 + i, tok]) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    # vLLM's cumulative_logprob: the sum of the sampled tokens' logprobs (None when logprobs were not asked for).
    want = sum(ref[len(prompt) - 1 + i, t] for i, t in enumerate(out.outputs[0].token_ids))
    assert abs(out.outputs[0].cumulative_logprob - want) < 1e-3
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]] - ref[pos - 1, prompt[pos]]) < 1e-4


def _conditionals_holding_loops(step_text: str) -> tuple[int, int]:
    """(stablehlo.case ops in a lowered step's text, those of them with a stablehlo.while in a branch)."""
    import re

    branches = []  # the text of each stablehlo.case's branches, by brace depth from the op to its end
    for at in (m.end() for m in re.finditer(r'"stablehlo\.case"', step_text)):
        depth, end = 0, step_text.index("({", at) + 1
        while True:
            depth += {"{": 1, "}": -1}.get(step_text[end], 0)
            end += 1
            if depth == 0 and step_text[end] == ")":
                break
        branches.append(step_text[at:end])
    return len(branches), sum("stablehlo.while" in b for b in branches)


@pytest.mark.parametrize("program", [False, True], ids=["in_step", "program"])
def test_prompt_logprobs_over_several_chunks_match_transformers(model_dir, hf_model, program):
    """A 290-token prompt in the 300-token bucket: its prompt logprobs come in chunks of
    model_runner.PROMPT_LOGPROB_CHUNK tokens (256), the second one padded: in the step under a lax.cond, or
    (prompt_logprobs_program) from a program of their own, when the step holds no conditional with a loop in it
    (one that XLA:GPU may leave to the host)."""
    llm = jlight.LLM(model_dir, dtype="float32", max_num_seqs=2, max_num_batched_tokens=300, min_token_bucket=256,
                     page_size=8, num_pages=64, prompt_logprobs_program=program)
    assert llm.engine.runner.buckets == [256, 300]
    cases, with_loops = _conditionals_holding_loops(_lowered_step(llm.engine.runner, 300).as_text())
    assert cases >= 2 and with_loops == (0 if program else 1)
    prompt = random_prompts(1, 290, 291, seed=11)[0]
    beside = random_prompts(1, 5, 6, seed=12)[0]  # a request without prompt logprobs in the same step
    outs = llm.generate([prompt, beside], [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                           SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
    out = outs[0]
    assert outs[1].prompt_logprobs is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt) == 290
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos]
        assert abs(got[prompt[pos]] - ref[pos - 1, prompt[pos]]) < 1e-4, pos
        best = int(ref[pos - 1].argmax())
        assert best in got and abs(got[best] - ref[pos - 1, best]) < 1e-4, pos


def test_bad_sampling_params_raise_clear_errors(llm):
    cases = [(dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
             (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n")]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate([[5, 6]], SamplingParams(**kwargs), use_tqdm=False)
    with pytest.raises(jlight.PromptTooLongError, match="context"):
        llm.generate([[5] * 1100], GREEDY, use_tqdm=False)
    assert not llm.engine.requests


def test_prompts_in_vllm_forms_and_bad_prompts(llm):
    """vLLM's prompt dicts and numpy token ids work like strings and lists; anything else is a ValueError
    naming the prompt (a dict was once generated for as the string of its first key)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [5, 6, 7]
    expected = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], np.array(ids), [np.array(ids)]):
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    text = llm.generate("Paris is", params, use_tqdm=False)[0]
    as_dict = llm.generate({"prompt": "Paris is"}, params, use_tqdm=False)[0]
    assert as_dict.prompt == "Paris is" and as_dict.outputs[0].token_ids == text.outputs[0].token_ids
    for prompt in (None, 5, [1.5, 2.0], [[5, None]], [{"prompt_ids": ids}], [{}], [["a"]]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(prompt, params, use_tqdm=False)
    for bad in ({"max_tokens": 3}, [params, "x"]):
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate([ids, ids], bad, use_tqdm=False)
    assert "".join(llm.stream({"prompt_token_ids": ids}, params)) == llm.tokenizer.decode(expected)
    with pytest.raises(ValueError, match="one prompt"):  # streamed only the first one before
        next(llm.stream([ids, [8, 9]], params))
    assert not llm.engine.requests


def test_a_refused_prompt_leaves_no_request_of_its_call_behind(llm):
    """generate() adds its prompts one by one; when one is refused, the ones added before it are
    withdrawn (they used to stay in the engine, holding pages, and run during the next call)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(jlight.PromptTooLongError):
        llm.generate([[5, 6, 7], [8, 9], [5] * 1100], params, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.scheduler.waiting
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_module_generate_takes_sampling_options(model_dir):
    """jlight.generate(..., stop=[...], logprobs=...) was refused as "unknown engine option(s) stop";
    SamplingParams fields now go to the request, the rest to the engine."""
    outs = jlight.generate([[5, 6, 7]], model_dir, max_tokens=6, ignore_eos=True, n=2, logprobs=0, dtype="float32",
                           max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, warmup=False, compilation_cache_dir=None)
    assert [len(c.token_ids) for c in outs[0].outputs] == [6, 6] and len(outs[0].outputs[0].logprobs) == 6
    with pytest.raises(ValueError, match="unknown engine option.*bogus"):
        jlight.generate("x", model_dir, bogus=1)


def test_min_tokens_bans_every_stop_token_or_refuses(llm):
    """min_tokens bans EOS and stop_token_ids on the device, in NUM_BANNED slots a row. Ids past those were
    silently left unbanned: a favoured stop token came out before min_tokens. Now that is refused."""
    from jlight.engine.sampler import NUM_BANNED

    stops = list(range(110 - (NUM_BANNED - 1), 110))  # with the one EOS id: exactly NUM_BANNED
    params = SamplingParams(max_tokens=6, min_tokens=4, temperature=0, stop_token_ids=stops, logit_bias={109: 50.0})
    out = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
    assert not set(out.token_ids[:4]) & set(stops) and out.token_ids[4:] == [109] and out.stop_reason == 109
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=[100] + stops), use_tqdm=False)
    assert not llm.engine.requests


def test_no_compilation_after_warmup(llm):
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if name.endswith("jaxpr_to_mlir_module_duration") else None)
    rng = np.random.default_rng(10)
    engine = llm.engine
    jax.jit(lambda x: x * 3 + 1)(np.arange(7))  # proves the listener sees a compilation
    assert events, "the compilation listener saw nothing; the check below would be empty"
    base = len(events)
    for i in range(300):
        p = rng.integers(3, 500, size=int(rng.integers(1, 200))).tolist()
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.2])), top_k=int(rng.choice([0, 5, 40])), top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.1])), max_tokens=int(rng.integers(1, 12)), seed=int(rng.integers(0, 1000)),
            repetition_penalty=float(rng.choice([1.0, 1.2])), presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.3])), logprobs=int(rng.choice([0, 3])) if i % 5 == 0 else None,
            n=int(rng.choice([1, 1, 2])))
        engine.add_request(f"compile-{i}", None, params, prompt_token_ids=p)
        if i % 7 == 0:
            engine.step()
    engine.run_to_completion()
    assert events[base:] == [], f"{len(events) - base} compilations after warm-up"
    assert engine.block_manager.num_used_pages == 0


def _compiles_after_warmup(engine) -> int:
    compiled = engine.runner._step._cache_size()
    engine.add_request("after-warmup", None, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), prompt_token_ids=[5, 6, 7])
    engine.run_to_completion()
    return engine.runner._step._cache_size() - compiled


def test_committed_weights_compile_nothing_after_warmup(model_dir, tmp_path):
    """Weights committed to a device (a `jlight convert` checkpoint's here; a mesh's too) make the step's
    K/V and history outputs committed, unlike the fresh pools that the first warm-up step takes: another
    jit cache key, so the first real step of that bucket compiled again."""
    from jlight.convert import convert

    convert(model_dir, str(tmp_path / "converted"), dtype="float32")
    llm = jlight.LLM(str(tmp_path / "converted"), max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16,
                     num_pages=32, compilation_cache_dir=None)  # one step bucket to warm up
    assert all(leaf.committed for leaf in jax.tree.leaves(llm.engine.runner.params))
    assert _compiles_after_warmup(llm.engine) == 0


def test_a_replica_on_its_own_device_compiles_nothing_after_warmup(model_dir):
    """A data-parallel replica (LLMEngine with `devices`, no mesh) was built and warmed up under
    jax.default_device, which is part of jit's cache key, and then stepped outside it: every bucket
    compiled again on first use."""
    import jlight.loading
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16,
                          num_pages=32, compilation_cache_dir=None)  # one step bucket to warm up
    engine = LLMEngine(config, loaded=jlight.loading.load_model(model_dir, dtype="float32"), devices=jax.devices()[:1])
    assert _compiles_after_warmup(engine) == 0


def test_unrolled_layers_load_per_layer_and_free_what_they_fuse(model_dir, hf_model, monkeypatch):
    """layer_loop="unroll" gives transformers' greedy tokens; an engine that loads its own weights loads
    them per layer (never stacked) and frees the q/k/v and gate/up parts as it fuses them (peak ~ one
    copy of the weights); stacked weights handed in (shared by data-parallel replicas) are left intact, and
    weights given (give_weights=True) are freed as they are split."""
    import jlight.loading
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    own_layers = []
    real_load = jlight.loading.load_model

    def load_and_record(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        own_layers.append(loaded.params["layers"])
        return loaded

    monkeypatch.setattr(jlight.loading, "load_model", load_and_record)
    config = EngineConfig(model=model_dir, dtype="float32", layer_loop="unroll", max_num_seqs=2,
                          max_num_batched_tokens=16, min_token_bucket=16, num_pages=64, compilation_cache_dir=None,
                          warmup=False)  # one step bucket: prefill and decode compile one unrolled step
    engine = LLMEngine(config)
    (layers,) = own_layers
    assert isinstance(layers, list) and len(layers) == engine.model_config.num_layers  # loaded per layer ...
    fused_parts = [layer[k] for layer in layers for k in ("wq", "wk", "wv", "w_gate", "w_up")]
    assert all(part.is_deleted() for part in fused_parts)  # ... and the parts freed as they were fused
    prompt = random_prompts(1, 5, 20, seed=9)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("unrolled", None, params, prompt_token_ids=prompt)
    tokens = [out for _ in range(64) for out in engine.step() if out.finished]
    assert tokens[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)

    shared = real_load(model_dir, dtype="float32")
    stacked = jax.tree.leaves(shared.params["layers"])
    LLMEngine(config, loaded=shared)
    assert not any(leaf.is_deleted() for leaf in stacked)  # ... but handed-in weights are not freed
    assert shared.params["layers"] is not None  # and stay usable: a second engine can be built from them
    LLMEngine(config, loaded=shared)

    given = real_load(model_dir, dtype="float32")
    stacked = jax.tree.leaves(given.params["layers"])
    engine = LLMEngine(config, loaded=given, give_weights=True)  # weights given, not lent: freed as they are split
    assert all(leaf.is_deleted() for leaf in stacked) and given.params is None
    engine.add_request("given", None, params, prompt_token_ids=prompt)
    tokens = [out for _ in range(64) for out in engine.step() if out.finished]
    assert tokens[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)


def test_warmup_for_one_request_compiles_only_its_buckets(tiny_model):
    """`jlight generate`'s warm-up: the buckets of one request's prefill chunks and decode steps, and then
    the request itself compiles nothing (its printed timings stay compile-free)."""
    llm = jlight.LLM(tiny_model("LlamaForCausalLM"), dtype="float32", max_num_seqs=2, max_num_batched_tokens=64,
                     num_pages=64, compilation_cache_dir=None, warmup=False)
    engine = llm.engine
    decode = 8 if jax.default_backend() == "gpu" else 1  # the CPU's 1-token bucket for batch-1 decode
    assert engine.runner.buckets == sorted({decode, 8, 16, 32, 64})
    engine.warmup_for_one_request(90)  # chunks of 64 and 26 tokens, then decode steps of one token
    compiled = dict(engine.runner._executables)  # the steps compiled ahead of time, by layout
    assert sorted({layout_tokens(layout) for layout in compiled}) == [decode, 32, 64]  # not 16 (nor 8 on the CPU)
    llm.generate([list(range(3, 93))], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert engine.runner._executables == compiled and engine.runner._step._cache_size() == 0  # jit compiled nothing


def test_extra_token_buckets_compile_beside_the_powers_of_two(tiny_model):
    """extra_token_buckets=(12,): a step of 9-12 tokens runs a 12-token step, not a 16-token one, and gives the
    tokens the default buckets give; bad sizes are refused naming the field."""
    path = tiny_model("LlamaForCausalLM")
    prompts = random_prompts(10, 3, 9, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for extra in ((), (12,)):
        llm = jlight.LLM(path, dtype="float32", max_num_seqs=10, max_num_batched_tokens=32, min_token_bucket=8,
                         num_pages=64, compilation_cache_dir=None, extra_token_buckets=extra)
        runner, launch, ran = llm.engine.runner, llm.engine.runner.launch, []
        assert runner.buckets == sorted({8, 16, 32, *extra}) and runner.bucket_for(10) == (12 if extra else 16)
        runner.launch = lambda inp, *a, **k: ran.append(len(inp.tokens)) or launch(inp, *a, **k)
        outs[extra] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ran.count(12 if extra else 16) >= 5  # ten rows decoding
    assert outs[(12,)] == outs[()]
    for bad in ((0,), (4.5,), 12):
        with pytest.raises(ValueError, match="extra_token_buckets"):
            jlight.LLM(path, extra_token_buckets=bad, warmup=False)


def layout_tokens(layout) -> int:
    """The token count of a step_packing.Layout: the length of its first leaf, StepInputs.tokens."""
    return layout.slots[0].shape[0]


def test_a_max_model_len_beyond_the_model_is_capped_with_a_warning(model_dir, caplog):
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    with caplog.at_level("WARNING", logger="jlight.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=10**6, max_num_seqs=2,
                                        max_num_batched_tokens=16, num_pages=32, warmup=False))
    limit = engine.model_config.max_position_embeddings
    assert engine.max_model_len == limit < 10**6
    assert f"max_model_len=1000000 is beyond the model's {limit} positions; using {limit}" in caplog.text


def test_tensor_parallel_size_is_the_mesh_tp(model_dir):
    """vLLM's LLM(..., tensor_parallel_size=N) is mesh="tp=N" (as the CLI's --tensor-parallel-size)."""
    with pytest.raises(ValueError, match="tp=2"):  # one CPU device here: the tp=2 mesh itself is refused
        jlight.LLM(model_dir, tensor_parallel_size=2, dtype="float32", warmup=False)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size=.* is invalid"):
            jlight.LLM(model_dir, tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="either mesh or tensor_parallel_size"):
        jlight.LLM(model_dir, tensor_parallel_size=2, mesh="tp=2")


def test_a_float32_step_multiplies_in_float32_and_a_bf16_step_as_xla_likes(llm, model_dir):
    """XLA:GPU would multiply float32 matrices in TF32 (logprobs 3.5e-4 off transformers on the H200);
    the step of a float32 model asks every dot for full precision, a bf16 model's asks for nothing."""
    from jlight.engine import step_packing
    from jlight.engine.scheduler import SchedulePlan

    def step_text(runner):
        inp, _ = runner.prepare(SchedulePlan([], []), {})
        ints, floats, layout = step_packing.pack(inp)
        return runner._step.lower(runner.params, runner.k_cache, runner.v_cache, runner.history, runner.prev_sampled,
                                  ints, floats, runner.unconstrained_mask(inp), layout).as_text()

    def dots(runner):
        return [line for line in step_text(runner).splitlines() if "stablehlo.dot_general" in line]

    f32 = dots(llm.engine.runner)
    assert f32 and all("precision = [HIGHEST, HIGHEST]" in d for d in f32), f32
    bf16 = dots(jlight.LLM(model_dir, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=16, num_pages=8,
                           warmup=False).engine.runner)
    assert bf16 and not any("HIGHEST" in d for d in bf16), bf16


def test_a_row_whose_pages_cannot_hold_its_tokens_is_refused_by_prepare(llm):
    """prepare reads every token's pool slot from its row's page table, so a row given too few pages (an engine
    bug: the scheduler covers every row it launches) raises naming its sequence, not writes into the scratch page."""
    from jlight.engine.scheduler import ScheduledSeq, SchedulePlan
    from jlight.engine.sequence import Sequence, SequenceStateError

    seq = Sequence("r", 0, list(range(3, 23)), SamplingParams(max_tokens=1), seed=0, arrival=0.0)
    seq.admit([1, 2], 0)  # two pages of 8 tokens for a 20-token prompt
    runner = llm.engine.runner
    with pytest.raises(SequenceStateError, match=f"seq {seq.seq_id}: 2 pages cannot hold its 20 tokens"):
        runner.prepare(SchedulePlan([ScheduledSeq(seq, 0, 20, True)], []), {})
    seq.add_pages([3])  # covered: prepared, each token's slot its page's
    inp, _ = runner.prepare(SchedulePlan([ScheduledSeq(seq, 0, 20, True)], []), {})
    assert list(inp.md.slot_mapping[:20]) == [[1, 2, 3][p // 8] * 8 + p % 8 for p in range(20)]


def test_a_bfloat16_model_on_the_cpu_keeps_float32_pages_and_never_widens_the_pool(model_dir):
    """XLA:CPU computes bfloat16 in float32 and widens a whole operand to do so: a bfloat16 pool's in-place write
    converted the whole pool every layer (model_runner.kv_pool_dtype). A bfloat16 model's pool on the CPU is float32
    (on a GPU the model's dtype), no compiled step (prefill and decode buckets) converts or copies a pool-sized
    array, and on the CPU its greedy tokens are the float32 model's, but for bfloat16's rounding: the first token of
    every prompt equal."""
    import re

    prompts = [[5, 6, 7, 8] * 5, list(range(30, 70))]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = {}
    for dtype in ("bfloat16", "float32"):
        llm = jlight.LLM(model_dir, dtype=dtype, max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=1,
                         page_size=8, num_pages=41, compilation_cache_dir=None)
        runner = llm.engine.runner
        assert runner.params["final_norm"].dtype == dtype
        assert runner.k_cache.dtype == (np.float32 if jax.default_backend() == "cpu" else dtype)
        for executable in runner._executables.values():
            pool_sized = [op for op in re.findall(r"= (\S+) (convert|copy)\(", executable.as_text()) if ",41," in op[0]]
            assert not pool_sized, f"{dtype}: the step widens or copies the pool: {pool_sized}"
        out[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    if jax.default_backend() == "cpu":  # a GPU keeps bfloat16 K/V, whose rounding may flip a random model's near-ties
        assert [t[0] for t in out["bfloat16"]] == [t[0] for t in out["float32"]]


def test_a_request_larger_than_the_whole_kv_cache_is_refused(model_dir):
    """A request whose prompt and max_tokens need more pages than the pool holds could never run: alone in
    the engine it preempted itself step after step, forever. It is refused naming the pages, and one that
    fits runs beside it."""
    small = jlight.LLM(model_dir, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16, page_size=8,
                       num_pages=12, compilation_cache_dir=None)  # 11 usable pages: 88 tokens; one step bucket
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(jlight.PromptTooLongError, match="KV pages"):
        small.generate([[5] * 50], params, use_tqdm=False)
    out = small.generate([[5] * 40], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"


def _lowered_step(runner, T: int):
    """The T-token bucket's step lowered as the warm-up lowers it."""
    from jlight.engine import step_packing

    inp = runner.padding_inputs(T)
    ints, floats, layout = step_packing.pack(inp)
    return runner._step.lower(runner.params, runner.k_cache, runner.v_cache, runner.history, runner.prev_sampled, ints,
                              floats, runner.unconstrained_mask(inp), layout)


def _optimized_instructions(lowered):
    """The compiled step's HLO instructions, names and source locations left out, as a multiset."""
    import collections
    import re

    lines = (re.sub(r"stack_frame_id=\d+|metadata=\{[^}]*\}", "", line.strip()) for line in lowered.compile().as_text().splitlines())
    return collections.Counter(re.sub(r"[,\s]+$", "", re.sub(r"%[\w.\-]+", "%x", line)) for line in lines if " = " in line)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_layers_traced_once_give_what_layers_traced_each_give(tiny_model, arch):
    """An unrolled step that traces its alike layers once (the default) computes what tracing every layer gives:
    the same greedy tokens and prompt logprobs, from the same compiled program once XLA has inlined the calls
    (its optimized HLO, up to names). Its lowered step defines one layer function a kind of layer (a Llama's
    layers are alike; a Gemma 3's sliding-window and global layers sit in pools of their own, so each knows its
    index statically and is its own) and calls it once a layer; traced each, none."""
    import re

    path = tiny_model(arch, **({"sliding_window": 8, "num_hidden_layers": 6} if arch.startswith("Gemma") else {}))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    prompts = random_prompts(3, 5, 30, seed=4)
    outs, programs = {}, {}
    for once in (True, False):
        llm = jlight.LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=80,
                         layer_loop="unroll", trace_layers_once=once)
        lowered = _lowered_step(llm.engine.runner, 32)
        text = lowered.as_text()
        programs[once] = _optimized_instructions(lowered)
        defined = re.findall(r"func\.func private @(_call_layer_traced[\w.]*)", text)
        calls = re.findall(r"call @_call_layer_traced", text)
        layers = llm.engine.model_config.num_layers
        if not once:
            assert defined == [] and calls == []
        elif arch.startswith("Llama"):
            assert len(defined) == 1 and len(calls) == layers
        else:
            assert len(defined) == layers == len(calls)
        outs[once] = llm.generate(prompts, params, use_tqdm=False)
    assert programs[True] == programs[False] and sum(programs[True].values()) > 100
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = ([v for lp in o.prompt_logprobs[1:] for v in lp.values()] for o in (a, b))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
