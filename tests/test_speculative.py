"""Speculative decoding (n-gram prompt lookup): the proposer, the verification rule's output
distribution (a chi-square test against the target distribution), and the engine's tokens with
speculation on against speculation off on a tiny float32 Llama: batched with arrivals, chunked
prefill, prefix caching, preemption, n > 1, stop strings, logprobs and seeded sampling."""
import numpy as np
import pytest
import torch

import jax
import jlight
from jlight import SamplingParams
from jlight.engine import sampler
from jlight.engine.proposers.ngram import NgramProposer, propose_ngram
from jlight.engine.speculative import SpeculativeConfig, kept_tokens

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# A pool small enough that eight sequences of ~100 tokens preempt each other; chunks of 32 tokens.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64, min_token_bucket=8)


# --- the proposer ---------------------------------------------------------------------------

def test_proposer_takes_the_longest_recurring_suffix_and_its_latest_occurrence():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    # Suffix [7, 8] recurs at 1 and 5; its latest earlier occurrence (5) is followed by 30, 31, 7.
    tokens = np.array([1, 7, 8, 20, 21, 7, 8, 30, 31, 7, 8])
    assert propose_ngram(tokens, cfg, max_drafts=8) == [30, 31, 7]
    assert propose_ngram(tokens, cfg, max_drafts=2) == [30, 31]
    # The 3-token suffix [9, 7, 8] recurs once (after 5); the 1-token suffix [8] would pick a later place.
    tokens = np.array([9, 7, 8, 40, 41, 5, 7, 8, 50, 9, 7, 8])
    assert propose_ngram(tokens, cfg, max_drafts=8) == [40, 41, 5]
    # A suffix shorter than prompt_lookup_min never matches; nothing recurs -> no drafts.
    assert propose_ngram(np.array([1, 2, 3, 1]), SpeculativeConfig(prompt_lookup_min=2), 8) == []
    assert propose_ngram(np.array([1, 2, 3, 4]), cfg, 8) == []
    # A match near the end continues its period: [5] recurs 2 tokens back, so 6, 5, 6, ...
    assert propose_ngram(np.array([5, 6, 5]), cfg, 8) == [6, 5, 6]
    assert propose_ngram(np.array([5, 6, 5]), cfg, 2) == [6, 5]


def test_a_periodic_history_gets_every_draft():
    """A history that repeats one token, or a cycle of two, drafts num_speculative_tokens tokens that
    continue the cycle (not only the tokens between the latest occurrence and the end)."""
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    assert propose_ngram(np.full(40, 7, np.int32), cfg, max_drafts=4) == [7, 7, 7, 7]
    assert propose_ngram(np.array([3, 9] * 20, np.int32), cfg, max_drafts=4) == [3, 9, 3, 9]
    assert propose_ngram(np.array([1, 2, 3] + [3, 9] * 20 + [3], np.int32), cfg, max_drafts=4) == [9, 3, 9, 3]
    assert propose_ngram(np.array([3, 9] * 20, np.int32), cfg, max_drafts=3) == [3, 9, 3]


def _brute_force_ngram(tokens, config, max_drafts):
    """The proposer's rule by exhaustive search: every window of every suffix length, then a copy of what
    followed the latest one that reads on into its own output (the drafts) where it reaches the end."""
    max_drafts = min(max_drafts, config.num_speculative_tokens)
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        starts = [s for s in range(len(tokens) - n) if list(tokens[s:s + n]) == list(tokens[len(tokens) - n:])]
        if starts and max_drafts > 0:
            text = [int(t) for t in tokens]
            for i in range(max_drafts):
                text.append(text[starts[-1] + n + i])
            return text[len(tokens):]
    return []


def test_proposer_matches_an_exhaustive_search_on_random_histories():
    rng = np.random.default_rng(0)
    for cfg in (SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4),
                SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)):
        for _ in range(400):  # few distinct ids: suffixes recur often, at several lengths
            tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).astype(np.int32)
            for max_drafts in (0, 1, 5):
                assert propose_ngram(tokens, cfg, max_drafts) == _brute_force_ngram(tokens, cfg, max_drafts), tokens


