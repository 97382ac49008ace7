"""Builds the params tree from a stream of (name, numpy tensor) pairs.

Invariants:
- Each tensor is cast and put on device as it arrives, on a few threads at once (its read from the
  memory-mapped file, cast and host-to-device copy overlap the next tensors'); at most twice the threads'
  count of tensors are in flight, so the host holds that many tensors beyond the source file's own
  (memory-mapped) copy. Per-layer tensors are stacked on device at the end.
- GGUF weights kept as blocks (GGUFHostWeight) stack when every layer keeps one form (type, dtypes, shapes);
  a weight whose layers differ (a Q4_K_M file's ffn_down: Q4_K in some layers, Q6_K in others; kept types
  beside ones loaded as float) is dequantized to the model dtype's [in, out] arrays instead, the float load's
  numbers. Unstacked (per-layer) trees keep each layer's own form.
- On a GPU with the default placement (`transform_on_device`), a tensor goes to the device as the file
  stores it and is transposed and cast there: a strided transpose on the host runs at a fraction of a
  plain copy's rate (0.4 against 5.5 GB/s for a [14336, 4096] bf16 weight on a 2-core host) and the
  device does it at its memory rate. Elsewhere (the CPU, a sharding plan's `place`) the host casts and
  transposes it into an aligned array in one pass (host_array).
- The tree is the same either way: same shapes, dtypes and values.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config  # persistent_cache_min_compile_time_secs as a thread-local context; private in jax 0.10/0.11

from jlight.core.config import HYBRID_FAMILIES, ModelConfig
from jlight.core.errors import ModelLoadError
from jlight.core.gguf_weights import GGUF_WEIGHTS, dequantize_gguf_t
from jlight.core.quantization import LINEAR_WEIGHTS, Fp8Weight
from jlight.loading.fp8_checkpoint import Fp8HostWeight
from jlight.loading.gguf_blocks import GGUFHostWeight
from jlight.loading.mxfp4 import Mxfp4HostWeight
from jlight.loading.hf_names import map_hf_name
from jlight.loading.hf_names_families import family_name_mapper, split_fused_tensors
from jlight.loading.hf_names_hybrid import hybrid_name_mapper
from jlight.loading.hf_names_moe import moe_name_mapper
from jlight.models import get_model_family


def assemble_params(
    config: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype,
    *,
    place: Callable[[str, np.ndarray], jax.Array] | None = None,
    name_mapper=None,
    unstacked: bool = False,
    transform_on_device: bool | None = None,
    threads: int | None = None,
    keep_mxfp4: bool = False,
) -> dict:
    """Consume (hf_name, array) pairs and return the params tree of the config's model family.

    `place(path, host_array)` puts one tensor on device (default: jax.device_put); the
    sharding code passes one that places it straight into its mesh sharding.
    `name_mapper(hf_name) -> (key, index, transpose) | [such triples] | None` (default: the family's HF
    names); transpose is a bool ([out, in] -> [in, out]) or a function of the array (a hybrid family's
    conv weights and fused expert pairs, split into several entries: loading/hf_names_hybrid.py).
    Stacked groups are the dict entries of `param_shapes` ("layers", DeepSeek's "dense_layers");
    a key "group.param" names another group than "layers", and an index (layer, expert) fills
    one expert of a [layers, experts, ...] weight.
    unstacked=True: a model whose only stacked group is `layers`, one index deep (a dense family), gets
    `layers` as a list of per-layer dicts, what an unrolled layer loop runs (models/layers.split_layers'
    form), and the weights are never stacked (stacking them and splitting them again cost a copy of
    the weights and a compile per weight shape at every start).
    transform_on_device: transpose and cast each tensor on the device (None: with the default placement on a
    backend other than the CPU; see the module's invariants). threads: tensors placed at once (None: up to 8,
    one per CPU core). keep_mxfp4: an MXFP4 checkpoint's experts (gpt-oss) stay as stored (Mxfp4Weights, their
    float rows in `dtype`), put by the default placement (a sharding plan places them after).
    """
    family = get_model_family(config)
    shapes = family.param_shapes(config)
    if name_mapper is None:
        name_mapper = moe_name_mapper(config) or family_name_mapper(config) or hybrid_name_mapper(config) or map_hf_name
    if keep_mxfp4 and place is not None:
        raise ValueError("keep_mxfp4: MXFP4 experts are put on the device whole (three arrays a weight), not through "
                         "place=; load without place= (a sharding plan places them after), or expanded (keep_mxfp4=False)")
    if config.family not in HYBRID_FAMILIES:  # the hybrid families' mappers split their fused tensors themselves
        tensors = split_fused_tensors(config, tensors, keep_mxfp4)
    if transform_on_device is None:
        transform_on_device = place is None and jax.default_backend() != "cpu"
    elif transform_on_device and place is not None:
        raise ValueError("transform_on_device places tensors with jax.device_put; pass it without place=")
    place = place or (lambda path, a: jax.device_put(a))
    np_dtype = jnp.dtype(dtype)
    threads = threads or min(8, os.cpu_count() or 1)
    in_flight = threading.BoundedSemaphore(2 * threads)

    def submit(pool, put, path, arr):
        in_flight.acquire()
        future = pool.submit(put, path, arr)
        future.add_done_callback(lambda _: in_flight.release())
        return future
    # group -> param -> {index tuple: on-device slice}
    layer_parts: dict[str, dict[str, dict]] = {g: {k: {} for k in sub} for g, sub in shapes.items() if isinstance(sub, dict)}
    top: dict[str, jax.Array] = {}
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jlight-load") as pool:
        for name, tensor in tensors:
            mapped = name_mapper(name)
            if mapped is None:
                continue
            for key, layer, transpose in mapped if isinstance(mapped, list) else [mapped]:
                if isinstance(tensor, Mxfp4HostWeight):  # kept as the file's blocks, laid out on the device
                    arr, shape = tensor, tensor.shape
                    put = lambda path, w: w.to_device()  # noqa: E731
                elif isinstance(tensor, GGUFHostWeight):  # kept as the file's blocks, [out, ...] rows: never transposed
                    arr, shape = tensor, tensor.shape
                    put = lambda path, w: w.to_device(lambda p, a: place(p, host_array(a, a.dtype)), path)  # noqa: E731
                else:
                    arr, shape, put = _host_tensor(tensor, transpose, key, np_dtype, place, transform_on_device)
                if layer is None:
                    if key not in shapes:
                        continue
                    _check_shape(name, shape, shapes[key])
                    top[key] = submit(pool, put, key, arr)
                    continue
                group, _, key = key.rpartition(".")
                group = group or "layers"
                index = layer if isinstance(layer, tuple) else (layer,)
                if key not in layer_parts.get(group, {}):
                    continue
                want = shapes[group][key]
                if any(i >= n for i, n in zip(index, want)):
                    continue  # e.g. layers beyond num_layers
                _check_shape(name, shape, want[len(index):])
                layer_parts[group][key][index] = submit(pool, put, f"{group}.{key}", arr)
    top = {k: f.result() for k, f in top.items()}
    for params in layer_parts.values():
        for parts in params.values():
            parts.update((i, f.result()) for i, f in parts.items())
    if "lm_head" not in top:
        if "embed" not in top:
            raise ModelLoadError("checkpoint has no token embedding (model.embed_tokens.weight); the file is incomplete")
        # Tied embeddings: keep an [embed, vocab] copy so the LM head is a plain matmul.
        top["lm_head"] = jnp.transpose(top["embed"])
    for key in ("embed", "final_norm"):
        if key not in top:
            raise ModelLoadError(f"checkpoint is missing the {key} tensor; the file is incomplete or not a {config.architecture}")
    if unstacked and set(layer_parts) == {"layers"} and all(len(i) == 1 for p in layer_parts["layers"].values() for i in p):
        parts = layer_parts["layers"]
        _check_complete("layers", {k: [(i,) for i in range(shapes["layers"][k][0]) if (i,) not in v] for k, v in parts.items()})
        layers = [{k: v[(i,)] for k, v in parts.items()} for i in range(config.num_layers)]
        return {k: layers if k == "layers" else top[k] for k in shapes}
    stacked = {}
    for group, params in layer_parts.items():
        stacked[group] = {}
        for key, parts in params.items():
            depth = len(next(iter(parts))) if parts else 1  # 1: [layers, ...]; 2: [layers, experts, ...]
            lead = shapes[group][key][:depth]
            _check_complete(group, {key: [i for i in np.ndindex(*lead) if i not in parts]})
            stacked[group][key] = _stack(_one_form(parts, np_dtype), lead)
            parts.clear()  # free the per-layer arrays as soon as they are stacked
    return {k: stacked[k] if k in stacked else top[k] for k in shapes}


def _host_tensor(tensor, transpose, key: str, np_dtype, place, on_device: bool):
    """(array, its shape once placed, put(path, array) -> device weight) for one checkpoint tensor: an FP8
    checkpoint's linear weight stays fp8 (an Fp8Weight), anything else becomes an array of the model dtype,
    transposed and cast on the host (host_array, in the put: on a loading thread) or, on_device, on the device."""
    fp8 = isinstance(tensor, Fp8HostWeight) and transpose is True and key.rpartition(".")[2] in LINEAR_WEIGHTS
    arr = tensor.dequantize() if isinstance(tensor, Fp8HostWeight) and not fp8 else np.asarray(tensor.values if fp8 else tensor)
    if callable(transpose):  # a hybrid family's reshaped or split weights (hf_names_hybrid.py)
        arr, transpose = transpose(arr), False
    shape = arr.shape[::-1] if transpose else arr.shape
    if fp8:
        return (arr.T if transpose else arr), shape, (lambda path, a: Fp8Weight(place(path, a), jax.device_put(tensor.scales)))
    if on_device and (transpose or arr.dtype != np_dtype):
        return arr, shape, (lambda path, a: cast_transposed(jax.device_put(a), bool(transpose), np_dtype))
    if on_device:  # as stored: the file's bytes straight to the device
        return arr, shape, (lambda path, a: jax.device_put(a))
    return arr, shape, (lambda path, a: place(path, host_array(a.T if transpose else a, np_dtype)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast_transposed(a: jax.Array, transpose: bool, dtype) -> jax.Array:
    return (a.T if transpose else a).astype(dtype)


def cast_transposed(a: jax.Array, transpose: bool, dtype) -> jax.Array:
    """A weight as the file stores it, on the device, made the model's: transposed ([out, in] -> [in, out]) and cast.

    One program a weight shape, each compiled in well under JAX's persistent cache's 1 s floor, so none was ever
    stored and every start compiled them all again; they are stored whatever their compile time (the cache's
    floor lowered on this thread for them alone), and a start after the first reads them."""
    with jax_config.persistent_cache_min_compile_time_secs(0.0):
        return _cast_transposed(a, transpose, dtype)


# XLA's CPU client takes a host array as a device buffer without copying it when the array's data is aligned
# to this many bytes (and C-contiguous); other host arrays it copies.
HOST_ALIGNMENT = 64


def host_array(arr: np.ndarray, dtype) -> np.ndarray:
    """A new C-contiguous array of `dtype` holding arr's values, its data HOST_ALIGNMENT-aligned, written
    in one pass (the cast and a transpose's strided reads together). Always a copy: `arr` may be a view of
    a memory-mapped file. On the CPU, jax.device_put then keeps it as the device buffer, so a weight is
    copied once on its way in instead of twice (astype, then device_put)."""
    dtype = np.dtype(dtype)
    buf = np.empty(arr.size * dtype.itemsize + HOST_ALIGNMENT, np.uint8)
    start = -buf.ctypes.data % HOST_ALIGNMENT
    out = buf[start:start + arr.size * dtype.itemsize].view(dtype).reshape(arr.shape)
    np.copyto(out, arr, casting="unsafe")
    return out


def _check_complete(group: str, missing: dict) -> None:
    """missing: param name -> the index tuples (layer[, expert]) the checkpoint did not hold."""
    for key, indices in missing.items():
        if indices:
            shown = [i if len(i) > 1 else i[0] for i in indices[:5]]
            raise ModelLoadError(
                f"checkpoint is missing {group}.{key} for layers {shown}{'...' if len(indices) > 5 else ''}; "
                "the file is incomplete or its config.json does not match it"
            )


def _one_form(parts: dict, dtype) -> dict:
    """{index tuple: weight} as it is, or, where its GGUF weights are kept in more than one form or beside float
    arrays (neither stacks), each GGUF weight dequantized to an [in, out] array of `dtype`."""
    kept = [w for w in parts.values() if isinstance(w, GGUF_WEIGHTS)]
    forms = {(type(w), tuple((leaf.dtype, leaf.shape) for leaf in w)) for w in kept}
    if not kept or (len(forms) == 1 and len(kept) == len(parts)):
        return parts
    return {i: dequantize_gguf_t(w, dtype).T if isinstance(w, GGUF_WEIGHTS) else w for i, w in parts.items()}


def _stack(parts: dict, lead: tuple[int, ...], prefix: tuple[int, ...] = ()):
    """Stack {index tuple: array} into one array with leading dims `lead`."""
    if len(prefix) == len(lead):
        return parts[prefix]
    rows = [_stack(parts, lead, prefix + (i,)) for i in range(lead[len(prefix)])]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *rows)  # arrays, or Fp8Weights leaf by leaf


def _check_shape(name, got, want):
    if tuple(got) != tuple(want):
        raise ModelLoadError(f"tensor {name} has shape {tuple(got)} but the config implies {tuple(want)}; config.json does not match the weights")
