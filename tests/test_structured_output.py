"""Structured outputs on SmolLM2-135M-Instruct (float32): constrained greedy decoding against transformers
with the same grammar applied by hand, constraints mixed into batches, preemption, n > 1, abort, no
compiles after warm-up, and bad constraints refused by name."""
import json
import re
import textwrap

import jax
import numpy as np
import pytest

import jlight
from jlight import SamplingParams
from jlight.engine.structured_output import StructuredOutputParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "it depends"]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return jlight.LLM(smollm2_gguf, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                      page_size=8, num_pages=600, compilation_cache_dir=None)


def chat(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def ids_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def satisfies(kind, text):
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    return text in CHOICES


CONSTRAINTS = {"json": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": PHONE},
               "choice": {"choice": CHOICES}}


def test_constrained_greedy_matches_transformers_with_the_grammar_applied_by_hand(llm, smollm2_gguf):
    """The reference: transformers' logits for the same GGUF, the allowed tokens from a matcher built here
    from transformers' own tokenizer, argmax over those; the engine must pick the same tokens."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import torch

    from direct_forward import transformers_from_gguf

    hf_tok, hf = transformers_from_gguf(smollm2_gguf)
    prompt = hf_tok.encode(chat(llm, "Describe a made-up person as JSON with a name and an age."), add_special_tokens=False)
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA}),
                        use_tqdm=False)[0].outputs[0]

    ll_tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=hf.config.vocab_size)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.grammar_from("json_schema", json.dumps(SCHEMA)))
    mask = llguidance.numpy.allocate_token_bitmask(1, hf.config.vocab_size)
    ref = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        while len(ref) < 40 and not matcher.is_stopped():
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: hf.config.vocab_size].astype(bool)
            logits = res.logits[0, -1].numpy()
            token = int(np.where(allowed, logits, -np.inf).argmax())
            ref.append(token)
            assert matcher.consume_token(token)
            res = hf(torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True)  # noqa
    assert matcher.is_stopped(), "the reference did not complete the JSON in 40 tokens; the check would be partial"
    # The engine finishes when the grammar completes (no EOS step), so its tokens are exactly the reference's.
    assert ours.token_ids == ref, (hf_tok.decode(ours.token_ids), hf_tok.decode(ref))
    assert ours.finish_reason == "stop" and satisfies("json", ours.text)


def test_constraints_mixed_into_a_batch_leave_the_others_unchanged(llm):
    """Constrained requests (sampled with seeds) arrive among unconstrained greedy ones. Each output meets its
    constraint; the unconstrained ones equal their runs alone; a seeded constrained one equals its run alone."""
    engine = llm.engine
    rng = np.random.default_rng(0)
    plain = [chat(llm, q) for q in ("Name three fruits.", "Say hello in French.")]
    jobs = []
    for i in range(8):
        kind = list(CONSTRAINTS)[i % 4]
        params = SamplingParams(temperature=0.9, seed=100 + i, max_tokens=32, structured_outputs=CONSTRAINTS[kind])
        jobs.append((chat(llm, f"Answer #{i} please."), params, kind))
        if i % 4 == 0:
            jobs.append((plain[i // 4], SamplingParams(temperature=0, max_tokens=16), None))
    results, pending = {}, list(enumerate(jobs))
    while pending or engine.has_unfinished_requests():
        for idx, (prompt, params, _) in pending[:2]:
            engine.add_request(f"mix-{idx}", prompt, params)
        pending = pending[2:]
        for out in engine.step():
            if out.finished:
                results[int(out.request_id.split("-")[1])] = out.outputs[0]
        rng.random()
    for idx, (prompt, params, kind) in enumerate(jobs):
        out = results[idx]
        if kind is None:
            alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == alone.token_ids, idx
        elif kind == "json_object" and out.finish_reason == "length":  # any object may run past max_tokens
            assert out.text.lstrip().startswith("{"), out.text
        else:
            assert out.finish_reason == "stop", (kind, out.text)
            assert satisfies(kind, out.text), (kind, out.text)
    first = next(i for i, (_, _, kind) in enumerate(jobs) if kind == "json")
    alone = llm.generate([jobs[first][0]], jobs[first][1], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == results[first].token_ids
    assert engine.block_manager.num_used_pages == 0 and not engine.requests


def test_n_samples_preemption_and_abort(llm, smollm2_gguf):
    outs = llm.generate([chat(llm, "Pick one.")], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8,
                                                                 structured_outputs={"choice": CHOICES}), use_tqdm=False)
    assert len(outs[0].outputs) == 4 and all(o.text in CHOICES for o in outs[0].outputs)

    # A pool of 16 pages of 8 tokens holds two of these ~55-token sequences, not four: preemption must
    # happen, and the constrained outputs must be those of the roomy engine. (One 32-token step bucket:
    # one compile, and decode steps of four sequences padded to 32 tokens, not 64.)
    small = jlight.LLM(smollm2_gguf, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
                       max_model_len=512, page_size=8, num_pages=16, compilation_cache_dir=None)
    prompts = [chat(llm, f"Make up person number {i} as JSON.") for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA})
    tight = {i: out.outputs[0].token_ids for i, out in enumerate(small.generate(prompts, params, use_tqdm=False))}
    assert small.engine.stats().num_preemptions > 0
    assert [tight[i] for i in range(4)] == ids_of(llm.generate(prompts, params, use_tqdm=False))

    engine = llm.engine
    engine.add_request("to-abort", chat(llm, "JSON please."), SamplingParams(temperature=0.7, max_tokens=40,
                                                                              structured_outputs={"json_object": True}))
    for _ in range(4):
        engine.step()
    engine.abort_request("to-abort")
    engine.run_to_completion()
    assert engine.block_manager.num_used_pages == 0 and not engine.requests


def test_length_cut_is_not_an_error(llm):
    out = llm.generate([chat(llm, "JSON.")], SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": SCHEMA}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def test_no_compilation_after_warmup_with_constraints(llm):
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if name.endswith("jaxpr_to_mlir_module_duration") else None)
    jax.jit(lambda x: x * 5 - 1)(np.arange(3))
    assert events, "the compilation listener saw nothing; the check below would be empty"
    base = len(events)
    engine = llm.engine
    for i in range(24):
        constraint = list(CONSTRAINTS.values())[i % 4] if i % 3 else None
        engine.add_request(f"c-{i}", chat(llm, f"Item {i}"), SamplingParams(
            temperature=0.8, seed=i, max_tokens=int(5 + i % 7), top_p=0.9 if i % 2 else 1.0, logprobs=2 if i % 5 == 0 else None,
            structured_outputs=constraint))
        if i % 4 == 0:
            engine.step()
    engine.run_to_completion()
    assert events[base:] == [], f"{len(events) - base} compilations after warm-up"


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "[a-"}, r"structured_outputs\.regex is invalid: .*unclosed character class"),
    ({"json": {"type": "bogus"}}, r"structured_outputs\.json is invalid: .*bogus"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"grammar": "start: ( "}, r"structured_outputs\.grammar is invalid"),
    ({"choice": []}, r"structured_outputs\.choice must be a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, r"exactly one of .*; got regex, choice"),
    ({}, r"exactly one of .*; got none"),
    ({"schema": {}}, r"unknown field\(s\) schema"),
    ("json", r"structured_outputs must be a dict"),
])
def test_bad_constraints_are_refused_by_name(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([chat(llm, "x")], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert not llm.engine.requests


def test_params_object_and_dict_are_the_same(llm):
    prompt = chat(llm, "Is the sky blue?")
    a = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": CHOICES}), use_tqdm=False)
    b = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                              structured_outputs=StructuredOutputParams(choice=CHOICES)), use_tqdm=False)
    assert ids_of(a) == ids_of(b) and a[0].outputs[0].text in CHOICES


MESH_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import jlight
    from jlight import SamplingParams

    llm = jlight.LLM({path!r}, dtype="float32", mesh="tp=3", max_num_seqs=4, max_num_batched_tokens=32,
                     min_token_bucket=32, max_model_len=256, page_size=8, num_pages=128, compilation_cache_dir=None)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if name.endswith("jaxpr_to_mlir_module_duration") else None)
    prompts = [llm.tokenizer.apply_chat_template([{{"role": "user", "content": q}}]) for q in ("Is it?", "A number?", "Hi")]
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs={{"choice": ["yes", "no"]}}),
              SamplingParams(temperature=0.5, seed=1, max_tokens=8, structured_outputs={{"regex": "[0-9]{{4}}"}}),
              SamplingParams(temperature=0, max_tokens=8)]
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    print("RESULT" + json.dumps(dict(texts=texts, compiles=len(events))))
""")