def test_kept_tokens_stop_at_the_first_rejection():
    drafts = [10, 11, 12]
    sampled = np.array([10, 11, 99, 13])
    assert kept_tokens(drafts, sampled, np.array([True, True, False, False])) == [10, 11, 99]
    assert kept_tokens(drafts, np.array([55, 11, 12, 13]), np.array([False, True, True, False])) == [55]
    assert kept_tokens(drafts, np.array([10, 11, 12, 13]), np.array([True, True, True, False])) == [10, 11, 12, 13]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle7"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"), ({"lookahead": 3}, "unknown keys"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"), ("ngram", "must be a dict")])
def test_bad_config_names_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


# --- the verification rule ------------------------------------------------------------------

N_ROWS = 40_000
V = 24  # the sampler computes 20 top logprobs, so at least 20 tokens
LOGITS = np.sort(np.random.default_rng(5).normal(0, 1.2, V)).astype(np.float32)[::-1].copy()  # token 0 most likely


def target_probs(temperature, top_k):
    x = LOGITS / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.fixture(scope="module")
def sample_fn():
    return jax.jit(sampler.sample)


def chi_square_p(counts, probs):
    """P-value of Pearson's chi-square over the cells the target gives mass (torch's regularized gamma)."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("temperature, top_k, draft", [(1.0, 0, 0), (1.0, 0, 9), (0.7, 3, 1), (1.0, 3, 20)])
def test_verified_tokens_follow_the_target_distribution(sample_fn, temperature, top_k, draft):
    """Each row verifies the same draft with its own seed: the kept token (the draft when accepted,
    else the residual sample) must be distributed as the target, whatever the draft is (a draft the
    top-k filter removes is never kept), and be the token the row samples without a draft."""
    B = N_ROWS
    s = sampler.SamplingInputs(
        temperature=np.full(B, temperature, np.float32), top_k=np.full(B, top_k, np.int32), top_p=np.ones(B, np.float32),
        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32), presence_penalty=np.zeros(B, np.float32),
        frequency_penalty=np.zeros(B, np.float32), seed=np.arange(B, dtype=np.uint32), token_index=np.full(B, 3, np.int32),
        banned_ids=np.full((B, sampler.NUM_BANNED), -1, np.int32), bias_ids=np.full((B, sampler.NUM_BIAS), -1, np.int32),
        bias_values=np.zeros((B, sampler.NUM_BIAS), np.float32), use_penalties=np.bool_(False),
        use_filters=np.bool_(top_k > 0), want_logprobs=np.bool_(False), use_guide=np.bool_(False),
        draft_tokens=np.full(B, draft, np.int32))
    tokens, _, _, _, accepted = jax.device_get(sample_fn(np.tile(LOGITS, (B, 1)), s))
    undrafted, _, _, _, none = jax.device_get(sample_fn(np.tile(LOGITS, (B, 1)), s._replace(draft_tokens=np.full(B, -1, np.int32))))
    np.testing.assert_array_equal(tokens, undrafted)
    assert not none.any()
    probs = target_probs(temperature, top_k)
    np.testing.assert_array_equal(tokens[accepted], draft)
    assert abs(accepted.mean() - probs[draft]) < 5 * np.sqrt(probs[draft] * (1 - probs[draft]) / B) + 1e-9
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token the filters remove was produced"
    assert chi_square_p(counts, probs) > 1e-4, (counts / B, probs)


def test_greedy_rows_accept_exactly_the_argmax(sample_fn):
    B = 4
    logits = np.random.default_rng(0).normal(0, 2, (B, 50)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = np.array([best[0], (best[1] + 1) % 50, -1, best[3]], np.int32)
    s = sampler.SamplingInputs(
        temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32), presence_penalty=np.zeros(B, np.float32),
        frequency_penalty=np.zeros(B, np.float32), seed=np.zeros(B, np.uint32), token_index=np.zeros(B, np.int32),
        banned_ids=np.full((B, sampler.NUM_BANNED), -1, np.int32), bias_ids=np.full((B, sampler.NUM_BIAS), -1, np.int32),
        bias_values=np.zeros((B, sampler.NUM_BIAS), np.float32), use_penalties=np.bool_(False), use_filters=np.bool_(False),
        want_logprobs=np.bool_(False), use_guide=np.bool_(False), draft_tokens=drafts)
    tokens, _, _, _, accepted = jax.device_get(sample_fn(logits, s))
    np.testing.assert_array_equal(accepted, [True, False, False, True])
    np.testing.assert_array_equal(tokens, best)


# --- the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engines(model_dir):
    """Speculation off and on; the speculating engine drafts ahead and its verify steps read back first run their
    serial variant (a second executable of every step bucket), both as on GPUs, so its tests check both paths."""
    return jlight.LLM(model_dir, **ENGINE), jlight.LLM(model_dir, **ENGINE, speculative_config=SPEC,
                                                       verify_step_command_buffers=False, draft_ahead=True)


def grounded_prompts(n, seed):
    """Prompts that repeat a phrase (the proposer finds matches), and plain random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, 500, int(rng.integers(4, 12))).tolist()
        out.append(phrase * int(rng.integers(2, 5)) if i % 3 else rng.integers(3, 500, int(rng.integers(5, 60))).tolist())
    return out


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_tokens_equal_speculation_off_batched_chunked_cached_and_preempted(engines):
    plain, spec = engines
    prompts = grounded_prompts(10, seed=1)
    prompts += [prompts[1] + prompts[4][:9], prompts[2][:16] + [7, 7, 7]]  # shared prefixes: prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    before = spec.engine.stats()
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    got = token_ids(spec.generate(prompts, params, use_tqdm=False))
    assert got == want
    stats = spec.engine.stats()
    drafts = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert stats.spec_num_drafts > before.spec_num_drafts and 0 < accepted < drafts  # kept some drafts, rejected others
    assert stats.num_preemptions > before.num_preemptions
    assert stats.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens
    per_pos = np.subtract(stats.spec_accepted_per_position, before.spec_accepted_per_position or 0)
    assert per_pos.sum() == accepted and np.all(np.diff(per_pos) <= 0)  # draft i + 1 is kept only after draft i


