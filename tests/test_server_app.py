"""The server's HTTP behaviour against a scripted stand-in engine (no model, fast):
error bodies, backpressure, disconnect aborts, auth, body limits, metrics text.

The real-model tests are in test_server_e2e.py; this file checks what does not need
model numerics, so it can test timing-dependent paths (a stuck queue, a disconnect
mid-stream) deterministically.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from jlight.engine.llm_engine import EngineStats
from jlight.engine.outputs import CompletionOutput, RequestOutput
from jlight.core.errors import EngineOverloadedError
from jlight.serve.metrics import parse_metrics
from jlight.serve.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from server_process import serve_in_thread

API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 is EOS."""
    vocab_size = 256
    eos_token_ids = (0,)

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i or not skip_special_tokens).decode("utf-8", errors="replace")

    def token_bytes(self, token_id):
        return bytes([token_id])

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        """Like a tool-aware template: the tools' names first, then each message with its tool fields."""
        tools = "".join(f"<tool {t['function']['name']}>" for t in kwargs.pop("tools", []))
        assert not kwargs, kwargs
        def fields(m):
            calls = "".join(f"<call {c['id']} {c['function']['name']} {c['function']['arguments']}>"
                            for c in m.get("tool_calls", []))
            return calls + (f"<answers {m['tool_call_id']}>" if "tool_call_id" in m else "")
        return tools + "".join(f"<{m['role']}>{fields(m)}{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else "")


def FakeStats(**counts) -> EngineStats:
    """The engine's stats: every counter 0 (100 pages) unless given."""
    fields = dict(num_running=0, num_waiting=0, num_pages_total=100, num_pages_used=0, prefix_cache_query_tokens=0,
                  prefix_cache_hit_tokens=0, num_preemptions=0, prompt_tokens_total=0, generation_tokens_total=0, num_steps=0)
    return EngineStats(**{**fields, **counts})


class FakeAsyncLLM:
    """Generates 'x' tokens every `token_delay` s; each running request holds one KV page.
    `gate` (an asyncio.Event-like flag) holds every request before its first token."""

    def __init__(self, token_delay=0.01, max_waiting=1000, max_model_len=64):
        self.tokenizer = ByteTokenizer()
        self.model_config = type("Cfg", (), {"vocab_size": 256})()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.token_delay, self.max_waiting = token_delay, max_waiting
        self.active: set[str] = set()
        self.aborted: set[str] = set()  # requests that ended before their last token
        self.hold_first_token = False
        self.error = None  # AsyncLLM.error: why the engine loop stopped
        self.last_params = None  # the SamplingParams of the latest request
        self.last_prompt = None  # the latest request's prompt, as text
        # Text every sample of a constrained request generates (one token a byte), as a model held to
        # the constraint would; None: constrained requests get 'x's like the rest.
        self.scripted_text = None
        self.free_text = None  # the same for requests without a constraint (a model choosing to call tools)
        self.tokens_out = 0  # output steps yielded: the stats count each as a verify of 2 drafts, 1 kept

    async def generate(self, prompt, sampling_params, request_id):
        self.last_params = sampling_params
        self.last_prompt = bytes(prompt).decode("utf-8", errors="replace")
        constraint = sampling_params.structured_outputs
        if constraint is not None and "INVALID" in str(getattr(constraint, constraint.kind())):
            # As the engine's validate_request says when llguidance refuses a grammar.
            raise ValueError(f"structured_outputs.{constraint.kind()} is invalid: fake compile error")
        if len(self.active) >= self.max_waiting:
            raise EngineOverloadedError("queue full")
        self.active.add(request_id)
        try:
            while self.hold_first_token and request_id in self.active:
                await asyncio.sleep(0.01)
            n, total = sampling_params.n, sampling_params.max_tokens
            script_text = self.scripted_text if constraint is not None else self.free_text
            if script_text is not None:
                script = list(script_text.encode("utf-8"))
                samples = [script[:total]] * n
                reasons = ["stop" if len(script) <= total else "length"] * n
            else:
                # Sample i stops ("stop") i tokens early; like the engine, a finished sample is
                # repeated, unchanged, in the outputs that follow while its siblings run on.
                samples = [[120] * max(1, total - i) for i in range(n)]
                reasons = ["length" if len(tokens) == total else "stop" for tokens in samples]
            steps = max(len(tokens) for tokens in samples)
            for step in range(1, steps + 1):
                await asyncio.sleep(self.token_delay)
                if request_id not in self.active:
                    return
                done = step == steps
                self.tokens_out += 1
                if done:
                    self.active.discard(request_id)
                outs = []
                for i, (tokens, reason) in enumerate(zip(samples, reasons)):
                    # As AsyncLLM's stream outputs: each carries its new token only (output_kind "delta").
                    k = min(step, len(tokens))
                    fresh = step <= len(tokens)
                    new = tokens[k - 1:k] if fresh else []
                    text = bytes(new).decode("utf-8", errors="replace")
                    outs.append(CompletionOutput(
                        index=i, text=text, token_ids=list(new), finish_reason=None if k < len(tokens) else reason,
                        text_delta=text, token_ids_delta=list(new),
                        logprobs=[{120: -0.5, 121: -1.5}] * int(fresh) if sampling_params.logprobs is not None else None))
                yield RequestOutput(request_id, None, list(prompt), outs, finished=done,
                                    prompt_logprobs=self.prompt_logprobs(prompt, sampling_params))
        finally:  # closing the generator early aborts, as AsyncLLM's does
            self.abort(request_id)

    @staticmethod
    def prompt_logprobs(prompt, params):
        """Like the engine's: None for the first prompt token, then each token's logprob and
        'x' (id 120) as the runner-up."""
        if params.prompt_logprobs is None:
            return None
        return [None] + [{t: -0.25, 120: -3.0} for t in prompt[1:]]

    def abort(self, request_id):
        if request_id in self.active:
            self.aborted.add(request_id)
            self.active.discard(request_id)

    def stats(self):
        return FakeStats(num_running=len(self.active), num_pages_used=len(self.active), spec_num_drafts=self.tokens_out,
                         spec_num_draft_tokens=2 * self.tokens_out, spec_num_accepted_tokens=self.tokens_out)

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def server():
    yield from _serve(FakeAsyncLLM())


def _serve(llm, **app_options):
    """Serve `llm` on a free port in a thread; yields (url, llm) until the fixture ends."""
    from jlight.serve.app import build_app
    app = build_app(llm, api_key=API_KEY, max_waiting_requests=8, max_body_bytes=4096, **app_options)
    llm.app = app  # tests reach the app's state (its drain) through the stand-in
    with serve_in_thread(app) as url:
        yield url, llm


def post(url, path, body=None, content=None, headers=HEADERS, **kw):
    return httpx.post(url + path, json=body, content=content, headers=headers, timeout=20, **kw)


def test_sampling_params_mapping():
    req = CompletionRequest(prompt="hi", n=2, temperature=0.5, top_p=0.9, stop="END", seed=3,
                            presence_penalty=0.1, frequency_penalty=0.2, logprobs=2, logit_bias={"5": 1.0},
                            top_k=7, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=2)
    p = to_sampling_params(req, max_tokens=10)
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (2, 10, 0.5, 0.9, ["END"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.logit_bias) == (0.1, 0.2, 2, {5: 1.0})
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (7, 0.05, 1.1, True, 2)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3,
                                 temperature=None)
    p = to_sampling_params(chat, max_tokens=4)
    assert (p.logprobs, p.temperature) == (3, 1.0)
    assert to_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), 4).logprobs is None


