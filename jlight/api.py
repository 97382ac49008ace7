"""The Python API: `jlight.LLM` for offline batches and streams, `jlight.generate` for one call."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import numpy as np

from jlight.engine.data_parallel import make_engine
from jlight.engine.engine_config import EngineConfig
from jlight.engine.outputs import RequestOutput
from jlight.engine.sampling_params import SamplingParams
from jlight.progress import Progress

_ids = itertools.count()


class LLM:
    """A model loaded with its engine.

    >>> llm = jlight.LLM()  # the default SmolLM2-135M-Instruct
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, tensor_parallel_size: int | None = None, **engine_options):
        if tensor_parallel_size is not None:  # vLLM's name for it, as the CLI's --tensor-parallel-size
            if engine_options.get("mesh"):
                raise ValueError("give either mesh or tensor_parallel_size, not both")
            if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} is invalid: must be an integer >= 1")
            engine_options["mesh"] = f"tp={tensor_parallel_size}"
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - fields)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; valid ones: {', '.join(sorted(fields))}")
        self.engine = make_engine(EngineConfig(model=model, **engine_options))  # dp > 1: one engine per replica
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name

    # ---- offline batches --------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings or token-id lists); results in input order."""
        prompts = _as_prompt_list(prompts)
        # Only each request's last output is kept: the engine builds none before it (output_kind "final_only").
        params_list = [dataclasses.replace(p, output_kind="final_only")
                       for p in _broadcast_params(sampling_params, len(prompts))]
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self._add(prompt, params))
        except BaseException:  # a refused prompt: withdraw the ones added before it, or the next call would run them
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat with one conversation (a list of {role, content}) or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.apply_chat_template(m, add_generation_prompt) for m in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat is unavailable; pass token ids to generate()")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template already holds BOS (if any): don't add special tokens twice.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (stop strings never leak)."""
        params = dataclasses.replace(sampling_params or SamplingParams(), output_kind="delta")  # only text_delta is read
        if params.n != 1:
            raise ValueError("stream() takes n=1; use generate() for several samples")
        prompts = _as_prompt_list(prompt)
        if len(prompts) != 1:  # taking prompts[0] silently dropped the others
            raise ValueError(f"stream() takes one prompt, got {len(prompts)}; use generate() for several")
        rid = self._add(prompts[0], params)
        try:
            while True:
                finished = False
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.outputs[0].text_delta:
                            yield out.outputs[0].text_delta
                        finished = out.finished
                if finished:
                    break
        finally:
            self.engine.abort_request(rid)

    # ---- internals --------------------------------------------------------------------------
    def _add(self, prompt, params) -> str:
        rid = f"llm-{next(_ids)}"
        if isinstance(prompt, dict):  # vLLM's TextPrompt {"prompt": str} / TokensPrompt {"prompt_token_ids": [...]}
            if len(prompt) != 1 or not set(prompt) <= {"prompt", "prompt_token_ids"}:
                raise ValueError(f"prompt dict {sorted(prompt)!r} is invalid: give {{'prompt': text}} or {{'prompt_token_ids': [...]}}")
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            self.engine.add_request(rid, prompt, params)
        elif _is_token_ids(prompt):
            self.engine.add_request(rid, None, params, prompt_token_ids=[int(t) for t in prompt])
        else:
            raise ValueError(f"prompt {prompt!r:.80} is invalid: give a string, a list of token ids (integers), "
                             "or {'prompt': text} / {'prompt_token_ids': [...]}")
        return rid

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:  # a bar on a terminal, else nothing (jlight/progress.py)
            bar = Progress(len(ids), "requests", "req", leave=True, summary="{n} requests done in {seconds:.1f} s")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple, np.ndarray)):
        raise ValueError(f"prompts={prompts!r:.80} is invalid: give a prompt or a list of prompts")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], (int, np.integer)):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    return prompts


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params={params!r:.80} is invalid: give a SamplingParams or a list of them, one per prompt")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return params


def _is_token_ids(prompt) -> bool:
    # int() would silently truncate floats (1.5 -> 1), and bools are ints: accept only integers.
    return isinstance(prompt, (list, tuple, np.ndarray)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt)


def generate(prompts, model: str | None = None, *, max_tokens: int | None = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, **options) -> list[RequestOutput]:
    """Load `model` (default SmolLM2-135M-Instruct) and generate for `prompts` in one call.

    Other options are SamplingParams fields (stop, n, logprobs, ...) or else EngineConfig fields (dtype, ...)."""
    sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    sampling = {k: options.pop(k) for k in list(options) if k in sampling_fields}
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **sampling)
    params.validate()  # before loading the model
    llm = LLM(model, **options)
    return llm.generate(prompts, params, use_tqdm=False)
