"""Runs jlight's model functions directly (no engine) for one sequence: prefill + greedy decode.

Used by the correctness tests to compare against transformers without depending on the
engine. The prompt is padded to a fixed bucket, so each model compiles two functions
(prefill and one-token decode) however many prompts a test runs.
"""
from __future__ import annotations

import contextlib
import os
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jlight.models import get_model_family
from jlight.core.batch_metadata import BatchMetadata
from jlight.core.parallel_ops import ParallelOps
from jlight.core.recurrent_state import PagesAndState, zeros_like_shapes
from jlight.engine.model_runner import matmul_precision
from jlight.pallas_kernels.dispatch import get_kernels

PAGE_SIZE = 16


def _metadata(positions, slots, context_len, page_table, last_index) -> BatchMetadata:
    num_tokens = positions.shape[0]
    return BatchMetadata(
        positions=positions,  # [T]
        slot_mapping=slots,  # [T]
        token_seq=jnp.zeros((num_tokens,), jnp.int32),  # [T]: one sequence
        page_table=page_table[None, :],  # [1, max_pages]
        context_lens=jnp.reshape(context_len, (1,)).astype(jnp.int32),  # [1]
        query_start=jnp.stack([jnp.int32(0), jnp.int32(last_index + 1)]),  # [2]: the real tokens, not the padding
        logits_indices=jnp.reshape(last_index, (1,)).astype(jnp.int32),  # [1]
        state_slots=jnp.ones((1,), jnp.int32),  # [1]: slot 1 of a hybrid model's state pools (slot 0 is scratch)
    )


def _forward(params, config, tokens, positions, slots, context_len, page_table, last_index, k_cache, v_cache):
    """All-position logits [T, vocab] of one (padded) chunk, and the updated caches."""
    family = get_model_family(config)
    kernels = get_kernels("reference", "reference")
    md = _metadata(positions, slots, context_len, page_table, last_index)
    with jax.default_matmul_precision(matmul_precision(params["final_norm"].dtype)):  # as the engine's steps
        hidden, k_cache, v_cache = family.forward(params, config, tokens, k_cache, v_cache, md, kernels, ParallelOps())
        return family.compute_logits(params, config, hidden, kernels, ParallelOps()), k_cache, v_cache


_JIT_OPTIONS = dict(static_argnames=("config",), donate_argnames=("k_cache", "v_cache"))
_run = jax.jit(_forward, **_JIT_OPTIONS)
# The suite compiles at -O0 (conftest.py): quick to compile, slow to run. A real model's runner (SmolLM2-135M's
# greedy continuations: five prompts of 32 one-token steps) runs enough to pay for XLA's default level instead.
# (With the fusion emitters that the suite turns off at -O0, if it did: at -O3 they compile faster.)
_OPTIMIZED = {"xla_backend_optimization_level": 3,
              **({"xla_cpu_use_fusion_emitters": True} if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "") else {})}
_run_optimized = jax.jit(_forward, compiler_options=_OPTIMIZED, **_JIT_OPTIONS)
OPTIMIZED_MIN_PARAMS = 50_000_000  # a tiny test model has well under a million