def test_completion_and_chat_shapes(server):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("xxx", "length"), ("xx", "stop")] * 2
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] * 3
    assert body["choices"][0]["logprobs"]["top_logprobs"][0] == {"x": -0.5}
    r = post(url, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]  # each choice finishes exactly once
    texts = {}
    for c in chunks:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "xxx", 1: "xx", 2: "xxx", 3: "xx"}
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                           "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:-1]) == "xx"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    prompt_len = len("<user>hi<assistant>")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == prompt_len


def test_chat_logprob_bytes_rebuild_split_characters():
    """A character split over tokens ("é" is two byte tokens here) shows as U+FFFD in each
    token's text; its `bytes` must be the token's own bytes, which concatenate to the text."""
    from jlight.serve.responses import ResponseBuilder
    text = "é!"
    ids = list(text.encode())  # [195, 169, 33]
    logprobs = [{t: -0.1, 33: -2.0} for t in ids]
    out = RequestOutput("r", None, [1], [CompletionOutput(index=0, text=text, token_ids=ids, finish_reason="length",
                                                          logprobs=logprobs)], finished=True)
    builder = ResponseBuilder("chat", "chatcmpl-1", "m", ByteTokenizer(), 1, want_logprobs=True, num_top_logprobs=2)
    content = builder.full_response([out])["choices"][0]["logprobs"]["content"]
    assert [t["bytes"] for t in content] == [[195], [169], [33]]
    assert bytes(b for t in content for b in t["bytes"]).decode() == text
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[195], [33]]


