"""`jlight batch` end to end on a tiny random Llama: same answers as LLM.generate, exactly-once
answers across SIGKILLs, two jax.distributed processes merge to the single-process output,
bad lines become error records with their line numbers."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from jlight.batch import cli as batch_cli
from jlight.engine.sampling_params import SamplingParams

# The same engine shape everywhere (in-process and subprocesses), so XLA's persistent
# compilation cache serves every run after the first.
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128"]
ENGINE_KWARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
NUM_LINES = 200
WORDS = "the quick brown fox jumps over lazy dog Paris is capital of France numbers and letters".split()


def make_lines(seed: int = 0) -> list[dict]:
    """Mixed requests: text prompts of 1-40 words, token-id prompts, chats, per-line max_tokens."""
    rng = random.Random(seed)
    lines = []
    for i in range(NUM_LINES):
        kind = rng.random()
        if kind < 0.1:
            line = {"prompt": [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]}
        elif kind < 0.2:
            line = {"messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}]}
        else:
            line = {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))}
        if rng.random() < 0.5:
            line["max_tokens"] = rng.randint(1, 12)
        if rng.random() < 0.3:
            line["id"] = f"req-{i}"
        lines.append(line)
    return lines


def write_jsonl(path, lines: list) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def batch_args(input_path: str, output_path: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    batch_cli.add_arguments(parser)
    return parser.parse_args([input_path, "-o", output_path, *ENGINE_FLAGS, "--max-tokens", "8", "--temperature", "0",
                              "--no-progress", *extra])


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir):
    import jlight.api

    return jlight.api.LLM(model_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def job(tmp_path_factory, llm):
    """The 200-line job run in-process once; its output is the reference for the other tests."""
    root = tmp_path_factory.mktemp("batch")
    lines = make_lines()
    input_path = write_jsonl(root / "input.jsonl", lines)
    output_path = str(root / "output.jsonl")
    assert batch_cli.run(batch_args(input_path, output_path), llm=llm) == 0
    return lines, input_path, read_jsonl(output_path)


def test_batch_matches_llm_generate(job, llm):
    lines, _, output = job
    assert len(output) == NUM_LINES
    prompts, params = [], []
    for line in lines:
        prompt = line.get("prompt")
        if "messages" in line:
            prompt = llm.apply_chat_template(line["messages"])
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=line.get("max_tokens", 8), temperature=0.0))
    want = llm.generate(prompts, params, use_tqdm=False)
    for number, (line, record, ref) in enumerate(zip(lines, output, want), start=1):
        assert record["line"] == number
        assert record["id"] == line.get("id", f"line-{number}")
        assert record["text"] == ref.outputs[0].text, f"line {number}"
        assert record["completion_tokens"] == len(ref.outputs[0].token_ids)
        assert record["prompt_tokens"] == len(ref.prompt_token_ids)
        assert record["finish_reason"] == ref.outputs[0].finish_reason
    assert any(r["finish_reason"] == "length" for r in output)
    assert len({r["text"] for r in output}) > 20  # the prompts really differ


def _cli_cmd(input_path, output_path, *extra):
    return [sys.executable, "-m", "jlight.batch.cli", input_path, "-o", output_path, *ENGINE_FLAGS,
            "--max-tokens", "8", "--temperature", "0", "--no-progress", *extra]


def _subprocess_env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _count_lines(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.extended  # many process kills; test_batch's resume tests cover one
def test_sigkill_at_random_points_then_rerun_answers_each_line_once(job, model_dir, tmp_path):
    lines, input_path, want = job
    output_path = str(tmp_path / "killed.jsonl")
    answers = os.path.join(output_path + ".parts", "part-00000-of-00001.jsonl")
    # Few requests in flight and a checkpoint after every step: many write/checkpoint points to hit.
    cmd = _cli_cmd(input_path, output_path, "--model", model_dir, "--max-inflight", "3", "--checkpoint-interval", "0")
    rng = random.Random(1234)
    kills = 0
    for _ in range(4):
        done_before = _count_lines(answers)
        target = done_before + rng.randint(5, 40)
        proc = subprocess.Popen(cmd, env=_subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while proc.poll() is None and _count_lines(answers) < target and time.monotonic() < deadline:
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read().decode()[-3000:]
    assert kills >= 3, "the job finished before it could be killed; the test did not test resumption"
    assert not os.path.exists(output_path)
    final = subprocess.run(cmd, env=_subprocess_env(), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert read_jsonl(output_path) == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.extended  # two JAX processes
def test_two_distributed_processes_merge_to_the_single_process_output(job, model_dir, tmp_path):
    _, input_path, want = job
    output_path = str(tmp_path / "two.jsonl")
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            _cli_cmd(input_path, output_path, "--model", model_dir, "--num-processes", "2", "--process-id", str(i),
                     "--coordinator-address", coordinator),
            env=_subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for i in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-3000:]
    parts = [read_jsonl(os.path.join(output_path + ".parts", f"part-{i:05d}-of-00002.jsonl")) for i in range(2)]
    assert [len(p) for p in parts] == [NUM_LINES // 2, NUM_LINES // 2]  # grain's even split
    assert max(r["line"] for r in parts[0]) < min(r["line"] for r in parts[1])
    assert read_jsonl(output_path) == want


def test_bad_lines_become_error_records_and_the_job_continues(llm, tmp_path):
    too_long = " ".join(["fox"] * 300)  # > max_model_len 128 tokens: the engine refuses it
    lines = [
        {"prompt": "the quick brown fox"},
        "{not json",
        {"id": "no-prompt", "max_tokens": 3},
        {"prompt": "Paris is", "temperature": -1},
        "",  # blank lines are skipped, not answered
        {"prompt": "Paris is", "max_tokenz": 3},
        "[1, 2, 3]",
        {"prompt": too_long},
        {"prompt": "hello", "messages": [{"role": "user", "content": "hi"}]},
        {"prompt": [1, -5]},
        {"messages": [{"role": "user", "content": "the lazy dog"}], "id": 7},
        {"messages": [{"role": "user", "content": None}]},  # the template's TypeError once ended the job
    ]
    input_path = write_jsonl(tmp_path / "bad.jsonl", lines)
    output_path = str(tmp_path / "bad_out.jsonl")
    assert batch_cli.run(batch_args(input_path, output_path), llm=llm) == 0
    out = read_jsonl(output_path)
    assert [r["line"] for r in out] == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    by_line = {r["line"]: r for r in out}
    assert "text" in by_line[1] and "error" not in by_line[1]
    assert "text" in by_line[11] and by_line[11]["id"] == "7"
    expected_errors = {2: "not valid JSON", 3: "exactly one of 'prompt'", 4: "temperature", 6: "max_tokenz",
                       7: "not an object", 8: "context", 9: "exactly one of", 10: "token ids", 12: "chat template"}
    for line, fragment in expected_errors.items():
        assert f"line {line}" in by_line[line]["error"], by_line[line]
        assert fragment in by_line[line]["error"], by_line[line]
    assert by_line[3]["id"] == "no-prompt"


def test_job_arguments_are_checked(tmp_path):
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="--process-id"):
        batch_cli.run(batch_args(input_path, str(tmp_path / "o.jsonl"), "--num-processes", "2", "--process-id", "2"))
    with pytest.raises(ValueError, match="--coordinator-address"):
        batch_cli.run(batch_args(input_path, str(tmp_path / "o.jsonl"), "--num-processes", "2"))
    with pytest.raises(ValueError, match="top_p"):
        batch_cli.run(batch_args(input_path, str(tmp_path / "o.jsonl"), "--top-p", "0"))
    with pytest.raises(ValueError, match="does not exist"):
        batch_cli.run(batch_args(str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")))


def test_batch_takes_every_engine_option_of_generate_and_serve(tmp_path, monkeypatch):
    """`jlight batch` shares generate/serve's engine options (jlight.engine_args.add_engine_arguments), with
    its own default sizes when none are given."""
    import jlight

    seen = {}
    monkeypatch.setattr(jlight, "LLM", lambda model, **options: seen.update(model=model, **options))
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = str(tmp_path / "o.jsonl")
    parser = argparse.ArgumentParser()
    batch_cli.add_arguments(parser)
    args = parser.parse_args([input_path, "-o", out, "--model", "m", "-tp", "2", "--page-size", "8", "--matmul-impl",
                              "reference", "--moe-impl", "dense", "--no-prefix-caching", "--kv-cache-memory-fraction", "0.5"])
    batch_cli._make_llm(args)
    assert seen == dict(model="m", dtype="auto", mesh="tp=2", page_size=8, matmul_impl="reference", moe_impl="dense",
                        enable_prefix_caching=False, kv_cache_memory_fraction=0.5, **batch_cli.BATCH_ENGINE_DEFAULTS)
    args = parser.parse_args([input_path, "-o", out, "--max-num-seqs", "4", "--max-num-batched-tokens", "32"])
    batch_cli._make_llm(args)
    assert seen["max_num_seqs"] == 4 and seen["max_num_batched_tokens"] == 32
    with pytest.raises(ValueError, match="--mesh or --tensor-parallel-size"):
        batch_cli._make_llm(parser.parse_args([input_path, "-o", out, "--mesh", "tp=2", "-tp", "2"]))


def test_records_carry_token_ids_and_the_logprobs_a_line_asks_for(tmp_path, llm):
    lines = [{"prompt": "the quick brown fox", "logprobs": 2},
             {"prompt": [11, 12, 13, 14], "prompt_logprobs": 1},
             {"prompt": "Paris is", "n": 2, "temperature": 0.8, "seed": 3, "logprobs": 0},
             {"prompt": "numbers and letters"}]
    output_path = str(tmp_path / "out.jsonl")
    assert batch_cli.run(batch_args(write_jsonl(tmp_path / "in.jsonl", lines), output_path), llm=llm) == 0
    records = read_jsonl(output_path)
    defaults = dict(max_tokens=8, temperature=0.0)
    want = [llm.generate([line["prompt"]], SamplingParams(**{**defaults, **{k: v for k, v in line.items() if k != "prompt"}}),
                         use_tqdm=False)[0] for line in lines]

    def as_json(by_token):  # the record's form of one position's {token id: logprob}
        return None if by_token is None else {str(t): lp for t, lp in by_token.items()}

    for record, ref in zip(records, want):
        for got, sample in zip(record.get("choices", [record]), ref.outputs):
            assert got["token_ids"] == sample.token_ids and got["text"] == sample.text
            if sample.logprobs is None:
                assert "logprobs" not in got and "cumulative_logprob" not in got
            else:
                # The same tokens' logprobs, to float32 rounding: the batch runs its lines together, the
                # reference each alone (other step shapes, other summation orders).
                assert [d.keys() for d in got["logprobs"]] == [as_json(d).keys() for d in sample.logprobs]
                assert [list(d.values()) for d in got["logprobs"]] == \
                    [pytest.approx(list(as_json(d).values()), abs=1e-5) for d in sample.logprobs]
                assert got["cumulative_logprob"] == pytest.approx(sum(d[t] for d, t in zip(sample.logprobs, sample.token_ids)))
    assert [len(d) for d in records[0]["logprobs"]] and all(2 <= len(d) <= 3 for d in records[0]["logprobs"])
    assert records[1]["prompt_logprobs"][0] is None and len(records[1]["prompt_logprobs"]) == 4
    assert [d and d.keys() for d in records[1]["prompt_logprobs"]] == [d and as_json(d).keys() for d in want[1].prompt_logprobs]
    assert [d and list(d.values()) for d in records[1]["prompt_logprobs"]] == \
        [d and pytest.approx(list(as_json(d).values()), abs=1e-5) for d in want[1].prompt_logprobs]
    assert len(records[2]["choices"]) == 2 and "prompt_logprobs" not in records[0]


def test_lines_can_ask_for_structured_outputs(llm, tmp_path):
    """A line's `structured_outputs` (a SamplingParams field) holds its answer to a choice or a regex; a
    constraint that does not compile is that line's error record, and the job goes on."""
    import re

    lines = [{"prompt": "the quick", "structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0.8, "seed": 1},
             {"prompt": "Paris is", "structured_outputs": {"regex": "[0-9]{3}"}, "max_tokens": 8},
             {"prompt": "lazy dog", "structured_outputs": {"regex": "[0-"}},
             {"prompt": "fox", "structured_outputs": {"choice": ["a"], "regex": "b"}}]
    input_path = write_jsonl(tmp_path / "so.jsonl", lines)
    output_path = str(tmp_path / "so_out.jsonl")
    assert batch_cli.run(batch_args(input_path, output_path), llm=llm) == 0
    by_line = {r["line"]: r for r in read_jsonl(output_path)}
    assert by_line[1]["text"] in ("yes", "no") and by_line[1]["finish_reason"] == "stop"
    assert re.fullmatch("[0-9]{3}", by_line[2]["text"]) and by_line[2]["finish_reason"] == "stop"
    assert "line 3" in by_line[3]["error"] and "structured_outputs.regex is invalid" in by_line[3]["error"]
    assert "line 4" in by_line[4]["error"] and "exactly one of" in by_line[4]["error"]