@pytest.mark.extended  # a mesh of three simulated devices
def test_constrained_steps_under_a_mesh_compile_nothing(smollm2_gguf):
    """Under a mesh the all-ones mask of unconstrained steps is committed (replicated); a constrained step's
    mask passed as a host array was another jit cache key: each bucket compiled again at its first
    constrained step. Now both are replicated over the mesh."""
    from simulated_devices import run_script

    result = run_script(MESH_SCRIPT.format(path=smollm2_gguf), num_devices=3)
    assert result["compiles"] == 0
    assert result["texts"][0] in ("yes", "no") and re.fullmatch("[0-9]{4}", result["texts"][1])


def test_a_constraint_the_vocabulary_cannot_spell_ends_with_error(llm):
    """SmolLM2 has no token for the lead byte of U+62DBF (no 0xF1 byte token): after "a" no token is allowed.
    The sampled token broke the constraint and the request reported "stop"; now the token is dropped and
    the request finishes with "error"."""
    out = llm.generate([chat(llm, "Write.")], SamplingParams(temperature=0, max_tokens=8,
                                                             structured_outputs={"regex": "a\U00062DBFb"}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("a", "error") and len(out.token_ids) == 1
    assert not llm.engine.requests and llm.engine.block_manager.num_used_pages == 0
