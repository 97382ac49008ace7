"""Loading models: HF directories (safetensors), GGUF files, the default model, hub ids.

`load_model(model)` dispatches on what `model` names:
  None            -> the default model, SmolLM2-135M-Instruct (GGUF, see default_model.py)
  path/to/x.gguf  -> a llama.cpp GGUF file (weights dequantized at load time, or with keep_gguf_blocks its
                     Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K linear weights kept as stored, the K-quants as their
                     sub-blocks: what the CPU engine does by default)
  a `jlight convert` output directory -> its orbax params (orbax_loader.py)
  a directory     -> a HF checkpoint (config.json + safetensors + tokenizer.json); FP8 ones
                     (compressed-tensors, fp8) keep their linear weights in fp8 (fp8_checkpoint.py)
  "org/name"      -> a HF hub id, downloaded with huggingface_hub when the hub is reachable

dtype "auto" keeps a HF checkpoint's own dtype (config.json `torch_dtype`). GGUF weights
are dequantized to float32 on CPU (exact, and CPU bf16 matmuls are slow) and to bfloat16
on accelerators (half the memory; the 4-bit source has less precision than bf16 anyway).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.core.errors import ModelLoadError
from jlight.loading import orbax_loader, safetensors_loader as st
from jlight.loading.fp8_checkpoint import fp8_scheme, fp8_tensors
from jlight.loading.assemble import assemble_params
from jlight.loading.default_model import default_gguf_path
from jlight.loading.gguf_loader import gguf_tensors, load_gguf_model
from jlight.loading.gguf_tokenizer import gguf_tokenizer
from jlight.loading.hub import download_from_hub, looks_like_hub_id
from jlight.loading.safetensors_loader import read_generation_config
from jlight.progress import iterate
from jlight.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: Any  # jlight.tokenizer.Tokenizer, or None for a directory without tokenizer.json
    generation_config: dict  # generation_config.json ({} if absent); eos_token_id as a list
    name: str  # the path or hub id it came from
    dtype: Any = None  # the dtype the params were cast to


def resolve_dtype(dtype, checkpoint_dtype: str) -> Any:
    """Turn the user's dtype choice ("auto" or a name) into a jnp dtype."""
    name = checkpoint_dtype if dtype == "auto" else (dtype if isinstance(dtype, str) else jnp.dtype(dtype).name)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'")
    return DTYPES[name]


def cpu_auto_dtype(checkpoint_dtype: str, checkpoint_bytes: int, host_bytes: int | None = None) -> str:
    """The dtype "auto" gives a checkpoint on the CPU: float32 where its weights in float32 take at most half of
    the host's memory (host_bytes, default the machine's), else the checkpoint's own. XLA:CPU computes 16-bit
    floats in float32 and widens a whole operand to do so (the embedding table a step gathers from, a tied LM
    head): SmolLM2-135M's shape decodes at 114.6 ms a token in bfloat16 against 16.5 ms in float32 (2 cores)."""
    if checkpoint_dtype not in ("bfloat16", "float16"):
        return checkpoint_dtype
    if host_bytes is None:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "float32" if 2 * (2 * checkpoint_bytes) <= host_bytes else checkpoint_dtype


def load_model(model: str | None = None, dtype="auto", place: Callable | None = None, mesh=None,
               unstacked: bool = False, keep_gguf_blocks: bool = False, keep_mxfp4: bool = False) -> LoadedModel:
    """Load config, params (on device) and tokenizer. `place(path, host_array)` puts each tensor
    on device (default jax.device_put); the sharding code passes one that shards it. unstacked=True:
    a dense model's `layers` come as per-layer dicts (assemble_params), read from safetensors or GGUF
    files that way; a converted checkpoint's stay stacked. keep_gguf_blocks: a GGUF file's Q4_0, Q4_1, Q5_0,
    Q8_0, Q4_K, Q5_K and Q6_K linear weights stay in their blocks (jlight/core/gguf_weights.py) instead of
    being dequantized. keep_mxfp4: an MXFP4 checkpoint's experts (gpt-oss's, HF or GGUF) stay as stored (Mxfp4Weights)."""
    if model is None:
        path = default_gguf_path()
        logger.info("loading the default model, SmolLM2-135M-Instruct (%s)", path)
        return load_gguf(path, dtype, place, unstacked, keep_gguf_blocks, keep_mxfp4)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path or hub id string, got {type(model).__name__}")
    model = os.path.expanduser(os.fspath(model))
    if os.path.exists(model):  # a path that is not there is refused below, without a "loading" line first
        logger.info("loading %s", model)
    if model.endswith(".gguf"):
        return load_gguf(model, dtype, place, unstacked, keep_gguf_blocks, keep_mxfp4)
    if orbax_loader.is_orbax_model_dir(model):
        return load_converted_dir(model, mesh=mesh, dtype=dtype)
    if os.path.isdir(model):
        return load_hf_dir(model, dtype, place, unstacked=unstacked, keep_mxfp4=keep_mxfp4)
    if os.path.exists(model):
        raise ModelLoadError(f"{model} is neither a .gguf file nor a HF model directory (with config.json)")
    if looks_like_hub_id(model) and not model.startswith((".", "/", "~")):
        logger.info("loading %s from the Hugging Face hub", model)
        return load_hf_dir(download_from_hub(model), dtype, place, name=model, unstacked=unstacked, keep_mxfp4=keep_mxfp4)
    raise ModelLoadError(f"model path {model} does not exist; pass a .gguf file, a HF model directory or a hub id like org/name")


