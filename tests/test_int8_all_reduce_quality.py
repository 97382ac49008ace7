"""ZhiLight's int8 all-reduce on the real model: SmolLM2-135M split tp=3 (3 simulated CPU
devices), teacher-forced top-1 agreement with the exact all-reduce must be >= 99%."""
import json
import os
import subprocess
import sys
import textwrap

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Compilers translated human-readable "
    "code into machine instructions, and operating systems shared one processor among many users. Networks "
    "connected machines across buildings and then continents, and the web turned those networks into a "
    "library anyone could read. Today, accelerators built for matrix arithmetic train and serve language "
    "models with billions of parameters. Serving such a model efficiently means keeping the accelerator busy: "
    "batching requests together, caching the keys and values of earlier tokens in pages, and splitting the "
    "largest layers across several chips so that each holds only part of the weights. When the chips exchange "
    "partial results, the links between them can become the bottleneck, which is why some engines compress "
    "what they send, for example by quantizing activations to eight bits before the reduction and restoring "
    "them afterwards. The question is always whether the answers stay the same."
)

SCRIPT = textwrap.dedent("""
    import json
    import jlight
    from jlight import SamplingParams

    def top1(int8):
        llm = jlight.LLM(None, dtype="float32", mesh="tp=3", int8_all_reduce=int8, collective_matmul=False,
                         max_num_seqs=1, max_num_batched_tokens=256, max_model_len=1024)
        ids = llm.tokenizer.encode({text!r})
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
        return [max(d, key=d.get) for d in out.prompt_logprobs[1:]]

    exact, int8 = top1(False), top1(True)
    print("RESULT" + json.dumps(dict(n=len(exact), agree=sum(a == b for a, b in zip(exact, int8)))))
""")


def test_int8_all_reduce_keeps_smollm2_top1_agreement(smollm2_gguf):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(text=TEXT)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert result["n"] >= 150
    agreement = result["agree"] / result["n"]
    print(f"int8 all-reduce top-1 agreement: {result['agree']}/{result['n']} = {agreement:.4f}")
    assert agreement >= 0.99
