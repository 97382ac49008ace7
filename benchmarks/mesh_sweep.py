"""Time one model on several meshes: decode latency at batch 1, decode throughput at batch 64,
and time to first token (one prefill step) of a 2048-token prompt.

  python benchmarks/mesh_sweep.py --model-config llama3-8b --meshes tp=1 tp=2 "dp=2,tp=4" --out DIR
  python benchmarks/mesh_sweep.py --model-config llama3-70b --num-layers 40 --meshes tp=1,tp=2 \\
      --collective-matmul 1 0 --int8-all-reduce 0 1 --out DIR        # tp=2 also with each variant
  python benchmarks/mesh_sweep.py --model-config deepseek-v3 --num-layers 7 --meshes ep=1 ep=2 tp=2 --out DIR
  python benchmarks/mesh_sweep.py --model-config tiny --meshes tp=1,tp=2 --quick   # CPU smoke run

Any model family runs (jlight.models.get_model_family): the Llama shapes and the MoE shapes
(Mixtral, DeepSeek-V3: MLA + routed experts) of benchmarks/model_configs.py. --num-layers cuts
the layer count (DeepSeek keeps its first --num-dense-layers dense, by default the real model's 3).

`--meshes tp=1,tp=2` is read as two meshes (a repeated axis starts a new mesh); quote
"dp=2,tp=4" for one mesh with two axes. A mesh smaller than the machine uses the first
devices. Weights are random (bfloat16 unless --dtype), made leaf by leaf directly in their
sharding and in the layer loop's layout (--layer-loop: per-layer weights, unrolled, as the
engine runs one GPU; or stacked under lax.scan); only timings matter.

Each figure is the median of --trials jitted steps after a first (compiling) call, timed on the
host after block_until_ready; `*_pipelined_ms` is --trials steps launched back to back divided
by --trials (host dispatch overlapped, as in the engine); `*_first_call_s` is the compile call.
--collective-matmul and --int8-all-reduce take several values: every mesh with tp > 1 runs each
combination (the first one first); a step whose tensor-parallel ops come out the same as an
already timed combination's (collective matmul only applies to steps of >= 256 tokens, int8
all-reduce only where collective matmul does not) reuses that timing (`same_as` says which).
A mesh or step that fails (out of memory, a compile error) is recorded as an error and the
sweep goes on. With dp > 1 each replica runs the batch, so the throughput column counts
dp x batch tokens per step. Writes --out/<--name>.json after every timed step (and a PNG at
the end when matplotlib is installed and --plot is on).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jlight.core.config import ModelConfig
from jlight.models import get_model_family
from jlight.models.module import Layout
from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels.dispatch import get_kernels
from jlight.sharding.mesh import make_mesh, parse_mesh_spec
from jlight.sharding.plan import DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS, ShardingPlan
from jlight.sharding.rules import logical_to_spec
from harness import result_header
from model_configs import CONFIG_NAMES, HF_CONFIGS, make_config

PAGE_SIZE = 16
STEPS = ("decode_b1", "decode_batch", "ttft")


def split_meshes(args: list[str]) -> list[str]:
    """["tp=1,tp=2", "dp=2,tp=4"] -> ["tp=1", "tp=2", "dp=2,tp=4"]: a repeated axis starts a new mesh."""
    meshes = []
    for arg in args:
        current: list[str] = []
        for part in (p.strip() for p in arg.replace(";", ",").split(",") if p.strip()):
            axis = part.split("=")[0].strip()
            if any(c.split("=")[0].strip() == axis for c in current):
                meshes.append(",".join(current))
                current = []
            current.append(part)
        if current:
            meshes.append(",".join(current))
    for m in meshes:
        parse_mesh_spec(m)  # fail early with the spec's own message
    return meshes


def decode_batch(batch: int, context: int, max_pages: int) -> BatchMetadata:
    """One decode token per sequence at position context - 1. Sequence b owns pages
    1 + b*ctx_pages ... (ctx_pages = the pages its context needs); the rest of its max_pages-wide
    page-table row points at scratch page 0, as the engine leaves unused entries."""
    ctx_pages = math.ceil(context / PAGE_SIZE)
    pages = np.zeros((batch, max_pages), np.int32)  # [B, max_pages]
    pages[:, :ctx_pages] = 1 + np.arange(batch * ctx_pages, dtype=np.int32).reshape(batch, ctx_pages)
    pos = np.full(batch, context - 1, np.int32)
    return BatchMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(pages[:, (context - 1) // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE),
        token_seq=jnp.arange(batch, dtype=jnp.int32), page_table=jnp.asarray(pages),
        context_lens=jnp.full(batch, context, jnp.int32), query_start=jnp.arange(batch + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(batch, dtype=jnp.int32),
    )


def prefill_batch(prompt: int, max_pages: int) -> BatchMetadata:
    """One fresh sequence of `prompt` tokens on pages 1..max_pages."""
    pages = 1 + np.arange(max_pages, dtype=np.int32)[None]  # [1, max_pages]
    pos = np.arange(prompt, dtype=np.int32)
    return BatchMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(pages[0, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE),
        token_seq=jnp.zeros(prompt, jnp.int32), page_table=jnp.asarray(pages),
        context_lens=jnp.asarray([prompt], jnp.int32), query_start=jnp.asarray([0, prompt], jnp.int32),
        logits_indices=jnp.asarray([prompt - 1], jnp.int32),
    )


def random_weights(shapes: dict, axes: dict, mesh, dtype, seed: int = 0):
    """Random weights, leaf by leaf, each made by a jitted function straight into its sharding and
    dtype (no float32 or host copy). Normal(0, 1/fan_in) matrices, ones for norms; one compile per
    distinct (shape, sharding), so 80 unrolled layers cost a handful of compiles."""

    @functools.lru_cache(maxsize=None)
    def maker(shape, spec, norm: bool):
        if norm:
            fn = lambda key: jnp.ones(shape, dtype)  # noqa: E731
        else:
            scale = 1.0 / math.sqrt(shape[-2] if len(shape) >= 2 else shape[-1])
            fn = lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)  # noqa: E731
        return jax.jit(fn, out_shardings=NamedSharding(mesh, spec)) if mesh is not None else jax.jit(fn)

    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))
    key = jax.random.PRNGKey(seed)
    leaves = []
    for i, ((path, shape), leaf_axes) in enumerate(zip(flat, flat_axes)):
        norm = "norm" in jax.tree_util.keystr(path)
        leaves.append(maker(tuple(shape), logical_to_spec(leaf_axes), norm)(jax.random.fold_in(key, i)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def bytes_on(tree, device) -> int:
    """Bytes of `tree`'s shards held by `device`."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