BAD_INPUTS = [
    # (path, body or raw bytes, expected status, expected param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate escape
    ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "a" * 64}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 64}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, 400, "temperature"),  # a string is not a number
    ("/v1/completions", {"prompt": "a", "top_p": True}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": "1"}, 400,
     "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": "1"}}, 400, "logit_bias.5"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": ["a"] * 5, "n": 64, "max_tokens": 1}, 400, "n"),  # 320 sequences
    ("/v1/completions", {"prompt": "a", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/detokenize", {"tokens": [1000]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


UNION_INPUTS = [
    # Fields that take several shapes: the message lists the shapes, not the first one's complaint
    # ("Input should be a valid string" for a list of token ids with a negative one).
    ("/v1/completions", {"prompt": [-1]}, "prompt", "token ids"),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt", "token ids"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, "stop", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content", "text"),
]


@pytest.mark.parametrize("path,body,param,words", UNION_INPUTS)
def test_union_field_error_says_what_is_accepted(server, path, body, param, words):
    url, _ = server
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "valid string" not in error["message"], error


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_input(server, path, body, status, param):
    url, _ = server
    if isinstance(body, bytes):
        r = post(url, path, content=body, headers={**HEADERS, "Content-Type": "application/json"})
    else:
        r = post(url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"]


def test_integers_are_numbers(server):
    """Strict number fields still take JSON integers (temperature=1), as OpenAI does."""
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1, "temperature": 1, "top_p": 1,
                                      "presence_penalty": 0, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text


def test_null_means_default(server):
    """OpenAI's schema lets clients send null for an unset optional field (n, stream, echo,
    logprobs, ...); the server then uses the default rather than answering 400."""
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": None, "stream": None, "echo": None,
                                      "best_of": None, "suffix": None, "stream_options": None, "logprobs": None,
                                      "min_tokens": None, "ignore_eos": None})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["xx"]
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": None}], "max_tokens": 2,
                                           "n": None, "stream": None, "logprobs": None, "top_logprobs": None,
                                           "max_completion_tokens": None, "stream_options": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "max_tokens": 2, "stream": True,
                                           "stream_options": {"include_usage": None}})  # a null inside, too
    assert r.status_code == 200 and '"usage"' not in r.text, r.text


CHAT_X = [{"role": "user", "content": "x"}]
UNSUPPORTED = [
    # Features jlight lacks: a 400 naming the field, never an answer that ignores it.
    # tools with tool_choice "auto" (the default) on a server started without a tool-call parser
    ("/v1/chat/completions", {"messages": CHAT_X, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT_X, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT_X, "function_call": {"name": "f"}}, "function_call"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED)
def test_unsupported_feature_is_a_clear_400(server, path, body, param):
    url, _ = server
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "not supported" in error["message"] and param in error["message"], error


def test_unsupported_features_left_unused_pass(server):
    """Values that ask for nothing (no tools, plain text) are what many clients always send."""
    url, _ = server
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "max_tokens": 1, "tools": [], "tool_choice": "none",
                                           "response_format": {"type": "text"}, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1, "echo": False, "suffix": ""})
    assert r.status_code == 200, r.text


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
STRUCTURED = [
    # (request fields, the StructuredOutputParams fields they mean)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
    ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"structured_outputs": {"json_object": True, "regex": None}}, {"json_object": True}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    # text asks for nothing, so it goes with another constraint
    ({"response_format": {"type": "text"}, "guided_regex": "x"}, {"regex": "x"}),
]


@pytest.mark.parametrize("fields,expected", STRUCTURED)
def test_structured_outputs_reach_the_engine(server, fields, expected):
    """Each way OpenAI and vLLM clients ask for structured output becomes the engine's
    structured_outputs, on both endpoints, streaming and n > 1 included."""
    from jlight.engine.structured_output import StructuredOutputParams
    url, llm = server
    want = StructuredOutputParams(**expected)
    for path, body in (("/v1/chat/completions", {"messages": CHAT_X}), ("/v1/completions", {"prompt": "a"})):
        r = post(url, path, {**body, **fields, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert llm.last_params.structured_outputs == want
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, **fields, "max_tokens": 2, "n": 2, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    assert llm.last_params.structured_outputs == want and llm.last_params.n == 2


def test_no_structured_output_by_default():
    assert to_sampling_params(CompletionRequest(prompt="a"), 4).structured_outputs is None
    chat = ChatCompletionRequest(messages=CHAT_X, response_format={"type": "text"})
    assert to_sampling_params(chat, 4).structured_outputs is None


STRUCTURED_BAD = [
    # (path, body, param, words in the message)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format", "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": None}}},
     "response_format", "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"json_schema": {"schema": SCHEMA}}}, "response_format.type", ""),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema.schema", ""),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "JSON"),
    ("/v1/completions", {"guided_json": 5}, "guided_json", "JSON schema"),
    ("/v1/completions", {"guided_regex": ""}, "guided_regex", ""),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_grammar": 3}, "guided_grammar", ""),
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"json": "[1,"}}, "structured_outputs.json", "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", ""),
    ("/v1/completions", {"structured_outputs": ["regex", "a"]}, "structured_outputs", ""),
    # Two constraints at once: which one would win is a guess, so neither does.
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format and guided_regex"),
    ("/v1/completions", {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "guided_choice and structured_outputs"),
    # The engine refuses the grammar (the fake one does for "INVALID"): its field, as the request named it.
    ("/v1/completions", {"guided_regex": "INVALID"}, "guided_regex", "guided_regex is invalid"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "INVALID"}}, "structured_outputs.regex",
     "structured_outputs.regex is invalid"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": "INVALID"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is invalid"),
    ("/v1/completions", {"guided_json": {"x": "INVALID"}, "stream": True}, "guided_json", "guided_json is invalid"),
    ("/v1/completions", {"prompt": ["a", "b"], "guided_choice": ["INVALID"], "n": 2}, "guided_choice",
     "guided_choice is invalid"),
]


