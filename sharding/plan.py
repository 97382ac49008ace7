"""ShardingPlan: everything the model runner needs to run one model on one mesh.

    plan = ShardingPlan(mesh, config, param_axes)     # validates mesh against the model
    config = plan.config                              # use this one (KV heads may be replicated)
    params = plan.prepare_params(params)              # transform + place with NamedShardings
    k_sh, v_sh = plan.kv_cache_shardings(k_shape, v_shape)
    fn = plan.wrap(model_fn)                          # model_fn(..., ops) -> fn(...) under shard_map

`mesh=None` gives a single-device plan whose methods are no-ops, so the runner has one
code path.

Data parallelism (dp > 1): each replica runs its own independent sub-batch over its own
KV pool, so every input and output of the wrapped function gets a leading [dp] axis
(tokens [dp, T], each BatchMetadata field [dp, ...], caches [dp, *pool_shape], logits
[dp, B, vocab]); with dp == 1 the signature is exactly model_fn's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlight.core.parallel_ops import ParallelOps
from jlight.core.config import ModelConfig
from jlight.core.quantization import Mxfp4Weight, QuantizedKV, scales_sharding
from jlight.core.recurrent_state import PagesAndState
from jlight.sharding.mesh import describe, mesh_sizes
from jlight.sharding.rules import KV_CACHE_AXES, is_axes, logical_to_spec, param_specs
from jlight.sharding.tensor_parallel import TensorParallelOps

# Collective matmuls replace one all-reduce by a ring of 2(n-1) half-block hops; below a few
# hundred tokens per step (decode) the per-hop latency outweighs the overlap. A starting
# guess (not yet measured on GPU): benchmarks/mesh_sweep.py is the place to tune it.
DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS = 256


def _get_path(tree: dict, path: str):
    node = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(path)
        node = node[key]
    return node


class ShardingPlan:
    def __init__(self, mesh: Mesh | None, config: ModelConfig, param_axes: dict, mesh_config=None):
        self.mesh = mesh
        self.param_axes = param_axes
        sizes = mesh_sizes(mesh)
        self.dp, self.ep, self.tp = sizes["dp"], sizes["ep"], sizes["tp"]
        where = f"mesh {describe(mesh)!r}"
        self._check_divides(config.num_heads, self.tp, "num_heads", where)
        # Every other split dim (mlp, experts, ...) is checked against the weight's shape when placed.
        kv = config.num_kv_heads
        if kv % self.tp and self.tp % kv:
            raise ValueError(
                f"{where}: num_kv_heads={kv} and tp={self.tp} must divide one another "
                "(KV heads are split across tp, or replicated when there are fewer than tp); choose another tp"
            )
        all_axes = jax.tree.leaves(param_axes, is_leaf=is_axes)
        uses_experts = any("experts" in axes for axes in all_axes)
        if self.ep > 1 and not uses_experts:
            raise ValueError(f"{where}: ep={self.ep} but {config.architecture} has no experts; drop ep from the mesh or use tp/dp")
        # Unknown logical axis names fail now, not at the first step.
        jax.tree.map(logical_to_spec, param_axes, is_leaf=is_axes)
        self.source_config = config
        # With fewer KV heads than tp, each KV head is copied so every device owns one.
        self.kv_repeat = max(1, self.tp // kv)
        self.config = dataclasses.replace(config, num_kv_heads=kv * self.kv_repeat)
        if mesh_config is not None:
            # mesh_config(config, tp): a family of several KV geometries (Gemma 4's) gives the mesh's config itself and
            # places its KV heads in the step: its weights are split as loaded, never copied here.
            self.config, self.kv_repeat = mesh_config(config, self.tp), 1
        # The vocab is padded to a multiple of tp (zero rows/columns, cut off in lm_head).
        self.padded_vocab = math.ceil(config.vocab_size / self.tp) * self.tp

    @staticmethod
    def _check_divides(value: int, size: int, name: str, where: str):
        if value % size:
            raise ValueError(f"{where}: {name}={value} is not divisible by {size}; choose a mesh axis size that divides {value}")

    # ---- parameters -------------------------------------------------------------------

    def _transform(self, axes: tuple[str, ...], arr):
        """Host-side changes a weight needs for this mesh: KV-head copies, vocab padding.
        Shape-aware, so an already prepared weight passes through unchanged."""
        c = self.source_config
        needs_kv = self.kv_repeat > 1 and any(
            n == "kv_heads" and arr.shape[d] == c.num_kv_heads * c.head_dim for d, n in enumerate(axes))
        needs_vocab = any(n == "vocab" and arr.shape[d] == c.vocab_size != self.padded_vocab for d, n in enumerate(axes))
        if not (needs_kv or needs_vocab):
            return arr  # leave device arrays on the device
        arr = np.asarray(arr)
        for dim, name in enumerate(axes):
            if name == "kv_heads" and self.kv_repeat > 1 and arr.shape[dim] == c.num_kv_heads * c.head_dim:
                split = arr.reshape(arr.shape[:dim] + (c.num_kv_heads, c.head_dim) + arr.shape[dim + 1 :])
                # Consecutive copies keep query head i on KV head i // (num_heads / new_kv_heads).
                arr = np.repeat(split, self.kv_repeat, axis=dim).reshape(
                    arr.shape[:dim] + (-1,) + arr.shape[dim + 1 :]
                )
            if name == "vocab" and arr.shape[dim] == c.vocab_size != self.padded_vocab:
                pad = [(0, 0)] * arr.ndim
                pad[dim] = (0, self.padded_vocab - c.vocab_size)
                arr = np.pad(arr, pad)
        return arr

    def _mxfp4_spec(self, axes: tuple[str, ...], w: Mxfp4Weight, name: str) -> P:
        """The weight's spec for each of its fields, once its `in` axis splits at whole 32-row blocks."""
        spec = logical_to_spec(axes)
        split = spec[-2] if len(spec) >= 2 else None
        parts = math.prod(self.mesh.shape[a] for a in ((split,) if isinstance(split, str) else split or ()))
        if w.scales.shape[-2] % parts:
            raise ValueError(f"{name}: MXFP4 weights split their {w.shape[-2]} input rows over mesh axis {split!r} of "
                             f"size {parts} only at whole 32-row blocks ({w.scales.shape[-2]} here); choose a smaller "
                             f"{split}, or load the experts expanded (quantization=None)")
        return spec

    def _put(self, arr, spec: P, name: str = "weight"):
        if self.mesh is None:
            return jax.device_put(arr)
        for dim, axis in enumerate(spec):
            size = self.mesh.shape[axis] if axis else 1
            if arr.shape[dim] % size:
                raise ValueError(
                    f"{name} has shape {arr.shape}: dim {dim} ({arr.shape[dim]}) is split over mesh axis {axis!r} "
                    f"of size {size} but not divisible by it; choose a mesh whose {axis} size divides {arr.shape[dim]}"
                )
        sharding = NamedSharding(self.mesh, spec)
        if isinstance(arr, jax.Array):
            # Already on devices (e.g. restored from orbax into this mesh): keep it, or reshard on device.
            return arr if arr.sharding.is_equivalent_to(sharding, arr.ndim) else jax.device_put(arr, sharding)
        # make_array_from_callback works across processes: each one fills only its own shards.
        return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])

    def place(self, path: str, host_array):
        """Transform and place one weight as it streams in (jlight.loading.assemble's `place`).

        path: "embed", "lm_head", "final_norm", or "layers.<name>" for ONE layer's slice
        (the stacked `layers` axis dropped).
        """
        try:
            axes = _get_path(self.param_axes, path)
        except KeyError:
            raise ValueError(f"weight path {path!r} is not in the model's param_axes; expected e.g. 'embed' or 'layers.wq'") from None
        if path.startswith("layers."):
            axes = axes[1:]
        arr = self._transform(axes, host_array)
        return self._put(arr, logical_to_spec(axes), path)

    def prepare_params(self, params: dict) -> dict:
        """Apply the mesh's transforms and place every weight with its NamedSharding.
        Idempotent: already-prepared params are only re-placed."""
        if self.mesh is None:
            return params

        def prepare(path, axes, leaf):
            name = jax.tree_util.keystr(path)
            if isinstance(leaf, Mxfp4Weight):  # each field on the weight's axes: [.., in/2 | in/32 | r, out]
                spec = self._mxfp4_spec(axes, leaf, name)
                return Mxfp4Weight(*(self._put(field, spec, name) for field in leaf))
            if hasattr(leaf, "values") and hasattr(leaf, "scales"):  # QuantizedWeight
                values = self._transform(axes, leaf.values)
                scales = self._transform(axes[:-2] + axes[-1:], leaf.scales)
                return type(leaf)(self._put(values, logical_to_spec(axes), name),
                                  self._put(scales, logical_to_spec(axes[:-2] + axes[-1:]), name))
            return self._put(self._transform(axes, leaf), logical_to_spec(axes), name)

        return jax.tree_util.tree_map_with_path(prepare, self.param_axes, params, is_leaf=is_axes)

    # ---- KV cache ---------------------------------------------------------------------

    def _kv_spec(self, shape) -> P:
        """Llama pools [layers, pages, page_size, kv_heads, head_dim] split on kv_heads. A pool
        with one head (MLA's shared latent) or another rank is replicated across tp."""
        spec = P()
        if len(shape) == len(KV_CACHE_AXES) and shape[3] > 1:
            if shape[3] % self.tp:
                raise ValueError(f"KV pool shape {tuple(shape)} has {shape[3]} KV heads, not divisible by tp={self.tp}; build it from plan.config")
            spec = logical_to_spec(KV_CACHE_AXES)
        return P("dp", *spec) if self.dp > 1 else spec

    def _kv_specs(self, cache):
        """The spec (tree) of a pool as the step sees it: int8 QuantizedKV scales drop head_dim. A hybrid
        model's PagesAndState: its K pages' spec, its recurrent-state pools replicated (every device runs
        the recurrent layers whole)."""
        if isinstance(cache, PagesAndState):
            return PagesAndState(self._kv_specs(cache.pages), {name: P() for name in cache.state})
        shape = cache.shape[1:] if self.dp > 1 else cache.shape
        spec = self._kv_spec(shape)
        if isinstance(cache, QuantizedKV):
            return QuantizedKV(spec, scales_sharding(spec, len(cache.shape)))
        return spec

    def kv_cache_global_shapes(self, k_shape, v_shape):
        """The pool shapes to allocate: (dp, *shape) with dp > 1, else unchanged."""
        lead = (self.dp,) if self.dp > 1 else ()
        return lead + tuple(k_shape), lead + tuple(v_shape)

    def kv_cache_shardings(self, k_shape, v_shape):
        """NamedShardings for the K and V pools (shapes from kv_cache_shapes(plan.config, ...))."""
        if self.mesh is None:
            return None, None
        return NamedSharding(self.mesh, self._kv_spec(k_shape)), NamedSharding(self.mesh, self._kv_spec(v_shape))

    # ---- the step function ------------------------------------------------------------

    def make_ops(self, num_tokens: int, *, collective_matmul: bool, int8_all_reduce: bool, min_tokens: int) -> TensorParallelOps:
        """The ParallelOps for a step of `num_tokens` tokens (per replica)."""
        sequence_parallel = (
            collective_matmul and self.tp > 1 and num_tokens % (2 * self.tp) == 0 and num_tokens >= min_tokens
        )
        return TensorParallelOps(
            axis_name="tp", tp=self.tp, vocab_size=self.source_config.vocab_size, ep=self.ep,
            sequence_parallel=sequence_parallel, int8_all_reduce=int8_all_reduce,
        )

    def wrap(self, model_fn, *, collective_matmul: bool = True, int8_all_reduce: bool = False,
             collective_matmul_min_tokens: int = DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS):
        """model_fn(params, k_cache, v_cache, tokens[T], md, ops) -> (logits [B, vocab] f32, k_cache, v_cache)
        as fn(params, k_cache, v_cache, tokens, md): run under shard_map over the mesh, given the
        tensor-parallel ParallelOps; without a mesh, given plain `ParallelOps()`.

        collective_matmul: split the residual stream on tokens and use ring collective
        matmuls when the step has >= collective_matmul_min_tokens tokens divisible by 2*tp.
        int8_all_reduce: the remaining all-reduces (e.g. decode steps) move int8.
        """
        if self.mesh is None:
            return functools.partial(model_fn, ops=ParallelOps())
        dp = self.dp
        batch_spec = P("dp") if dp > 1 else P()

        def per_device(params, k_cache, v_cache, tokens, md):
            if dp > 1:  # drop the local replica axis (size 1)
                tokens, md, k_cache, v_cache = jax.tree.map(lambda a: a[0], (tokens, md, k_cache, v_cache))
            ops = self.make_ops(tokens.shape[0], collective_matmul=collective_matmul,
                                int8_all_reduce=int8_all_reduce, min_tokens=collective_matmul_min_tokens)
            logits, k_cache, v_cache = model_fn(params, k_cache, v_cache, tokens, md, ops)
            if dp > 1:
                logits, k_cache, v_cache = jax.tree.map(lambda a: a[None], (logits, k_cache, v_cache))
            return logits, k_cache, v_cache

        def fn(params, k_cache, v_cache, tokens, md):
            specs = param_specs(self.param_axes, params)
            k_spec, v_spec = self._kv_specs(k_cache), self._kv_specs(v_cache)
            sharded = jax.shard_map(
                per_device, mesh=self.mesh,
                in_specs=(specs, k_spec, v_spec, batch_spec, batch_spec),
                out_specs=(batch_spec, k_spec, v_spec),
                check_vma=False,  # collectives are explicit; logits are replicated by all_gather
            )
            return sharded(params, k_cache, v_cache, tokens, md)

        return fn