def test_n_samples_stop_strings_and_logprobs_match_speculation_off(engines):
    plain, spec = engines
    prompts = grounded_prompts(4, seed=2)[1:]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=2, logprobs=2)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            for lw, lg in zip(cw.logprobs, cg.logprobs):
                assert lw.keys() == lg.keys()
                np.testing.assert_allclose(list(lg.values()), list(lw.values()), atol=1e-4)
    # A stop string taken from the middle of a continuation ends both runs at the same place.
    text = want[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    w, g = (llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0] for llm in (plain, spec))
    assert (g.text, g.finish_reason) == (w.text, w.finish_reason) and w.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engines):
    """The drafts a sequence gets depend on the batch (a row drafted ahead or not); its seeded tokens do not, and
    equal speculation off's."""
    plain, spec = engines
    prompts = grounded_prompts(4, seed=3)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=11)
    alone = [spec.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    batched = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert batched[:2] == alone
    assert spec.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids == alone[0]
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == batched


def test_metrics_and_cli_carry_the_speculative_counters(engines):
    import argparse

    from jlight.engine_args import add_engine_arguments, engine_options
    from jlight.serve.metrics import ServerMetrics, parse_metrics

    _, spec = engines
    spec.generate(grounded_prompts(3, seed=4), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stats = spec.engine.stats()
    m = parse_metrics(ServerMetrics().render(stats))
    assert m["jlight:spec_decode_num_drafts_total"] == stats.spec_num_drafts > 0
    assert m["jlight:spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert m["jlight:spec_decode_num_accepted_tokens_total"] == stats.spec_num_accepted_tokens
    assert [m[f'jlight:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)] == \
        list(stats.spec_accepted_per_position)
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    opts = engine_options(p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert opts["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "ngram"])


def test_a_speculating_sequence_launches_a_step_in_every_engine_step(engines):
    """Its drafts need the token the step in flight samples: step() reads that step back, then launches the
    next one in the same call, so no call only waits (the device would idle over it)."""
    _, spec = engines
    engine = spec.engine
    launches, launch = [], engine.runner.launch
    engine.runner.launch = lambda inp, guide_mask=None, serial=False: launches.append(serial) or launch(inp, guide_mask, serial)
    try:
        engine.add_request("one", None, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                           prompt_token_ids=grounded_prompts(2, seed=5)[1])
        calls = 0
        while engine.has_unfinished_requests():
            engine.step()
            calls += 1
    finally:
        engine.runner.launch = launch
    assert calls <= len(launches) + 1  # the last call reads the last step back
    assert any(launches) and not all(launches)  # steps verifying drafts ran serial, the prompt's prefill did not
    runner = engine.runner
    assert runner._serial_executables.keys() == runner._executables.keys()  # warmed up: both variants of each
    assert runner._serial_step._cache_size() == runner._step._cache_size() == 0  # ... so jit compiled neither



def spy_launches(engine):
    """Record whether each launch from now on runs serial; returns (list, undo)."""
    launches, launch = [], engine.runner.launch
    engine.runner.launch = lambda inp, guide_mask=None, serial=False: launches.append(serial) or launch(inp, guide_mask, serial)
    return launches, lambda: setattr(engine.runner, "launch", launch)


def test_rows_drafted_ahead_of_rejected_drafts_are_discarded_and_the_tokens_stay_exact(engines):
    plain, spec = engines
    engine = spec.engine
    prompts = grounded_prompts(6, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    before = engine.stats()
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == want
    stats = engine.stats()
    ahead = stats.spec_num_ahead_rows - before.spec_num_ahead_rows
    discarded = stats.spec_num_ahead_discarded - before.spec_num_ahead_discarded
    assert 0 < discarded < ahead


class OracleProposer(NgramProposer):
    """Drafts the continuation a plain engine gave (every draft is kept), or, with `wrong_every`, puts a wrong
    last draft into every wrong_every-th row."""

    def __init__(self, config, answers: dict, wrong_every: int = 0):
        super().__init__(config)
        self.answers, self.wrong_every, self.rows = answers, wrong_every, 0

    def _next(self, seq, skip, max_drafts):
        start = len(seq.output_token_ids) + skip
        drafts = list(self.answers[tuple(seq.prompt_token_ids)][start:start + min(max_drafts, self.config.num_speculative_tokens)])
        self.rows += 1
        if drafts and self.wrong_every and self.rows % self.wrong_every == 0:
            drafts[-1] = (drafts[-1] + 1) % 500
        return drafts

    def drafts(self, seq, max_drafts):
        return self._next(seq, 0, max_drafts)

    def drafts_after(self, seq, in_flight, max_drafts):
        return self._next(seq, len(in_flight) + 1, max_drafts)


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_rows_drafted_ahead_keep_the_loop_pipelined(engines, wrong_every):
    """While a sequence's verify rows keep every draft, each of its rows is launched before the step in flight is
    read back, on the runner's pipelined variant (none serial); a rejected draft costs its row ahead and one
    step read back first, and the tokens stay speculation off's."""
    plain, spec = engines
    engine = spec.engine
    prompt = grounded_prompts(3, seed=8)[1]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    oracle = OracleProposer(engine.proposer.config, {tuple(prompt): want}, wrong_every)
    proposer = engine.proposer
    engine.proposer = engine.scheduler.proposer = oracle
    launches, undo = spy_launches(engine)
    before = engine.stats()
    try:
        engine.add_request("oracle", None, params, prompt_token_ids=prompt)
        calls, got = 0, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                got = o.outputs[0].token_ids
            calls += 1
    finally:
        undo()
        engine.proposer = engine.scheduler.proposer = proposer
    assert got == want
    stats = engine.stats()
    discarded = stats.spec_num_ahead_discarded - before.spec_num_ahead_discarded
    ahead = stats.spec_num_ahead_rows - before.spec_num_ahead_rows
    steps = stats.num_steps - before.num_steps
    if not wrong_every:
        assert calls == len(launches) + 1  # every call launched a step; the last one only read
        assert discarded == 0 and not any(launches)
        assert ahead == steps - 1  # every step after the prompt's drafted ahead
        assert steps <= 1 + -(-40 // 5) + 1  # 5 tokens a step (4 drafts kept + 1), one wasted step at the end
    else:  # near max_tokens a row ahead has no room, and a rejection then leaves one more call that only reads
        assert calls <= len(launches) + 2
        assert 0 < discarded and any(launches) and not all(launches)


def test_the_cpu_reads_verify_steps_back_first_by_default(model_dir):
    """draft_ahead=None drafts ahead on GPUs only: on the CPU the step runs on the host's cores, nothing overlaps."""
    llm = jlight.LLM(model_dir, **ENGINE, speculative_config=SPEC, warmup=False)
    assert llm.engine.scheduler.draft_ahead is False
    assert jlight.LLM(model_dir, **ENGINE, speculative_config=SPEC, warmup=False, draft_ahead=True).engine.scheduler.draft_ahead


TP_SCRIPT = """
import json
import jlight
from jlight import SamplingParams

prompts, engine, spec = {prompts!r}, {engine!r}, {spec!r}
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
out = {{}}
for name, kw in (("tp=2", dict(mesh="tp=2", speculative_config=spec, draft_ahead=True)), ("single", {{}})):
    llm = jlight.LLM({model_dir!r}, **engine, **kw)
    out[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.stats()
    out[name + " kept"], out[name + " ahead"] = stats.spec_num_accepted_tokens, stats.spec_num_ahead_rows
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_tensor_parallel_speculation_gives_the_single_device_tokens(model_dir):
    """n-gram speculation, drafting ahead, on a tp=2 mesh of simulated CPU devices: the greedy tokens of one device
    without speculation."""
    from simulated_devices import run_script

    out = run_script(TP_SCRIPT.format(prompts=grounded_prompts(4, seed=9), engine=ENGINE, spec=SPEC, model_dir=model_dir), 2)
    assert out["tp=2"] == out["single"]
    assert out["tp=2 kept"] > 0 and out["tp=2 ahead"] > 0
