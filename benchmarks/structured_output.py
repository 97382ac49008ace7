"""What structured outputs cost: the host's mask time per row, and throughput with and without constraints.

1. Mask time: R constrained sequences (a JSON schema) are advanced through a real constrained answer;
   at each token the host fills all R rows' allowed-token bitmasks at once (GrammarCompiler.fill_masks,
   llguidance's parallel fill), as a step's `prepare` does. Reports microseconds a row.
2. Throughput: N requests of the same chat prompts, all unconstrained, then all held to the schema, then
   half and half; output tokens/s, steps and the engine's host milliseconds per step.

  python benchmarks/structured_output.py                      # SmolLM2-135M-Instruct (the default model)
  python benchmarks/structured_output.py --model DIR --num-requests 64 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def mask_microseconds_per_row(llm, rows: int, answer_tokens: list[int]) -> dict:
    from jlight.engine.structured_output import StructuredOutputParams

    grammars = llm.engine.grammars
    params = StructuredOutputParams(json=SCHEMA)
    matchers = [grammars.matcher(params) for _ in range(rows)]
    bitmask = np.empty((rows, grammars.mask_words), np.int32)
    times = []
    for token in answer_tokens:
        t = time.perf_counter()
        grammars.fill_masks([(m, i) for i, m in enumerate(matchers)], bitmask)
        times.append(time.perf_counter() - t)
        for m in matchers:
            m.consume_token(token)
    per_row = np.asarray(times) / rows * 1e6
    return dict(rows=rows, tokens=len(answer_tokens), median_us_per_row=float(np.median(per_row)),
                p90_us_per_row=float(np.percentile(per_row, 90)), max_us_per_row=float(per_row.max()))


def throughput(llm, prompts: list[str], constrained: list[bool], max_tokens: int) -> dict:
    from jlight import SamplingParams

    engine = llm.engine
    engine.step_seconds = dict.fromkeys(engine.step_seconds, 0.0)
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    for i, (prompt, c) in enumerate(zip(prompts, constrained)):
        engine.add_request(f"so-{i}-{time.monotonic_ns()}", prompt, SamplingParams(
            temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs={"json": SCHEMA} if c else None))
    tokens, valid, finished = 0, 0, 0
    reasons = {}  # finish_reason -> count ("error" would mean a token the grammar refused was sampled)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids_delta)
            if out.finished:
                finished += 1
                reason = out.outputs[0].finish_reason
                reasons[reason] = reasons.get(reason, 0) + 1
                if constrained[int(out.request_id.split("-")[1])]:
                    try:
                        valid += isinstance(json.loads(out.outputs[0].text), dict)
                    except ValueError:
                        pass
    elapsed = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    return dict(requests=len(prompts), constrained=int(sum(constrained)), constrained_valid_json=valid, finish_reasons=reasons,
                output_tokens=tokens, seconds=elapsed, output_tok_s=tokens / elapsed, steps=steps,
                host_ms_per_step={k: v / max(steps, 1) * 1e3 for k, v in engine.step_seconds.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mask-rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import jlight
    from jlight import SamplingParams

    llm = jlight.LLM(a.model, dtype=a.dtype, max_num_seqs=a.num_requests, max_model_len=1024)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Invent person number {i}: name, age and city, as JSON."}])
               for i in range(a.num_requests)]
    answer = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=a.max_tokens,
                                                       structured_outputs={"json": SCHEMA}), use_tqdm=False)[0].outputs[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import result_header

    result = dict(result_header(), cpus=os.cpu_count(), model=llm.engine.model_name, vocab=llm.engine.model_config.vocab_size, args=vars(a))
    result["mask"] = [mask_microseconds_per_row(llm, r, answer.token_ids) for r in a.mask_rows]
    for m in result["mask"]:
        print(f"mask fill, {m['rows']} rows: median {m['median_us_per_row']:.0f} us a row, p90 {m['p90_us_per_row']:.0f}, "
              f"max {m['max_us_per_row']:.0f} (over {m['tokens']} tokens of a JSON answer)", flush=True)
    n = a.num_requests
    throughput(llm, prompts[:2], [False, True], 8)  # the first constrained request builds llguidance's tokenizer
    result["runs"] = {}
    for name, constrained in (("none", [False] * n), ("all", [True] * n), ("half", [i % 2 == 0 for i in range(n)])):
        r = result["runs"][name] = throughput(llm, prompts, constrained, a.max_tokens)
        print(f"{name:>4} constrained: {r['output_tok_s']:.0f} output tok/s, {r['steps']} steps, "
              f"{r['constrained_valid_json']}/{r['constrained']} valid JSON, finished {r['finish_reasons']}, host ms/step "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items()), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "structured_output.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
