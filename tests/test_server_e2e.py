"""`jlight serve` as a real subprocess on 127.0.0.1 with the default SmolLM2 model, driven by
the official `openai` client and raw HTTP: results equal jlight.LLM's, sampling options work,
bad input gets a 4xx naming the field, schemathesis finds no 5xx, and SIGTERM drains (the server's
other promises under abuse, a disconnect storm among them, are test_server_chaos.py's).

One server for the whole module (starting it compiles the model); the SIGTERM test stops
it, so it runs last.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import httpx
import pytest

from server_process import free_port, server_process

openai = pytest.importorskip("openai")

API_KEY = "e2e-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
BATCHED_TOKENS = 64  # steps of 1-64 tokens: five compiled buckets for the LLM and the server alike
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm():
    import jlight.api
    return jlight.api.LLM(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED_TOKENS)


@pytest.fixture(scope="module")
def server(llm):  # after llm: the server then finds the XLA compilation cache warm
    port = free_port()
    cmd = [sys.executable, "-m", "jlight.serve.cli", "--port", str(port), "--api-key", API_KEY,
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(BATCHED_TOKENS), "--shutdown-timeout", "30", "--log-level", "warning"]
    with server_process(cmd, port, os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jlight_serve_{port}.log")) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def greedy(max_tokens, **kw):
    from jlight.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_completion_equals_llm_generate(client, model_name, llm):
    expected = llm.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, len(expected.token_ids))
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_equals_llm_chat(client, model_name, llm):
    expected = llm.chat(CHAT, greedy(10), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_n_seed_stop_logprobs(client, model_name, llm):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3)
    first = client.completions.create(seed=1234, **kw)
    again = client.completions.create(seed=1234, **kw)
    assert len(first.choices) == 3 and [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]

    full = llm.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0].text
    stop_word = full.split()[1]  # stop at the second word of the greedy continuation
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop_word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop_word)]

    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(value, abs=1e-4)

    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_chat_logprob_bytes_join_to_the_text(client, model_name, llm):
    """Emoji are split over byte tokens; each token's `bytes` (not its lone text, U+FFFD)
    must concatenate to the reply."""
    text = "😀 é 🎉"
    assert b"".join(llm.tokenizer.token_bytes(t) for t in llm.tokenizer.encode(text)) == text.encode()
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Reply with 😀🎉😀🎉"}],
                                       max_tokens=6, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content  # not empty, so the prefix check below can fail
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", errors="replace").startswith(r.choices[0].message.content)


def test_batched_prompts_streaming_n2(client, model_name, llm):
    """Two prompts x n=2 in one streaming request: four choices, each ending once, with the
    greedy text of its prompt."""
    prompts = [PROMPT, "One, two, three,"]
    stream = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                       stream=True)
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    assert texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    assert set(reasons) == {0, 1, 2, 3}


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
PERSON_CHAT = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]


def _check_person(text):
    person = json.loads(text)
    assert set(person) == {"name", "age"}, person
    assert isinstance(person["name"], str) and len(person["name"]) <= 20, person
    assert type(person["age"]) is int and 0 <= person["age"] <= 150, person


def test_structured_outputs(client, model_name):
    """The output follows each kind of constraint, as the openai client sends them (response_format)
    and as vLLM's clients do (guided_* and structured_outputs in extra_body)."""
    kw = dict(model=model_name, temperature=0, max_tokens=40)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(messages=PERSON_CHAT, response_format=fmt, **kw)
    assert r.choices[0].finish_reason == "stop"
    _check_person(r.choices[0].message.content)

    r = client.chat.completions.create(messages=PERSON_CHAT, response_format={"type": "json_object"}, **kw)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)

    colours = ["red", "green", "blue"]
    r = client.chat.completions.create(messages=CHAT, extra_body={"guided_choice": colours}, **kw)
    assert r.choices[0].message.content in colours

    phone = r"\d{3}-\d{4}"
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Give me a phone number."}],
                                       extra_body={"guided_regex": phone}, **kw)
    assert re.fullmatch(phone, r.choices[0].message.content), r.choices[0].message.content

    # vLLM's newer object, and response_format on /v1/completions (vLLM takes it there too).
    r = client.completions.create(prompt=PROMPT, extra_body={"structured_outputs": {"regex": r" [A-Z][a-z]+\."}}, **kw)
    assert re.fullmatch(r" [A-Z][a-z]+\.", r.choices[0].text), r.choices[0].text
    r = client.completions.create(prompt="A person as JSON: ", extra_body={"response_format": fmt}, **kw)
    _check_person(r.choices[0].text)