def memory_gb(device, key: str):
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return round(stats[key] / 1e9, 2) if stats and key in stats else None


def error_text(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def time_step(step, params, caches: list, tokens, md, trials: int) -> dict:
    """Times one step shape. caches: [k, v], donated into every call and replaced by its outputs."""
    t = time.perf_counter()
    out = jax.block_until_ready(step(params, *caches, tokens, md))
    first = time.perf_counter() - t
    caches[:] = out[1:]
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        out = jax.block_until_ready(step(params, *caches, tokens, md))
        times.append(time.perf_counter() - t)
        caches[:] = out[1:]
    t = time.perf_counter()
    for _ in range(trials):  # back to back: the host launches the next step while the device runs
        out = step(params, *caches, tokens, md)
        caches[:] = out[1:]
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - t) / trials
    finite = bool(np.isfinite(np.asarray(out[0], np.float32)).all())
    return {"ms": 1e3 * statistics.median(times), "pipelined_ms": 1e3 * pipelined, "first_call_s": first, "finite": finite}


def step_cases(a) -> list[tuple[str, int, int]]:
    """(row key prefix, batch rows, tokens) of each step shape asked for by --steps."""
    cases = {"decode_b1": ("decode_b1", 1, 1), "decode_batch": (f"decode_b{a.batch}", a.batch, a.batch),
             "ttft": (f"ttft_{a.prompt_len}", 1, a.prompt_len)}
    return [cases[s] for s in a.steps]