@pytest.mark.parametrize("path,body,param,words", STRUCTURED_BAD)
def test_bad_structured_outputs_are_a_400_naming_the_field(server, path, body, param, words):
    url, _ = server
    base = {"messages": CHAT_X} if path == "/v1/chat/completions" else {"prompt": "a"}
    r = post(url, path, {**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def _check_offsets(choice):
    """Each token's text_offset is where its text starts in the choice's text (one byte
    token per character here)."""
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token


def test_echo_returns_the_prompt_and_its_logprobs(server):
    """lm-evaluation-harness's request: echo, logprobs=1, batched prompts (text and token ids), n=2.
    Each choice is the prompt then the completion; the prompt's first token has no logprob."""
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True,
                                      "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "abxxx"), (1, "abxx"), (2, "cdxxx"), (3, "cdxx")]
    lp = body["choices"][2]["logprobs"]
    assert lp["tokens"] == ["c", "d", "x", "x", "x"]
    assert lp["token_logprobs"] == [None, -0.25, -0.5, -0.5, -0.5]
    assert lp["top_logprobs"] == [None, {"d": -0.25}, {"x": -0.5}, {"x": -0.5}, {"x": -0.5}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    for choice in body["choices"]:
        _check_offsets(choice)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}

    # Token ids echo as their text; without logprobs there are none to report.
    r = post(url, "/v1/completions", {"prompt": [[104, 105], [33]], "max_tokens": 2, "echo": True})
    assert [(c["text"], c["logprobs"]) for c in r.json()["choices"]] == [("hixx", None), ("!xx", None)]


def test_echo_with_max_tokens_0_scores_the_prompt_only(server):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 0, "logprobs": 0, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("abc", "length")
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -0.25]
    assert choice["logprobs"]["top_logprobs"] == [None, None, None]  # logprobs=0: no alternatives
    assert r.json()["usage"]["completion_tokens"] == 0
    r = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 0, "echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("abc", "length")]
    r = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 0})  # without echo it asks for nothing
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_echo_streams_the_prompt_in_the_first_chunk(server):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "logprobs": 1, "echo": True,
                                      "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    merged = {}
    for c in chunks:
        m = merged.setdefault(c["index"], {"text": "", "logprobs": {k: [] for k in c["logprobs"]}})
        if not m["text"]:  # a choice's first chunk holds its prompt and its first token
            assert c["text"][:2] in ("ab", "cd") and c["logprobs"]["token_logprobs"][0] is None
        m["text"] += c["text"]
        for k, v in c["logprobs"].items():
            m["logprobs"][k] += v
    assert {i: m["text"] for i, m in merged.items()} == {0: "abxxx", 1: "abxx", 2: "cdxxx", 3: "cdxx"}
    for choice in merged.values():
        _check_offsets(choice)


def test_prompt_offsets_skip_an_added_bos_and_count_split_characters_once():
    from jlight.serve.echo import prompt_offsets

    class WithBos(ByteTokenizer):
        all_special_ids = [1]

    ids = [1] + list("é!".encode())  # a BOS the text does not hold, then "é" as two byte tokens
    assert prompt_offsets(WithBos(), ids, "é!") == [0, 0, 0, 1]
    assert prompt_offsets(WithBos(), ids, "\x01é!") == [0, 1, 1, 2]  # the BOS's text sent as part of the prompt

SIZE_BUDGET = [
    # (path, body, param, words): refused before any per-item work (the stand-in's context is 64 tokens,
    # no token longer than one byte, +1 for a SentencePiece space: 63 * 2 = 126 bytes of text)
    ("/v1/completions", {"prompt": "a" * 127}, "prompt", "127 characters"),
    ("/v1/completions", {"prompt": "é" * 64}, "prompt", "128 bytes"),  # 64 characters, but 2 bytes each
    ("/v1/completions", {"prompt": ["ok", "a" * 200]}, "prompt", "200 characters"),
    ("/v1/completions", {"prompt": [5] * 64}, "prompt", "64 token ids"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt", "batch of 65 prompts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 130}]}, "messages", "characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}] * 64}, "messages", "64 messages"),
    ("/detokenize", {"tokens": [5] * 65}, "tokens", "65 token ids"),
]


@pytest.mark.parametrize("path,body,param,words", SIZE_BUDGET)
def test_size_budget_refuses_before_tokenizing(server, monkeypatch, path, body, param, words):
    url, tokenized = server[0], []
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text, add_special_tokens=True: tokenized.append(text))
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert not tokenized
    post(url, "/v1/completions", {"prompt": "a" * 120, "max_tokens": 1})
    assert tokenized == ["a" * 120]  # within the budget: tokenized