def test_structured_outputs_stream_and_n2(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(model=model_name, messages=PERSON_CHAT, response_format=fmt, temperature=0,
                                            max_tokens=40, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    _check_person("".join(c.choices[0].delta.content or "" for c in chunks))

    answers = ["yes", "no", "maybe"]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       n=2, temperature=1.0, seed=1, max_tokens=8, extra_body={"guided_choice": answers})
    assert len(r.choices) == 2 and all(c.message.content in answers for c in r.choices), r.choices


STRUCTURED_BAD = [
    # (path, body, param, words in the message): the engine compiles the grammar (llguidance) and refuses it
    ("/v1/chat/completions", {"guided_regex": "[a-"}, "guided_regex", "guided_regex is invalid"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
     "structured_outputs.regex is invalid"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", "bogus"),
    ("/v1/completions", {"guided_json": {"type": "bogus"}, "stream": True}, "guided_json", "guided_json is invalid"),
    ("/v1/completions", {"guided_grammar": "start: (", "n": 2}, "guided_grammar", "guided_grammar is invalid"),
    # ...or the server does, before the engine sees the request
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "response_format and guided_regex"),
    # tools with tool_choice "auto" (the default) on a server started without --enable-auto-tool-choice
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "not supported"),
]


@pytest.mark.parametrize("path,body,param,words", STRUCTURED_BAD)
def test_bad_structured_outputs_real_model(server, path, body, param, words):
    url, _ = server
    base = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    r = httpx.post(url + path, json={**base, "max_tokens": 4, **body}, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_bad_structured_outputs_openai_client(client, model_name):
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, extra_body={"guided_regex": "[a-"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    # Bounded lengths keep the call within the tests' few tokens.
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
WEATHER_CHAT = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _valid_arguments(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "days"} and isinstance(args["city"], str) and type(args["days"]) is int
    return name == "get_time" and set(args) == {"zone"} and isinstance(args["zone"], str)


def test_named_tool_call(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice=NAMED_WEATHER, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "get_weather" and _valid_arguments("get_weather", call.function.arguments), call


def test_required_tool_calls(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert _valid_arguments(call.function.name, call.function.arguments), call


def test_streamed_named_tool_call(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER_TOOL],
                                            tool_choice=NAMED_WEATHER, max_tokens=60, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert _valid_arguments("get_weather", "".join(call.function.arguments or "" for call in calls))
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": NAMED_WEATHER, "extra_body": {"guided_regex": "a+"}}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"functions": [WEATHER_TOOL["function"]]}, "functions"),
])
def test_bad_tool_requests_openai_client(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, max_tokens=4, **fields)
    assert raised.value.body["param"] == param, raised.value.body


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own model of the GGUF the server runs (float32, as jlight on the CPU): the
    reference for the echoed prompt logprobs."""
    pytest.importorskip("torch")
    from direct_forward import transformers_from_gguf

    from jlight.loading.default_model import default_gguf_path
    return transformers_from_gguf(default_gguf_path())[1]


def _hf_logprobs(hf_model, ids):
    import torch
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def _check_echo(choice, ids, prompt_text, tok, ref):
    """One echoed choice: the prompt's text then the generated token's; one logprob entry per
    token, each transformers' (None for the first token), offsets that point into the text."""
    lp = choice.logprobs
    generated = ids + [tok.encode(lp.tokens[-1], add_special_tokens=False)[0]]
    assert choice.text.startswith(prompt_text) and len(lp.tokens) == len(generated)
    assert lp.tokens[:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(generated)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, generated[i]], abs=1e-3), i
        (top_text, top_value), = lp.top_logprobs[i].items()
        assert top_value == pytest.approx(ref[i - 1].max(), abs=1e-3)
        assert top_text == tok.decode([int(ref[i - 1].argmax())], skip_special_tokens=False)
    assert int(ref[len(ids) - 1].argmax()) == generated[-1]  # temperature 0
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset:offset + len(token)] == token