class SingleSequenceRunner:
    """Prefill a prompt, then decode greedily, on a paged cache holding one sequence."""

    def __init__(self, params, config, max_len: int = 256, prefill_bucket: int = 128):
        self.params, self.config, self.bucket = params, config, prefill_bucket
        num_pages = max_len // PAGE_SIZE + 1  # + page 0, the reserved scratch page
        k_shape, v_shape = get_model_family(config).kv_cache_shapes(config, num_pages, PAGE_SIZE)
        self.dtype = jax.tree.leaves(params)[0].dtype
        self.k_cache = jnp.zeros(k_shape, self.dtype)  # [layers, pages, page_size, kv_heads, head_dim]
        family = get_model_family(config)
        if hasattr(family, "state_shapes"):  # a hybrid model: its recurrent layers' state pools ride with the K pages
            self.k_cache = PagesAndState(self.k_cache, zeros_like_shapes(family.state_shapes(config, 2)))
        self.v_cache = jnp.zeros(v_shape, self.dtype)
        self.page_table = jnp.arange(1, num_pages, dtype=jnp.int32)  # [max_pages]: pages 1.. in order
        self.max_len = max_len
        num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
        self._run = _run_optimized if num_params >= OPTIMIZED_MIN_PARAMS else _run

    def _step(self, tokens: list[int], start: int, pad_to: int) -> np.ndarray:
        n = len(tokens)
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds max_len={self.max_len}")
        pos = np.zeros(pad_to, np.int32)  # [T]; padding tokens sit at position 0 of scratch page 0
        pos[:n] = np.arange(start, start + n)
        slots = np.zeros(pad_to, np.int32)  # [T]
        slots[:n] = PAGE_SIZE + pos[:n]  # page i+1 holds positions [i*PAGE_SIZE, (i+1)*PAGE_SIZE)
        toks = np.zeros(pad_to, np.int32)  # [T]
        toks[:n] = tokens
        logits, self.k_cache, self.v_cache = self._run(
            self.params, self.config, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(slots),
            jnp.int32(start + n), self.page_table, jnp.int32(n - 1), self.k_cache, self.v_cache,
        )
        return np.asarray(logits)[:n]

    def prefill_logits(self, prompt: list[int]) -> np.ndarray:
        """float32 logits [len(prompt), vocab] at every prompt position (cache restarts)."""
        if len(prompt) > self.bucket:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds prefill_bucket={self.bucket}")
        return self._step(list(prompt), 0, self.bucket)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The `max_tokens` greedy continuation of `prompt` (no stop tokens)."""
        out = [int(self.prefill_logits(prompt)[-1].argmax())]
        while len(out) < max_tokens:
            logits = self._step([out[-1]], len(prompt) + len(out) - 1, 1)
            out.append(int(logits[-1].argmax()))
        return out

    def teacher_forced_top1(self, ids: list[int]) -> np.ndarray:
        """argmax at every position of `ids` (one prefill)."""
        return self.prefill_logits(ids).argmax(-1)


@contextlib.contextmanager
def _torch_single_thread():
    """torch's spinning worker threads fight XLA's for the 2 CI cores (10x slower decode);
    one torch thread is faster here and leaves the global setting as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(before)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation with its KV cache, ignoring EOS (so lengths match)."""
    import torch

    out = []
    with _torch_single_thread():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            if len(out) == max_tokens:
                break
            res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    import torch

    with _torch_single_thread():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


@contextlib.contextmanager
def one_gguf_reader_per_file():
    """transformers opens the GGUF three times to build its tokenizer, config and weights, each time
    parsing all of its metadata with gguf.GGUFReader (~3.5 s each here): hand it one reader per file.
    The reader only reads (memory-mapped); transformers' own loading code runs as it is."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def shared(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


@contextlib.contextmanager
def gguf_name_map_built_once():
    """transformers builds gguf's tensor-name map once per submodule of the model (~400 times,
    ~5 s here). It depends only on its arguments and is only read, so build each one once."""
    import gguf

    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(real)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = real


def transformers_from_gguf(path: str):
    """(tokenizer, float32 model) as transformers builds them from a GGUF file (its own GGUF loading and
    dequantization, ~24 s for SmolLM2 on a loaded 2-core host), saved in transformers' and safetensors'
    formats under jlight's cache ($JLIGHT_CACHE) the first time, so the other test files (and pytest
    processes) that compare against them read them back in ~3 s. The copy is keyed by the GGUF's name,
    size and mtime and by transformers' version; a lock makes concurrent workers build it once."""
    import fcntl

    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from jlight.loading.default_model import cache_dir

    st = os.stat(path)
    key = f"{os.path.basename(path)}-{st.st_size}-{int(st.st_mtime)}-transformers{transformers.__version__}"
    saved = os.path.join(cache_dir(), "transformers_from_gguf", key)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(saved, "done")):
            directory, name = os.path.split(path)
            with one_gguf_reader_per_file(), gguf_name_map_built_once():
                hf_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
                hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
            tmp = saved + ".partial"
            os.makedirs(tmp, exist_ok=True)
            hf.config.save_pretrained(tmp)
            hf_tok.save_pretrained(tmp)
            # clone: tied weights (lm_head = embed_tokens) are saved as two tensors, load_state_dict refills both
            save_file({k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()},
                      os.path.join(tmp, "weights.safetensors"))
            open(os.path.join(tmp, "done"), "w").close()
            if os.path.isdir(saved):
                import shutil
                shutil.rmtree(saved)
            os.replace(tmp, saved)
            return hf_tok, hf
    hf_tok = AutoTokenizer.from_pretrained(saved)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved), dtype=torch.float32).eval()
    hf.load_state_dict(load_file(os.path.join(saved, "weights.safetensors")), strict=True)
    return hf_tok, hf


def gguf_and_transformers(path: str):
    """(jlight LoadedModel float32, transformers model float32, transformers tokenizer) for the same GGUF file."""
    from jlight.loading import load_model

    loaded = load_model(path, dtype="float32")
    hf_tok, hf = transformers_from_gguf(path)
    return loaded, hf, hf_tok