def test_openapi_shows_the_request_bodies(server):
    """The POST routes parse their own bodies off the event loop; the schema still shows them."""
    schema = httpx.get(server[0] + "/openapi.json", headers=HEADERS).json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "ChatMessage" in schema["components"]["schemas"]  # nested models come along


def test_draining_server_answers_503():
    """While draining, the listener stays open: /health says so, new requests get 503 + Retry-After;
    /metrics still answers."""
    for url, llm in _serve(FakeAsyncLLM()):
        assert httpx.get(url + "/health").status_code == 200
        drain = llm.app.state.drain
        drain.begin_threadsafe()
        deadline = time.time() + 5
        while not drain.draining and time.time() < deadline:
            time.sleep(0.01)
        health = httpx.get(url + "/health")
        assert (health.status_code, health.text) == (503, "draining")
        r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "draining"
        assert httpx.get(url + "/metrics", headers=HEADERS).status_code == 200


def test_body_size_limit(server):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": "a" * 5000})
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]


def test_auth(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + path, headers=HEADERS).status_code == 200
    r = post(url, "/v1/completions", {"prompt": "a"}, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The scheme is case-insensitive (RFC 9110 11.1); the key is not.
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY.upper()}"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401


def test_health_reports_a_dead_engine(server):
    """Once the engine loop has stopped, every request fails: /health must say so, so that a
    load balancer stops sending traffic here."""
    url, llm = server
    llm.error = RuntimeError("device lost")
    try:
        r = httpx.get(url + "/health")
    finally:
        llm.error = None
    assert r.status_code == 503 and "device lost" in r.text, r.text
    assert httpx.get(url + "/health").status_code == 200


def test_backpressure_answers_503_with_retry_after(server):
    url, llm = server
    llm.hold_first_token = True  # nothing leaves the queue: 8 requests fill max_waiting_requests=8

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=20) as client:
            held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
                    for _ in range(8)]
            while len(llm.active) < 8:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            llm.hold_first_token = False
            return refused, await asyncio.gather(*held)
    try:
        refused, held = asyncio.run(scenario())
    finally:
        llm.hold_first_token = False
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert [r.status_code for r in held] == [200] * 8


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_request(server, stream):
    url, llm = server
    before = len(llm.aborted)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=20) as client:
            body = {"prompt": "a", "max_tokens": 60, "stream": stream}
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break  # leave after the first event; 60 tokens would take 0.6 s
            else:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                await asyncio.sleep(0.15)
                task.cancel()
    asyncio.run(scenario())
    deadline = time.time() + 5
    while len(llm.aborted) == before and time.time() < deadline:
        time.sleep(0.02)
    assert len(llm.aborted) == before + 1 and not llm.active
    text = httpx.get(url + "/metrics", headers=HEADERS).text
    assert parse_metrics(text)['jlight:request_total{outcome="client_disconnect"}'] >= 1


def test_metrics_text(server):
    url, _ = server
    post(url, "/v1/completions", {"prompt": "ab", "max_tokens": 2})
    values = parse_metrics(httpx.get(url + "/metrics", headers=HEADERS).text)
    assert values["jlight:time_to_first_token_seconds_count"] >= 1
    assert values['jlight:e2e_request_latency_seconds_bucket{le="+Inf"}'] == values["jlight:e2e_request_latency_seconds_count"]
    assert values['jlight:request_total{outcome="length"}'] >= 1
    assert values["jlight:kv_cache_pages_used"] == 0 and values["jlight:kv_cache_pages_total"] == 100
    assert values["jlight:python_allocated_blocks"] > 10_000  # the interpreter's own objects at least


def test_default_model_is_served_by_its_name():
    """`jlight serve` with no model serves SmolLM2 from a cache file; clients name it
    "SmolLM2-135M-Instruct", not the server's cache path."""
    from jlight.serve import cli
    assert cli.served_model_names(cli.build_parser().parse_args([])) == ["SmolLM2-135M-Instruct"]
    assert cli.served_model_names(cli.build_parser().parse_args(["m.gguf"])) is None  # the engine's name: the path given
    args = cli.build_parser().parse_args(["--served-model-name", "a", "--served-model-name", "b"])
    assert cli.served_model_names(args) == ["a", "b"]


def test_auto_tool_choice_flags_go_together():
    from jlight.serve import cli
    parse = cli.build_parser().parse_args
    assert cli.tool_call_parser(parse([])) is None
    assert cli.tool_call_parser(parse(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])) == "hermes"
    for one in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(ValueError, match="go together"):
            cli.tool_call_parser(parse(one))
    with pytest.raises(SystemExit):  # argparse names the choices
        parse(["--tool-call-parser", "pythonic"])


def test_tokenize_roundtrip(server):
    url, _ = server
    ids = post(url, "/tokenize", {"prompt": "héllo"}).json()["tokens"]
    assert ids == list("héllo".encode())
    assert post(url, "/detokenize", {"tokens": ids}).json()["prompt"] == "héllo"