def test_echo_logprobs_match_transformers(client, model_name, llm, hf_model):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, max_tokens=1, temperature=0):
    a batch of token-id prompts with n=2, and a text prompt. Asked twice, the second time with the
    prompts' pages in the prefix cache: the engine must compute their logprobs all the same."""
    tok = llm.tokenizer
    text_prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    token_lists = [tok.encode("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"),
                   tok.encode(text_prompt)]
    assert min(len(ids) for ids in token_lists) > 16  # a full page or more, so the prefix cache holds some
    refs = [None, None]
    for _ in range(2):
        r = client.completions.create(model=model_name, prompt=token_lists, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0, n=2)
        assert len(r.choices) == 4
        for choice in r.choices:
            ids = token_lists[choice.index // 2]
            if refs[choice.index // 2] is None:
                refs[choice.index // 2] = _hf_logprobs(hf_model, ids + [tok.encode(choice.logprobs.tokens[-1],
                                                                                    add_special_tokens=False)[0]])
            _check_echo(choice, ids, tok.decode(ids, skip_special_tokens=False), tok, refs[choice.index // 2])
        r_text = client.completions.create(model=model_name, prompt=text_prompt, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
        _check_echo(r_text.choices[0], token_lists[1], text_prompt, tok, refs[1])

    # max_tokens=0 scores the prompt alone; a stream carries the prompt in its first chunk.
    r = client.completions.create(model=model_name, prompt=text_prompt, echo=True, logprobs=0, max_tokens=0)
    ids, lp = token_lists[1], r.choices[0].logprobs
    assert r.choices[0].text == text_prompt and len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([refs[1][i - 1, ids[i]] for i in range(1, len(ids))], abs=1e-3)
    stream = client.completions.create(model=model_name, prompt=text_prompt, echo=True, max_tokens=3, temperature=0,
                                       stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    expected = llm.generate(text_prompt, greedy(3), use_tqdm=False)[0].outputs[0].text
    assert texts[0].startswith(text_prompt) and "".join(texts) == text_prompt + expected


REAL_BAD_INPUTS = [
    ("/v1/completions", {"prompt": "hi " * 400, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 6000}, 400, "prompt"),  # tokenized off the event loop
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10**4}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", REAL_BAD_INPUTS)
def test_bad_input_real_model(server, path, body, status, param):
    url, _ = server
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_auth(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_schemathesis_finds_no_server_errors(server):
    """Schema-driven requests (valid and invalid) to every operation; none may get a 5xx.
    Generated generation requests are capped at 4 tokens and n <= 2 to bound CPU time."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    url, _ = server
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)
    failures = []
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"):
        operation = schema[path]["GET" if path == "/v1/models" else "POST"]

        @settings(max_examples=int(os.environ.get("JLIGHT_SCHEMATHESIS_EXAMPLES", 15)), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 4)
                if isinstance(case.body.get("max_completion_tokens"), int):
                    case.body["max_completion_tokens"] = min(case.body["max_completion_tokens"], 4)
                case.body.setdefault("max_tokens", 4)
                if isinstance(case.body.get("n"), int):
                    case.body["n"] = min(case.body["n"], 2)
            response = case.call(base_url=url, headers=AUTH, timeout=120)
            if response.status_code >= 500:
                failures.append((path, case.body, response.status_code, response.text[:300]))
        check()
    assert not failures, failures[:3]
    # ...and the engine survived all of it.
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_sigterm_drains_in_flight_requests(server):
    """Runs last: stops the module's server."""
    url, proc = server
    # As long as the context allows: the request stays in flight well past the moment the server turns to draining
    # (the server exits, as it should, once its last request is done).
    body = {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
                    # Draining: out of rotation, new requests answered (not refused) with 503 + Retry-After.
                    deadline = time.monotonic() + 10
                    health = httpx.get(url + "/health", timeout=2)
                    while health.status_code == 200 and time.monotonic() < deadline:
                        time.sleep(0.02)  # the signal not handled yet
                        health = httpx.get(url + "/health", timeout=2)
                    assert (health.status_code, health.text) == (503, "draining")
                    late = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=AUTH,
                                      timeout=10)
                    assert late.status_code == 503 and late.headers["Retry-After"] == "1", late.text
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
