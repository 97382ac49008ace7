"""Disaggregated prefill and decode (jlight/engine/disaggregated.py) on 8 simulated CPU devices: a
prefill engine tensor parallel over devices 0-3 and a decode engine over 4-7 give exactly the tokens of
one engine for a batch of mixed requests, while one request is aborted mid-transfer (both sides' pages
freed) and two transfers fail (one at dispatch, one when polled) and are recomputed on the decode side, every
output's token deltas joining into its tokens;
and with a decode pool too small for the batch, whose preemptions recompute adopted requests."""
import textwrap

from simulated_devices import run_script

SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    import jlight
    from jlight import SamplingParams
    from jlight.engine.disaggregated import DisaggregatedEngine, device_put_tree
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    model = {model!r}
    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, page_size=8,
                num_pages=128)
    rng = np.random.default_rng(0)
    lens = (5, 40, 130, 17, 64, 9, 33, 90)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in lens]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.8, n=2, max_tokens=6, seed=3),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
              greedy, greedy]

    deltas = {{}}  # request id -> the token deltas its outputs carried, joined (what a stream hands out)

    def collect(engine, abort_id=None):
        done, aborted = {{}}, None
        deltas.clear()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{{i}}", None, sp, prompt_token_ids=p)
        while engine.has_unfinished_requests():
            for o in engine.step():
                for c in o.outputs:
                    deltas.setdefault(o.request_id, {{}}).setdefault(c.index, []).extend(c.token_ids_delta)
                if o.finished:
                    done[o.request_id] = [c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]
            if abort_id and aborted is None and any(h.request_id == abort_id for h in engine._moving):
                pre, dec = engine.prefill.block_manager.num_used_pages, engine.decode.block_manager.num_used_pages
                out = engine.abort_request(abort_id)
                aborted = dict(reason=out.outputs[0].finish_reason, tokens=out.outputs[0].token_ids,
                               freed=[pre - engine.prefill.block_manager.num_used_pages,
                                      dec - engine.decode.block_manager.num_used_pages])
        return done, aborted

    single = LLMEngine(EngineConfig(model, mesh="tp=4", **opts), devices=jax.devices()[:4])
    want, _ = collect(single)

    class FailingReadiness:  # a copy whose failure shows only when it is polled
        def is_ready(self):
            raise RuntimeError("injected: the copy failed on the device")

    calls = []
    def transfer(data, shardings):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("injected: the copy failed at dispatch")
        moved = device_put_tree(data, shardings)
        return (moved, FailingReadiness()) if len(calls) == 4 else moved

    llm = jlight.LLM(model, disaggregated="prefill=4,decode=4", **opts)
    engine = llm.engine
    engine.transfer = transfer
    groups = [sorted(d.id for d in e.runner.k_cache.devices()) for e in (engine.prefill, engine.decode)]
    copies = lambda: [engine.prefill.runner._read_pages._cache_size(), engine.decode.runner._write_pages._cache_size()]  # jit fallbacks
    compiled = copies()
    got, aborted = collect(engine, abort_id="r7")
    streamed = {{rid: [d[i] for i in sorted(d)] for rid, d in deltas.items() if rid in got}}
    s = engine.stats()
    # A decode pool of 23 pages, less than the batch needs: adopted requests are preempted there and
    # recomputed, and handoffs wait for room.
    small = DisaggregatedEngine(engine.prefill, LLMEngine(EngineConfig(model, mesh="tp=4", **{{**opts, "num_pages": 24}}),
                                                           devices=jax.devices()[4:]))
    tight, _ = collect(small)
    print("RESULT" + json.dumps(dict(
        copies_compiled=[compiled, copies()], tight=tight, tight_preemptions=small.decode.stats().num_preemptions,
        tight_used=[small.prefill.block_manager.num_used_pages, small.decode.block_manager.num_used_pages],
        want=want, got=got, streamed=streamed, aborted=aborted, groups=groups, failures=engine.num_transfer_failures,
        transfers=engine.num_transfers, used=[engine.prefill.block_manager.num_used_pages,
                                               engine.decode.block_manager.num_used_pages],
        prompt_tokens=s.prompt_tokens_total, generated=s.generation_tokens_total,
        single_prompt_tokens=single.stats().prompt_tokens_total)))
""")


def test_prefill_on_0_3_decode_on_4_7_gives_the_single_engine_tokens(tiny_model):
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=1024)
    out = run_script(SCRIPT.format(model=model), 8)
    assert out["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    want, got = out["want"], out["got"]
    # r7 was aborted while its pages were in transfer: held on both sides until then, freed by the abort.
    assert out["aborted"]["reason"] == "abort" and len(out["aborted"]["tokens"]) == 1
    assert out["aborted"]["freed"][0] == out["aborted"]["freed"][1] == -(-90 // 8)
    assert "r7" not in got and set(got) == set(want) - {"r7"}
    for rid in got:  # tokens, and logprobs (r2), exactly as one engine gives them
        assert got[rid][0] == want[rid][0], rid
    assert got["r2"][1] == want["r2"][1]
    # a stream hands out every token once, the first one too, whether the transfer landed or failed (at dispatch too)
    assert out["streamed"] == {rid: got[rid][0] for rid in got}
    assert [len(t) for t in got["r4"][0]] == [6, 6] and got["r3"][0] == [want["r3"][0][0]]
    # 6 requests handed over (r3 ended at its first token, r4 ran on the decode side): 2 failed and recomputed.
    assert out["transfers"] == 6 and out["failures"] == 2
    assert out["used"] == [0, 0]
    assert out["copies_compiled"][0] == out["copies_compiled"][1]  # the handoff's copies compiled at warm-up
    assert out["prompt_tokens"] == out["single_prompt_tokens"]
    assert out["tight"] == want and out["tight_preemptions"] > 0 and out["tight_used"] == [0, 0]
    assert out["generated"] == sum(len(t) for toks, _ in got.values() for t in toks) + 1  # + r7's first token
