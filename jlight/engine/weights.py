"""The loaded weights made ready for the engine's step: quantized, sharded, unrolled, fused and
laid out K-major, as the EngineConfig asks, freeing the engine's own copies as it goes."""
from __future__ import annotations

import jax

from jlight.core.quantization import QUANTIZABLE, transpose_to_kmajor
from jlight.engine.engine_config import EngineConfig
from jlight.loading.default_model import cache_dir
from jlight.models.layers import FUSED_PROJECTIONS
from jlight.models.module import Layout
from jlight.pallas_kernels import cpu_ffi
from jlight.pallas_kernels.dispatch import kmajor_weight_types
from jlight.quantization.rtn import quantize_unless_stored
from jlight.sharding.plan import ShardingPlan


def prepare_params(cfg: EngineConfig, family, loaded, mesh, gpu: bool, owns_weights: bool = False,
                   given: bool = False):
    """Quantize, shard, unroll and fuse the loaded weights as the config asks. Returns (params, plan);
    a plan's config is the model config the engine runs (e.g. KV heads replicated up to tp).
    owns_weights: the weights are this engine's own load, or given to it, so their parts may be freed as they go.
    given: they were handed over (LLMEngine(give_weights=True)) as one stacked tree."""
    params = loaded.params
    params = quantize_unless_stored(params, cfg.quantization)
    plan = None
    if mesh is not None:
        # A family whose mesh changes its model config (Gemma 4: KV heads per kind up to tp) passes mesh_config.
        mesh_config = getattr(family, "mesh_config", None)
        plan = ShardingPlan(mesh, loaded.config, family.param_axes(loaded.config), mesh_config=mesh_config)
        if plan.dp > 1:
            raise ValueError(f"mesh={cfg.mesh!r}: an LLMEngine runs one replica; use make_engine (jlight.LLM) for dp > 1")
        params = plan.prepare_params(params)
    unrolled = unrolls(cfg, family, gpu)
    split_here = unrolled and not isinstance(params.get("layers"), list)  # else loaded per layer (load_model(unstacked=True)); hybrid groups: models/hybrid.py
    if split_here:
        # Donating the stacked copy keeps the peak near one copy of the weights (a bf16
        # Mixtral-8x7B, 93 GB, fits one H200 only that way). Given weights split on a GPU go through
        # host memory, so that the free memory the KV pool is sized from stays one block: split on
        # the device, gpt-oss-20b's random weights (42 GB on an 80 GB card) left no block for its
        # pool. It costs the time of a copy out at numpy's rate (1.7 GB/s on the H200), so a load
        # of the engine's own splits on the device as before. Sharded weights keep their shardings
        # when split, and a plan over the per-layer tree runs them under the mesh.
        params = family.unstack_layers(params, donate=owns_weights, through_host=given and gpu)
        jax.block_until_ready(params)
        if plan is not None:
            plan = ShardingPlan(mesh, plan.source_config, family.param_axes(plan.source_config, Layout(unrolled=True)),
                                mesh_config=mesh_config)
    if plan is None and cfg.fuse_projections and hasattr(family, "fuse_projections"):
        # Per-layer weights split here are this engine's own copies, so their parts are freed as they
        # are fused; a caller's weights are left intact.
        params = dict(params, layers=family.fuse_projections(params["layers"], delete_parts=split_here or owns_weights))
    kmajor = kmajor_weight_types(cfg.matmul_impl)
    if plan is None and kmajor:
        # The linear weights K-major where their matmul reads them faster so. The [in, out] copies
        # are freed as they go when they are this engine's own (quantized here, or loaded by it).
        params = transpose_to_kmajor(params, kmajor, names=QUANTIZABLE + tuple(FUSED_PROJECTIONS),
                                     delete_source=owns_weights or bool(cfg.quantization))
    if owns_weights:
        loaded.params = None  # the loaded tree (stacked, unfused) is spent; a caller's LoadedModel keeps its params
    return params, plan


def unrolls(cfg: EngineConfig, family, gpu: bool) -> bool:
    """Whether the step runs its layers unrolled over per-layer weights (EngineConfig.layer_loop), for a
    family that can (family None: before the model, so its family, is known)."""
    unroll = cfg.layer_loop != "scan"  # "auto": unrolled on every backend
    return unroll and (family is None or hasattr(family, "unstack_layers"))


def cpu_kernels_ready(cfg: EngineConfig, mesh, gpu: bool) -> bool:
    """Whether jlight's C++ CPU kernels run this engine's small steps (EngineConfig.cpu_kernel_max_rows): on
    the CPU, one device, and the kernels' library built (once per machine, into jlight's cache) and loaded."""
    return bool(cfg.cpu_kernel_max_rows) and not gpu and mesh is None and cpu_ffi.load(cache_dir())


def cpu_kernel_rows(cfg: EngineConfig, mesh, gpu: bool) -> dict:
    """dispatch.get_kernels' row limits of the C++ CPU kernels for this engine (0 where they do not run)."""
    ready = cpu_kernels_ready(cfg, mesh, gpu)
    return {"cpu_kernel_max_rows": cfg.cpu_kernel_max_rows if ready else 0,
            "gguf_kernel_max_rows": cfg.gguf_kernel_max_rows if ready else 0}


def keeps_gguf_blocks(cfg: EngineConfig, mesh, gpu: bool) -> bool:
    """Whether the engine loads a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K linear weights as stored
    (EngineConfig.gguf_weights "auto"): a GGUF model, no quantization asked, and the CPU kernels ready."""
    gguf = cfg.model is None or str(cfg.model).endswith(".gguf")
    if cfg.gguf_weights != "auto" or not gguf or cfg.quantization:
        return False
    return cpu_kernels_ready(cfg, mesh, gpu)