def test_serving_benchmark_client(server, tmp_path):
    """The benchmark client against the stand-in engine, whose timing is known: every
    token takes >= 10 ms, so TPOT and ITL must come out on that scale."""
    from jlight.serve import bench_cli
    url, _ = server
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"hello there {i}"},
                                                       {"from": "gpt", "value": "general kenobi"}]}
                                    for i in range(4)]))
    common = ["--base-url", url, "--api-key", API_KEY, "--num-prompts", "4", "--warmup-requests", "1"]
    report = bench_cli.main(common + ["--input-len", "4", "--output-len", "5", "--vocab-size", "256",
                                      "--request-rates", "50,inf", "--out", str(tmp_path / "random")])
    assert [s["request_rate"] for s in report["results"]] == [50.0, "inf"]
    for s in report["results"]:
        assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (4, 0, 20, 16)
        # Client-side gaps jitter around the 10 ms step (a late chunk shortens the next gap).
        assert 8 <= s["median_tpot_ms"] < 200 and 5 <= s["median_itl_ms"] < 200
        assert s["mean_ttft_ms"] >= 10 and s["mean_e2el_ms"] >= 50
        # The server's counters over this rate alone (the warm-up request's before it): 4 x 5 steps.
        assert s["spec_decode"] == {"num_drafts": 20, "num_draft_tokens": 40, "num_accepted_tokens": 20,
                                    "acceptance_rate": 0.5, "mean_acceptance_length": 2.0}
    assert json.loads((tmp_path / "random.json").read_text())["results"] == report["results"]
    try:
        import matplotlib  # noqa: F401  (optional: the plot is skipped without it)
        assert (tmp_path / "random.png").stat().st_size > 0
    except ImportError:
        assert not (tmp_path / "random.png").exists()
    report = bench_cli.main(common + ["--dataset", "sharegpt", "--dataset-path", str(sharegpt),
                                      "--out", str(tmp_path / "sharegpt")])
    s = report["results"][0]
    # The stand-in tokenizer has one token per byte: "general kenobi" is 14 tokens.
    assert (s["completed"], s["total_output_tokens"]) == (4, 56)


# ---- forced tool calls (serve/tool_calls.py) ------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_ID = r"call_[0-9a-f]{24}"
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # tool_calls._compact: no optional whitespace


@pytest.fixture(scope="module")
def tool_server():
    """Byte tokens make tool prompts long: this stand-in has room for them."""
    yield from _serve(FakeAsyncLLM(max_model_len=1024))


@pytest.fixture
def scripted(tool_server):
    """The stand-in engine's constrained output, for one test."""
    _, llm = tool_server
    def set_text(text):
        llm.scripted_text = text
    yield set_text
    llm.scripted_text = None


def test_named_tool_choice_returns_the_call(tool_server, scripted):
    import re

    from jlight.engine.structured_output import StructuredOutputParams
    url, llm = tool_server
    scripted('{"city": "Paris"}')
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": NAMED, "n": 2,
                                           "max_tokens": 30})
    assert r.status_code == 200, r.text
    assert llm.last_params.structured_outputs == StructuredOutputParams(json={**WEATHER, **COMPACT})
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:  # OpenAI's finish_reason for a named tool_choice (see tool_calls.choice_fields)
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert re.fullmatch(CALL_ID, call["id"]) and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choices[0]["message"]["tool_calls"][0]["id"] != choices[1]["message"]["tool_calls"][0]["id"]
    # A function without parameters takes an empty object.
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 30,
                                           "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert r.status_code == 200, r.text
    assert llm.last_params.structured_outputs == StructuredOutputParams(
        json={"type": "object", "properties": {}, **COMPACT})


def test_tools_and_tool_messages_reach_the_template(tool_server):
    url, llm = tool_server
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = post(url, "/v1/chat/completions", {"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    # tool_choice "none": plain text, nothing constrains it, and the template still sees the tools.
    assert r.json()["choices"][0]["message"]["content"] == "xx" and llm.last_params.structured_outputs is None
    # The arguments reach the template as a dict (what HF templates expect), rendered here by Python's str().
    assert llm.last_prompt == ("<tool get_weather><tool get_time><user>weather?"
                               "<assistant><call call_1 get_weather {'city': 'Oslo'}><tool><answers call_1>rain"
                               "<assistant>")


def test_required_returns_each_call(tool_server, scripted):
    url, llm = tool_server
    calls = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}, {"name": "get_time", "parameters": {}}]'
    scripted(calls)
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "required",
                                           "max_tokens": 200})
    assert r.status_code == 200, r.text
    schema = llm.last_params.structured_outputs.json
    assert (schema["type"], schema["minItems"], "maxItems" in schema) == ("array", 1, False)
    assert schema["x-guidance"] == COMPACT["x-guidance"]
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"type": "string", "enum": ["get_weather"]},
                                                           {"type": "string", "enum": ["get_time"]}]
    assert branches[0]["properties"]["parameters"] == WEATHER
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {})]
    # parallel_tool_calls=false: exactly one call.
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "required",
                                           "parallel_tool_calls": False, "max_tokens": 200})
    assert r.status_code == 200 and llm.last_params.structured_outputs.json["maxItems"] == 1
    # Cut short by max_tokens, the array holds no complete call: the text comes back as it is.
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "required",
                                           "max_tokens": 10})
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"], choice["message"]["tool_calls"]) == (
        "length", calls[:10], [])