def load_hf_dir(model_dir: str, dtype="auto", place=None, name: str | None = None, unstacked: bool = False,
                keep_mxfp4: bool = False) -> LoadedModel:
    config_path = os.path.join(model_dir, "config.json")
    config = ModelConfig.from_json_file(config_path)  # raises ModelLoadError/UnsupportedModelError
    with open(config_path) as f:
        hf_config = json.load(f)
    files = st.safetensors_files(model_dir)
    stored = st.checkpoint_dtype(hf_config)
    auto = cpu_auto_dtype(stored, sum(os.path.getsize(f) for f in files)) if jax.default_backend() == "cpu" else stored
    if dtype == "auto" and auto != stored:
        logger.info("dtype auto on the CPU: the %s checkpoint runs in %s (pass dtype=%s to keep it)", stored, auto, stored)
    jdtype = resolve_dtype(dtype, auto)
    tensors = _progress(st.stream_safetensors(files), st.count_tensors(files), os.path.basename(model_dir.rstrip("/")))
    scheme = fp8_scheme(hf_config)  # an FP8 checkpoint's linear weights come as Fp8Weights (fp8_checkpoint.py)
    if scheme is not None:
        tensors = fp8_tensors(tensors, scheme)
    params = assemble_params(config, tensors, jdtype, place=place, unstacked=unstacked, keep_mxfp4=keep_mxfp4)
    generation_config = st.read_generation_config(model_dir)
    has_tokenizer = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(model_dir, generation_config) if has_tokenizer else None
    return LoadedModel(config, params, tokenizer, generation_config, name or model_dir, jdtype)


def load_converted_dir(model_dir: str, mesh=None, dtype="auto") -> LoadedModel:
    """A directory written by `jlight convert` (orbax params; dtype fixed at conversion, so `dtype`
    must be "auto" or that dtype). With a mesh, each array is restored straight into its sharding."""
    stored = orbax_loader.read_manifest(model_dir).get("dtype")
    if dtype != "auto" and stored in DTYPES and resolve_dtype(dtype, stored) != DTYPES[stored]:
        # It used to be ignored silently: the model ran in the stored dtype, not the one asked for.
        raise ModelLoadError(f"{model_dir} was converted to {stored}; drop --dtype (or pass {stored}), "
                             f"or convert again with --dtype {jnp.dtype(resolve_dtype(dtype, stored)).name}")
    config, params = orbax_loader.load_orbax_model(model_dir, mesh=mesh)
    generation_config = read_generation_config(model_dir)
    has_tokenizer = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(model_dir, generation_config) if has_tokenizer else None
    dtype = jax.tree.leaves(params)[0].dtype if jax.tree.leaves(params) else None
    return LoadedModel(config, params, tokenizer, generation_config, model_dir, dtype)


def load_gguf(path: str, dtype="auto", place=None, unstacked: bool = False, keep_blocks: bool = False,
              keep_mxfp4: bool = False) -> LoadedModel:
    reader, config, arch = load_gguf_model(path)
    gguf_default = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    jdtype = resolve_dtype(dtype, gguf_default)
    tokenizer = gguf_tokenizer(reader, path)
    tensors = _progress(gguf_tensors(reader, config, arch, keep_blocks), len(reader.tensors), os.path.basename(path))
    params = assemble_params(config, tensors, jdtype, place=place, unstacked=unstacked, keep_mxfp4=keep_mxfp4)
    generation_config = {"eos_token_id": list(tokenizer.eos_token_ids)} if tokenizer.eos_token_ids else {}
    return LoadedModel(config, params, tokenizer, generation_config, path, jdtype)


def _progress(it, total: int, label: str):
    """A bar over the tensors on a terminal; elsewhere one line when they are all read."""
    name = label.replace("{", "{{").replace("}", "}}")
    return iterate(it, total, f"loading {label}", "tensor", summary=f"read {{n}} tensors of {name} in {{seconds:.1f}} s")
