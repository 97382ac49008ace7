"""AsyncLLM: streaming, abort on leaving the stream, bad parameters rejected up front, and a
failing engine step fails only the requests it held."""
import asyncio

import pytest

import jlight
from jlight import SamplingParams
from jlight.engine.async_engine import AsyncLLM


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
    with pytest.raises(RuntimeError, match="injected failure"):
        asyncio.run(collect(async_llm, [5, 6, 7], params, "doomed"))
    assert asyncio.run(collect(async_llm, [5, 6, 7], params, "after")) and calls["n"] > 1
    assert async_llm.engine.block_manager.num_used_pages == 0