def _stream(url, body):
    r = post(url, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_streamed_named_tool_call(tool_server, scripted):
    import re
    url, _ = tool_server
    scripted('{"city": "Paris"}')
    chunks = _stream(url, {"messages": CHAT_X, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 30})
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    [header] = first["tool_calls"]
    assert re.fullmatch(CALL_ID, header["id"])
    assert header == {"index": 0, "id": header["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}
    rest = [c["choices"][0] for c in chunks[1:]]
    assert all(list(c["delta"]) == ["tool_calls"] and c["delta"]["tool_calls"][0]["index"] == 0 for c in rest)
    assert "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in rest) == '{"city": "Paris"}'
    assert [c["finish_reason"] for c in rest][-2:] == [None, "stop"]


def test_streamed_required_tool_calls_come_at_the_end(tool_server, scripted):
    url, _ = tool_server
    scripted('[{"name": "get_time", "parameters": {}}]')
    chunks = _stream(url, {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "required", "max_tokens": 100, "n": 2})
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [c["delta"] for c in mine[:1]] == [{"role": "assistant", "content": None}]
        [last] = mine[1:]  # the array is split into calls once complete
        assert last["finish_reason"] == "tool_calls"
        [call] = last["delta"]["tool_calls"]
        assert (call["index"], call["function"]) == (0, {"name": "get_time", "arguments": "{}"})


TOOLS_BAD = [
    # (body fields, param, words in the message)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice --tool-call-parser hermes"),
    ({"tools": TOOLS}, "tool_choice", '"none"'),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tool_choice": NAMED}, "tool_choice", "no tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "required"},
     "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools.0.function.name", "required"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tools", "guided_regex and tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
     "response_format and tools"),
    ({"functions": [{"name": "f"}]}, "functions", "tools and tool_choice"),
    ({"function_call": {"name": "f"}}, "function_call", "tools and tool_choice"),
    # the engine refuses the function's schema: the 400 names that function's parameters
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"INVALID": 1}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters", "is invalid"),
]


@pytest.mark.parametrize("fields,param,words", TOOLS_BAD)
def test_bad_tool_requests_are_400s(tool_server, fields, param, words):
    url, _ = tool_server
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tool_choice_none_with_a_constraint_is_fine(tool_server):
    """tool_choice "none" constrains nothing, so another constraint may hold the text."""
    url, llm = tool_server
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "none",
                                           "guided_regex": "x+", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert llm.last_params.structured_outputs.regex == "x+"


def test_required_schema_moves_defs_to_the_top(tool_server):
    """A tool's "#/$defs/..." references must still resolve once its schema is nested in the array."""
    url, llm = tool_server
    place = {"type": "object", "properties": {"where": {"$ref": "#/$defs/City"}}, "$defs": {"City": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": place}}, TOOLS[1]]
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": tools, "tool_choice": "required", "max_tokens": 2})
    assert r.status_code == 200, r.text
    schema = llm.last_params.structured_outputs.json
    assert schema["$defs"] == {"City": {"type": "string"}}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {k: v for k, v in place.items() if k != "$defs"}
    other = {**place, "$defs": {"City": {"type": "integer"}}}  # the same name for another definition
    tools = [tools[0], {"type": "function", "function": {"name": "stay", "parameters": other}}]
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": tools, "tool_choice": "required", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.parameters", r.text
    # $defs that are not an object are the grammar compiler's to refuse, not a server error.
    bad = {"type": "object", "$defs": ["INVALID"]}
    tools = [{"type": "function", "function": {"name": "go", "parameters": bad}}, TOOLS[1]]
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": tools, "tool_choice": "required", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ---- tool_choice "auto" with a parser (serve/tool_parsers.py) ---------------------------------

AUTO_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def auto_tool_server():
    """`jlight serve --enable-auto-tool-choice --tool-call-parser hermes` around the stand-in engine."""
    yield from _serve(FakeAsyncLLM(max_model_len=1024), tool_call_parser="hermes")


def test_auto_finds_the_calls_in_free_text(auto_tool_server, monkeypatch):
    import re
    url, llm = auto_tool_server
    free_text = lambda text: monkeypatch.setattr(llm, "free_text", text)  # what the stand-in writes
    free_text("Checking.\n" + AUTO_CALL)
    for body in ({"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200},  # "auto" is the default with tools
                 {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 200}):
        r = post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert llm.last_params.structured_outputs is None  # nothing holds the text: the model chooses
        assert llm.last_prompt.startswith("<tool get_weather><tool get_time>")
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.\n"
        [call] = choice["message"]["tool_calls"]
        assert re.fullmatch(CALL_ID, call["id"]) and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # No call written: a plain answer; cut short inside a call: its text, and the engine's reason.
    free_text("It is sunny.")
    choice = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200}).json()["choices"][0]
    assert (choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]) == (
        "It is sunny.", None, "stop")
    free_text(AUTO_CALL)
    choice = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 20}).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (AUTO_CALL[:20], "length")
    # Without tools the parser stays out of it, even for text that looks like a call.
    choice = post(url, "/v1/chat/completions", {"messages": CHAT_X, "max_tokens": 200}).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (AUTO_CALL, "stop")