def comm_label(cm: int, i8: int) -> str:
    return f"cm={cm},i8={i8}"


def build(spec: str, config: ModelConfig, dtype, a):
    """The model on one mesh: (plan, model_fn, params, new_caches, facts for the rows)."""
    sizes = parse_mesh_spec(spec)
    count = math.prod(sizes.values())
    if count > jax.device_count():
        raise ValueError(f"mesh {spec!r} needs {count} devices; this machine has {jax.device_count()}")
    mesh = make_mesh(spec, jax.devices()[:count]) if count > 1 else None
    family = get_model_family(config)
    plan = ShardingPlan(mesh, config, family.param_axes(config))
    # The plan's layout (KV heads replicated up to tp, vocab padded to a multiple of tp), stacked or per layer.
    layout = dataclasses.replace(plan.config, vocab_size=plan.padded_vocab)
    # The stacked trees, or one tree per layer (the `layers` axis dropped) as family.unstack_layers makes them.
    per_layer = Layout(unrolled=a.layer_loop == "unroll")
    shapes, axes = family.param_shapes(layout, per_layer), family.param_axes(layout, per_layer)
    plan = ShardingPlan(mesh, config, axes)  # the same plan, over the params tree as laid out
    t = time.perf_counter()
    params = jax.block_until_ready(random_weights(shapes, axes, mesh, dtype))
    init_s = time.perf_counter() - t
    kernels = get_kernels(a.attention_impl, a.matmul_impl, a.moe_impl, sharded=True)  # as the engine under a mesh

    def model_fn(p, k, v, tokens, md, ops):
        hidden, k, v = family.forward(p, plan.config, tokens, k, v, md, kernels, ops)
        return family.compute_logits(p, plan.config, hidden[md.logits_indices], kernels, ops), k, v

    num_pages = 1 + max(a.batch * math.ceil(a.context / PAGE_SIZE), math.ceil(a.prompt_len / PAGE_SIZE))  # 0: scratch
    k_shape, v_shape = family.kv_cache_shapes(plan.config, num_pages, PAGE_SIZE)
    k_sh, v_sh = plan.kv_cache_shardings(k_shape, v_shape)
    k_shape, v_shape = plan.kv_cache_global_shapes(k_shape, v_shape)  # (dp, ...) when dp > 1

    def new_caches() -> list:
        def zeros(shape, sharding):
            fn = lambda: jnp.zeros(shape, dtype)  # noqa: E731
            return (jax.jit(fn, out_shardings=sharding) if sharding is not None else jax.jit(fn))()
        return [zeros(k_shape, k_sh), zeros(v_shape, v_sh)]

    dev0 = jax.devices()[0]
    facts = {"mesh": spec, "devices": count, "layer_loop": a.layer_loop, "init_s": round(init_s, 2),
             "param_gb_per_device": round(bytes_on(params, dev0) / 1e9, 2), "kv_pages": num_pages}
    return plan, model_fn, params, new_caches, facts


