"""An engine's start-up as a user meets it: short output off a terminal with a line per phase, buckets
compiled side by side giving the same steps, and a warm start that loads its steps from the cache."""
import io
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np

import jlight
from jlight import SamplingParams
from jlight.progress import Progress


def test_cli_output_off_a_terminal_is_short_and_names_each_phase(tiny_model):
    """stderr is a pipe here: no bar redraws (carriage returns), one line per phase, in order."""
    model = tiny_model("LlamaForCausalLM")
    proc = subprocess.run([sys.executable, "-m", "jlight.cli", "generate", "Paris is", "--model", model, "--dtype",
                           "float32", "--no-chat", "--max-tokens", "8"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JLIGHT_COMPILATION_CACHE_DIR=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 8, proc.stderr
    phases = ["jlight: loading " + model, "jlight: read ", "jlight: memory on cpu:0: weights ",
              "jlight: compiling ", "jlight: ready in "]
    where = [next((i for i, line in enumerate(lines) if line.startswith(p)), None) for p in phases]
    assert None not in where and where == sorted(where), proc.stderr
    memory = lines[where[2]]
    assert " pages of 16 tokens " in memory and " of host memory left" in memory
    assert lines[-1].startswith("[prompt ")  # the request's own summary comes last


def test_progress_draws_a_bar_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Records(logging.Handler):  # on the "jlight" logger itself: log_to_stderr() stops it propagating
        messages: list = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler, log = Records(), logging.getLogger("jlight")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        tty = Terminal()
        with Progress(3, "loading", "tensor", summary="read {n} {unit}s", stream=tty) as bar:
            for _ in range(3):
                bar.update()
        assert "\r" in tty.getvalue() and not any("read" in m for m in handler.messages)  # a bar, no summary line
        pipe = io.StringIO()
        with Progress(3, "loading", "tensor", summary="read {n} {unit}s in {seconds:.1f} s", stream=pipe) as bar:
            for _ in range(3):
                bar.update()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert pipe.getvalue() == ""
    assert [m[:len("read 3 tensors in ")] for m in handler.messages] == ["read 3 tensors in "]


def _engine(model, **options):
    """Two buckets (8 and 16 tokens): few compiles."""
    return jlight.LLM(model, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, min_token_bucket=8,
                      compilation_cache_dir=None, **options)


def test_buckets_compiled_on_threads_run_the_same_steps(tiny_model):
    model = tiny_model("LlamaForCausalLM")
    prompts = [list(range(3, 23)), list(range(40, 45))]  # a 16-token chunk + a 4-token one, then decode
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = []
    for threads in (1, 2):
        llm = _engine(model, compile_threads=threads)
        assert len(llm.engine.runner._executables) == len(llm.engine.runner.buckets) == 2
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.runner._step._cache_size() == 0  # every step ran a warmed-up executable
        results.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
    assert results[0] == results[1]


WARM_START = textwrap.dedent("""
    import logging, sys
    import jlight
    from jlight import SamplingParams

    class Count(logging.Handler):
        hits = misses = 0
        def emit(self, record):
            message = record.getMessage()
            if "_packed_step" in message:
                Count.hits += message.startswith("Persistent compilation cache hit")
                Count.misses += message.startswith("PERSISTENT COMPILATION CACHE MISS")

    compiler_log = logging.getLogger("jax._src.compiler")
    compiler_log.setLevel(logging.DEBUG)
    compiler_log.addHandler(Count())
    llm = jlight.LLM(sys.argv[1], dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=32,
                     min_token_bucket=8, store_executables=False)
    out = llm.generate([list(range(3, 23))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    print(Count.hits, Count.misses, out[0].outputs[0].token_ids)
""")


def test_a_warm_start_loads_every_step_from_the_compilation_cache(tiny_model, tmp_path):
    """Two processes over one $JLIGHT_COMPILATION_CACHE_DIR, without the executable store (test_executable_store.py):
    the first compiles both buckets and JAX's cache keeps them, the second finds both there and compiles none;
    the answers agree. (JAX stores only compiles of at least jax_persistent_cache_min_compile_time_secs, 1 s
    by default; the tiny model's take less, hence 0.)"""
    model = tiny_model("LlamaForCausalLM")
    env = dict(os.environ, JLIGHT_COMPILATION_CACHE_DIR=str(tmp_path / "xla"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", WARM_START, model], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        hits, misses, ids = proc.stdout.strip().splitlines()[-1].split(" ", 2)
        runs.append((int(hits), int(misses), ids))
    (cold_hits, cold_misses, cold_ids), (warm_hits, warm_misses, warm_ids) = runs
    assert (cold_hits, cold_misses) == (0, 2)
    assert (warm_hits, warm_misses) == (2, 0)
    assert cold_ids == warm_ids and np.array(eval(warm_ids)).size == 6


def test_every_step_variant_compiles_on_a_thread_of_its_own(tiny_model, monkeypatch):
    """A bucket can make several steps (the verify step's serial variant here; on GPUs a narrow page-table
    variant): with cores enough, warm-up compiles as many at once as there are steps, not buckets, so the last
    ones do not wait for a thread."""
    from jlight.engine.model_runner import ModelRunner

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    threads = []
    warmup = ModelRunner.warmup
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **kw: threads.append(kw["threads"]) or warmup(self, *a, **kw))
    llm = _engine(tiny_model("LlamaForCausalLM"), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                  verify_step_command_buffers=False)
    runner = llm.engine.runner
    assert runner.num_step_variants(runner.buckets) == 2 * len(runner.buckets) == 4
    assert threads == [4]
