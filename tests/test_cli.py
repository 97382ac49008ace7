"""The `jlight` command as a user meets it: the default model answers, bad input is one line."""
import os
import subprocess
import sys

import pytest
from simulated_devices import simulated_env


def jlight(*args, timeout=600):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "jlight.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_with_the_default_model_answers_paris(smollm2_gguf):
    proc = jlight("generate", "What is the capital of France?", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    summary = proc.stderr.strip().splitlines()[-1]
    assert "prompt" in summary and "generated" in summary and "time to first token" in summary and "tokens/s" in summary


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--mesh", "tp=3"], "tp=3"),
])
def test_user_errors_are_one_line_with_exit_code_2(args, needle):
    proc = jlight(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip() and not l.startswith("loading")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("jlight: error:") and needle in lines[0]


def test_unsupported_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    proc = jlight("generate", "hi", "--model", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "GPT2LMHeadModel" in proc.stderr and "LlamaForCausalLM" in proc.stderr


def test_prompt_longer_than_the_context_is_one_line(smollm2_gguf):
    proc = jlight("generate", "word " * 400, "--max-model-len", "128", "--no-chat")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "context" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.extended  # two JAX processes; test_sharding_distributed covers the engine's
def test_generate_over_two_processes_matches_one(tiny_model, tmp_path):
    """`jlight generate` in two processes joined by jax.distributed on loopback, one tp=2 mesh
    spanning both (one CPU device each), prints the same text as a single process."""
    import socket

    model = tiny_model("LlamaForCausalLM")
    common = ["generate", "Paris is the capital", "--model", model, "--dtype", "float32", "--no-chat", "--max-tokens", "12"]
    single = jlight(*common)
    assert single.returncode == 0, single.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = simulated_env(1)
    procs = [subprocess.Popen([sys.executable, "-m", "jlight.cli", *common, "--mesh", "tp=2",
                               "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        text = "\n".join(l for l in out.splitlines() if not l.startswith("[Gloo]"))  # the CPU collectives' log line
        assert text.strip() and text.strip() == single.stdout.strip()


def test_a_subcommand_imports_only_its_own_dependencies():
    """`jlight generate` builds its parser without importing serve's, batch's or convert's modules (batch's grain
    alone takes 0.3 s of the start); `jlight batch --help` still shows batch's own arguments."""
    probe = ("import sys; from jlight import cli; cli.build_parser(['generate', 'hi']); "
             "print(sorted(m for m in ('jlight.batch.cli', 'jlight.serve.cli', 'jlight.convert', 'grain') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
    batch = jlight("batch", "--help", timeout=300)
    assert batch.returncode == 0 and "--output" in batch.stdout and "--num-processes" in batch.stdout, batch.stderr[-2000:]