def run_mesh(spec: str, config: ModelConfig, dtype, a, emit) -> None:
    """Times every step shape on one mesh, for each comm combination when tp > 1: one row per
    combination, passed to emit(row) after each timed step and when complete."""
    plan, model_fn, params, new_caches, facts = build(spec, config, dtype, a)
    dev0 = jax.devices()[0]
    caches = new_caches()
    facts.update(kv_gb_per_device=round(bytes_on(caches, dev0) / 1e9, 2), device0_in_use_gb=memory_gb(dev0, "bytes_in_use"))
    print(f"{spec}: weights {facts['param_gb_per_device']} GB + KV {facts['kv_gb_per_device']} GB on device 0 "
          f"(made in {facts['init_s']:.1f} s)", flush=True)
    max_pages = max(math.ceil(a.context / PAGE_SIZE), math.ceil(a.prompt_len / PAGE_SIZE))  # page-table width
    combos = list(itertools.product(a.collective_matmul, a.int8_all_reduce))
    if plan.tp == 1:
        combos = combos[:1]  # no tensor-parallel collectives to vary

    def record_step(row, name, figures):
        row.update({f"{name}_{k}": v for k, v in figures.items()})
        if name == f"decode_b{a.batch}":
            row[f"{name}_tok_s"] = plan.dp * a.batch / (figures["ms"] / 1e3)

    timed = {}  # (step, sequence parallel, int8 all-reduce in effect) -> (figures, comm label)
    for cm, i8 in combos:
        row = dict(facts, collective_matmul=cm if plan.tp > 1 else None, int8_all_reduce=i8 if plan.tp > 1 else None)
        row["label"] = spec + (f" {comm_label(cm, i8)}" if plan.tp > 1 else "")
        step = jax.jit(plan.wrap(model_fn, collective_matmul=bool(cm), int8_all_reduce=bool(i8)), donate_argnums=(1, 2))
        for name, batch, num_tokens in step_cases(a):
            ops = plan.make_ops(num_tokens, collective_matmul=bool(cm), int8_all_reduce=bool(i8),
                                min_tokens=DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS)
            key = (name, ops.sequence_parallel, bool(ops.int8_all_reduce and not ops.sequence_parallel and plan.tp > 1))
            if key in timed:  # the same collectives as a combination already timed
                figures, label = timed[key]
                record_step(row, name, figures)
                row.setdefault("same_as", {})[name] = label
                continue
            md = decode_batch(batch, a.context, max_pages) if name.startswith("decode") else prefill_batch(a.prompt_len, max_pages)
            tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, num_tokens), jnp.int32)
            if plan.dp > 1:  # every replica runs the same-sized batch (so throughput counts dp x batch)
                tokens, md = jax.tree.map(lambda x: jnp.stack([x] * plan.dp), (tokens, md))
            try:
                if any(c.is_deleted() for c in jax.tree.leaves(caches)):  # donated into a call that failed
                    caches = new_caches()
                figures = time_step(step, params, caches, tokens, md, a.trials)
            except Exception as e:  # noqa: BLE001 - out of memory / compile failure: a result too
                row[f"{name}_error"] = error_text(e)
                print(f"{row['label']} {name} FAILED {row[f'{name}_error']}", flush=True)
                continue
            timed[key] = (figures, comm_label(cm, i8))
            record_step(row, name, figures)
            row["device0_peak_gb"] = memory_gb(dev0, "peak_bytes_in_use")  # process peak so far
            emit(row)  # after every step, so a run cut short by its timeout keeps what it measured
            print(f"{row['label']} {name}: {figures['ms']:.2f} ms (pipelined {figures['pipelined_ms']:.2f} ms, "
                  f"first call {figures['first_call_s']:.1f} s)", flush=True)
        emit(row)


