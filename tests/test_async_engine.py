"""AsyncLLM: streaming, abort on leaving the stream, an abort that ends the stream with its last
output, a consumer that does not read holding one merged output, bad parameters rejected up
front, and a failing engine step fails only the requests it held, naming each."""
import asyncio

import pytest

import jlight
from jlight import SamplingParams
from jlight.engine.async_engine import AsyncLLM, RequestFailedError


@pytest.fixture(scope="module")
def async_llm(tiny_model):
    llm = jlight.LLM(tiny_model("LlamaForCausalLM"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
                     page_size=8, num_pages=128, min_token_bucket=32)  # one compiled step
    a = AsyncLLM(llm)
    yield a
    a.shutdown()


async def collect(a, prompt, params, rid, stop_after=None):
    ids = []
    async for out in a.generate(prompt, params, rid):
        ids += out.outputs[0].token_ids_delta
        if stop_after and len(ids) >= stop_after:
            break
    return ids


def test_streams_and_abort_on_leaving(async_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def main():
        full, cut = await asyncio.gather(collect(async_llm, [5, 6, 7], params, "full"),
                                         collect(async_llm, [8, 9, 10], params, "cut", stop_after=3))
        await asyncio.sleep(0.3)  # the abort is applied between engine steps
        return full, cut

    full, cut = asyncio.run(main())
    assert len(full) == 16 and 3 <= len(cut) < 16
    assert async_llm.engine.block_manager.num_used_pages == 0


def test_bad_parameters_raise_before_queueing(async_llm):
    async def main():
        await collect(async_llm, [5, 6], SamplingParams(top_k=2**40), "bad")

    with pytest.raises(ValueError, match="top_k"):
        asyncio.run(main())


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(async_llm, monkeypatch):
    runner = async_llm.engine.runner
    real_prepare = runner.prepare
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OverflowError("injected failure")
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(runner, "prepare", failing_once)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(RequestFailedError, match="request doomed failed in the engine .*injected failure") as failed:
        asyncio.run(collect(async_llm, [5, 6, 7], params, "doomed"))
    assert failed.value.request_id == "doomed"
    assert asyncio.run(collect(async_llm, [5, 6, 7], params, "after")) and calls["n"] > 1
    assert async_llm.engine.block_manager.num_used_pages == 0


def test_abort_ends_the_stream_with_an_abort_output(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        outs = []
        async for out in async_llm.generate([5, 6, 7], params, "stopped"):
            outs.append(out)
            if len(outs) == 2:
                async_llm.abort("stopped")
        return outs

    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    # Stream outputs carry their new part only (token_ids as token_ids_delta); together, the answer so far.
    assert all(o.outputs[0].token_ids == o.outputs[0].token_ids_delta for o in outs)
    assert 2 <= len(sum((o.outputs[0].token_ids for o in outs), [])) < 200
    assert async_llm.engine.block_manager.num_used_pages == 0


def test_a_consumer_that_does_not_read_holds_one_merged_output(async_llm):
    """The engine runs on while nobody reads; what waits is one output with every delta since."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        stream = async_llm.generate([5, 6, 7], params, "late-reader")
        first = await stream.__anext__()
        for _ in range(200):  # the request finishes meanwhile
            await asyncio.sleep(0.01)
            if async_llm.stats().num_running == 0:
                break
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished  # 23 tokens' outputs, merged while unread
    c0, c = first.outputs[0], rest[0].outputs[0]
    assert (c.token_ids, c.text) == (c.token_ids_delta, c.text_delta)  # what was not handed on, nothing before
    assert len(c0.token_ids) == 1 and len(c0.token_ids + c.token_ids) == 24


def test_an_unread_stream_holds_only_its_unsent_tokens_packed(async_llm):
    """A stream nobody reads, its request finished: what waits is its unsent tokens' logprobs, packed
    (~8 bytes a top-logprob pair), not the engine's cumulative list of dicts (~60 bytes a pair: about
    1.2 MB here, which the code before stream_output kept for every silent reader)."""
    import gc
    import tracemalloc

    n, max_tokens, top = 4, 200, 20
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True, logprobs=top)

    async def unread_then_read(rid):
        stream = async_llm.generate([5, 6, 7], params, rid)
        first = await stream.__anext__()
        for _ in range(1000):  # the request finishes while nobody reads
            await asyncio.sleep(0.01)
            if async_llm.stats().num_running == 0 and async_llm.stats().num_waiting == 0:
                break
        await asyncio.sleep(0.05)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        rest = [out async for out in stream]
        return first, rest, held

    asyncio.run(unread_then_read("warm"))  # compiles the logprobs step outside the measurement
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        first, rest, held = asyncio.run(unread_then_read("silent"))
    finally:
        tracemalloc.stop()
    assert len(rest) == 1 and rest[0].finished
    unsent = sum(len(c.token_ids_delta) for c in rest[0].outputs)
    # ~21 pairs a token; as dicts of Python ints and floats a pair takes ~60 bytes (tracemalloc: ~64)
    dicts_bytes = unsent * (top + 1) * 60
    print(f"an unread stream held {(held - before) / 1e3:.0f} kB for {unsent} unsent tokens "
          f"(as dicts: ~{dicts_bytes / 1e3:.0f} kB)")
    assert held - before < 0.4 * dicts_bytes, f"an unread stream holds {(held - before) / 1e3:.0f} kB for " \
                                               f"{unsent} unsent tokens' logprobs"
    for c0, c in zip(first.outputs, rest[0].outputs):
        assert len(c0.logprobs) + len(c.logprobs) == len(c0.token_ids) + len(c.token_ids) == max_tokens  # each token's, once
        for token, entry in zip(c.token_ids_delta, c.logprobs):
            assert token in entry and len(entry) in (top, top + 1) and all(v <= 0 for v in entry.values())


def test_join_and_merge_put_delta_outputs_back_together():
    """Stream outputs carry their new part only; join_outputs (a whole response) and a run of merge_outputs (a
    slow reader's mailbox) give the same whole answer, logprobs included, and the last output's finish."""
    from jlight.engine.async_engine import join_outputs, merge_outputs, stream_output
    from jlight.engine.outputs import CompletionOutput, RequestOutput

    def delta(ids, text, reason=None):
        return stream_output(RequestOutput("r", None, [1], [CompletionOutput(
            index=0, text=text, token_ids=list(ids), finish_reason=reason, text_delta=text, token_ids_delta=list(ids),
            logprobs=[{t: -0.5} for t in ids])], finished=reason is not None))

    outs = lambda: [delta([3], "a"), delta([4, 5], "bc"), delta([], ""), delta([6], "d", "length")]
    whole = join_outputs(outs())
    merged = outs()
    while len(merged) > 1:
        merged[:2] = [merge_outputs(merged[0], merged[1])]
    for out in (whole, merged[0]):
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length"
        assert (c.text, c.token_ids, c.text_delta, c.token_ids_delta) == ("abcd", [3, 4, 5, 6], "abcd", [3, 4, 5, 6])
        assert list(c.logprobs) == [{3: -0.5}, {4: -0.5}, {5: -0.5}, {6: -0.5}]