def test_auto_streams_content_then_each_call_whole(auto_tool_server, monkeypatch):
    url, llm = auto_tool_server
    second = AUTO_CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}")
    monkeypatch.setattr(llm, "free_text", "Checking.\n" + AUTO_CALL + second)
    chunks = _stream(url, {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 300, "n": 2})
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        content = "".join(c["delta"].get("content") or "" for c in mine[1:])
        assert content == "Checking.\n"  # not one character of the calls' text
        calls = [call for c in mine for call in c["delta"].get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (0, "get_weather", '{"city": "Paris"}'), (1, "get_time", "{}")]
        assert calls[0]["id"] != calls[1]["id"]
        assert [c["finish_reason"] for c in mine][-1] == "tool_calls"
        assert sum(c["finish_reason"] is not None for c in mine) == 1


def test_auto_tool_calls_through_the_openai_client(auto_tool_server, monkeypatch):
    """The openai SDK reads the calls, and its stream helper assembles the streamed ones into the same message."""
    import openai
    url, llm = auto_tool_server
    monkeypatch.setattr(llm, "free_text", "Checking.\n" + AUTO_CALL)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    message = client.chat.completions.create(model="fake-model", messages=CHAT_X, tools=TOOLS,
                                             max_tokens=200).choices[0].message
    assert message.content == "Checking.\n"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    with client.chat.completions.stream(model="fake-model", messages=CHAT_X, tools=TOOLS, max_tokens=200) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking.\n"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.fixture(scope="module")
def llama_tool_server():
    """The same with --tool-call-parser llama3_json."""
    yield from _serve(FakeAsyncLLM(max_model_len=1024), tool_call_parser="llama3_json")


def test_auto_with_llama3_json_calls(llama_tool_server, monkeypatch):
    url, llm = llama_tool_server
    monkeypatch.setattr(llm, "free_text", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                          '{"name": "get_time", "parameters": {}}')
    choice = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200}).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")
    want = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == want
    mine = [c["choices"][0] for c in _stream(url, {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200})]
    calls = [call for c in mine for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (i, name, arguments) for i, (name, arguments) in enumerate(want)]
    assert not "".join(c["delta"].get("content") or "" for c in mine) and mine[-1]["finish_reason"] == "tool_calls"
    monkeypatch.setattr(llm, "free_text", "Oslo is rainy.")  # an answer, not a call: content, streamed as it comes
    mine = [c["choices"][0] for c in _stream(url, {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200})]
    assert "".join(c["delta"].get("content") or "" for c in mine) == "Oslo is rainy."
    assert len(mine) == len("Oslo is rainy.") + 1 and mine[-1]["finish_reason"] == "stop"


def test_tokenize_counts_the_chat_prompt_with_its_tools(tool_server):
    """/tokenize with messages and tools gives the prompt the chat endpoint runs (vLLM's fields)."""
    url, llm = tool_server
    r = post(url, "/v1/chat/completions", {"messages": CHAT_X, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
    assert r.status_code == 200, r.text
    ids = post(url, "/tokenize", {"messages": CHAT_X, "tools": TOOLS}).json()["tokens"]
    assert bytes(ids).decode() == llm.last_prompt == "<tool get_weather><tool get_time><user>x<assistant>"
    ids = post(url, "/tokenize", {"messages": CHAT_X, "add_generation_prompt": False}).json()["tokens"]
    assert bytes(ids).decode() == "<user>x"
    r = post(url, "/tokenize", {"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_auto_leaves_an_answer_held_to_the_clients_format_alone(llama_tool_server, monkeypatch):
    """With response_format (or guided_*), the constrained JSON is the answer, even one that reads like a call."""
    url, llm = llama_tool_server
    call_like = '{"name": "get_time", "parameters": {}}'
    monkeypatch.setattr(llm, "scripted_text", call_like)
    body = {"messages": CHAT_X, "tools": TOOLS, "max_tokens": 200, "response_format": {"type": "json_object"}}
    choice = post(url, "/v1/chat/completions", body).json()["choices"][0]
    assert (choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]) == (
        call_like, None, "stop")
    monkeypatch.setattr(llm, "free_text", call_like)  # the same text unconstrained is a call
    choice = post(url, "/v1/chat/completions", {**body, "response_format": None}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"