def plot(results: list[dict], keys: list[str], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5))
    for ax, key in zip(np.atleast_1d(axes), keys):
        ax.bar([r.get("label", r["mesh"]) for r in results], [r.get(key, float("nan")) for r in results])
        ax.set_title(key)
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="tiny", choices=CONFIG_NAMES)
    ap.add_argument("--num-layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--num-dense-layers", type=int, default=None,
                    help="DeepSeek: how many of the first layers are dense (default: the real model's 3, at most num_layers - 1)")
    ap.add_argument("--meshes", nargs="+", default=["tp=1"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="mesh_sweep", help="file stem of the JSON (and PNG) in --out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="KV length of the decode steps")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS,
                    help="step shapes to time (decode_batch: --batch sequences)")
    ap.add_argument("--collective-matmul", type=int, nargs="+", default=[1], choices=[0, 1])
    ap.add_argument("--int8-all-reduce", type=int, nargs="+", default=[0], choices=[0, 1])
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"],
                    help="auto: unroll on GPU (the engine's one-device GPU default), scan elsewhere")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--moe-impl", default="auto")
    ap.add_argument("--plot", type=int, default=1, help="0: no PNG")
    ap.add_argument("--quick", action="store_true", help="CPU smoke sizes: batch 8, context 64, prompt 256, 3 trials")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.context, a.prompt_len, a.trials = 8, 64, 256, 3
    if a.layer_loop == "auto":
        a.layer_loop = "unroll" if jax.default_backend() == "gpu" else "scan"
    # Llama shapes: positions up to the prompt; MoE shapes keep their HF max_position_embeddings (YaRN uses it).
    config = make_config(a.model_config, None if a.model_config in HF_CONFIGS else max(8192, a.prompt_len),
                         num_layers=a.num_layers, num_dense_layers=a.num_dense_layers)
    meshes = split_meshes(a.meshes)
    dtype = jnp.dtype(a.dtype)
    family = get_model_family(config)
    num_params = sum(math.prod(s) for s in jax.tree.leaves(family.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))
    num_dense = config.extra.get("first_k_dense_replace")
    layers_text = f"{config.num_layers} layers" + (f" ({num_dense} dense)" if num_dense is not None else "")
    title = (f"model {a.model_config}, {layers_text}, {num_params / 1e9:.2f}B params ({a.dtype}), layer loop {a.layer_loop}, "
             f"{jax.devices()[0].device_kind} x{jax.device_count()}, context {a.context}")
    print(title, flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.name}.json")
    record = {**result_header(), "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
              "model_config": a.model_config, "family": config.family, "num_layers": config.num_layers,
              "num_dense_layers": num_dense, "num_params_b": round(num_params / 1e9, 3), "layer_loop": a.layer_loop,
              "args": vars(a), "complete": False, "results": []}

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    def emit(row):
        """Record `row` (again, if it is the row in progress) and rewrite the JSON."""
        if not record["results"] or record["results"][-1] is not row:
            record["results"].append(row)
        save()

    save()  # a run killed before its first step still leaves its settings

    for spec in meshes:
        try:
            run_mesh(spec, config, dtype, a, emit)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory making the weights: record, go on
            emit({"mesh": spec, "label": spec, "error": error_text(e)})
            print(f"{spec} FAILED {error_text(e)}", flush=True)
        gc.collect()  # the mesh's weights and KV pools go before the next mesh makes its own
        print(f"done {spec}", flush=True)
    record["complete"] = True
    save()
    keys = [f"{s}_ms" for s, _, _ in step_cases(a)]
    if "decode_batch" in a.steps:
        keys.insert(keys.index(f"decode_b{a.batch}_ms") + 1, f"decode_b{a.batch}_tok_s")
    print(f"\n{title}, moe_impl {a.moe_impl}")
    print(f"{'mesh':<22}" + "".join(f"{k:>20}" for k in keys))
    for r in record["results"]:
        if "error" in r:
            print(f"{r['label']:<22}  ERROR {r['error']}")
            continue
        cells = [f"{r[k]:>20.2f}" if k in r else f"{'ERR' if k.replace('_ms', '_error') in r else '-':>20}" for k in keys]
        print(f"{r['label']:<22}" + "".join(cells))
    print(f"wrote {path}")
    if a.plot and not plot(record["results"], keys, os.path.join(a.out, f"{a.name}.png")):
        print("(matplotlib not installed: no PNG written)")


if __name__ == "__main__":
    main()
