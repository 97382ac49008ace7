"""W8A16 for decode on Pallas' Mosaic GPU backend: a few token rows times K-major int8 weights.

A decode step multiplies a handful of rows (the engine's 8-token bucket at batch 1) by every weight
of the model once, so the step's time is the time to read the weights. This kernel computes the
product transposed, out^T [out, M] = W [out, in] . x^T [in, M], so that the int8 weight tile is the
wgmma's 64-row operand and the M token rows its N columns. Each step TMA-copies a [64, tile_k] int8
weight tile and the matching slice of x into one of `num_stages` shared-memory slots; the slots
keep the copies of later steps in flight while a step is multiplied. Two ways to multiply:

- bf16 activations (`int8_activations=False`): the int8 tile is loaded into registers, converted
  to x's dtype (exact) and fed to the wgmma as its register operand. The next step's tile lands in
  the same registers, so each wgmma is waited for before the loop comes round.
- int8 activations (`int8_activations=True`): x is split in XLA into two int8 terms per element
  (split_int8: 16 bits against the row's largest element, where bf16 keeps 8 of each element), and
  an int8 wgmma reads both operands from shared memory. No register work per weight byte; one
  wgmma stays in flight. The W q1 and W q2 sums are exact in int32 and combined in float32 after.

Work is cut into units of 64 output channels x one of `num_splits` ranges of `in`. The grid is one
persistent program per SM slot (`ctas_per_sm` per SM), each taking a contiguous run of units, and
its slots stream straight across unit boundaries, so a program's pipeline fills once. Split-K (for
layers with few output tiles) writes float32 partial sums [splits, rows, out], added and scaled in
XLA; with one split and bf16 activations the kernel applies the scales and writes [M, out] itself.
Both are written transposed from the accumulator straight to global memory (no transpose after).

Measured on the H200 (2026-12-01, docs/BENCHMARKS.md "ninth session"): alone, the int8-activation
kernel is 5-15% faster than XLA's dequantize-dot at 8 rows at four of the five Llama-3-8B decode
shapes, and 1.2-1.4x at 16 and 32 rows; in the engine it is not faster (batch-1 decode 3.21 against
2.91 ms of device time, offline serving at 32 sequences 1,650 against 1,962 output tok/s), because
the activation split and the partial sums add kernels around it. So the engine does not use it by
default (matmul_pallas.MOSAIC_W8A16_MAX_ROWS = 0); benchmarks switch it on.

`pdl=True` launches it with programmatic dependent launch: the first slots' weight copies are issued
before it waits for the kernel before it (which writes x). On the H200 that gained nothing in the decode
step (3.705 against 3.675 ms a step back to back, tenth session): the small matmuls lose their time to
ramp-up and tail inside the kernel, not to the launch. It stays off, for a fused kernel to build on.

CPU tests run it in Mosaic GPU's interpret mode (TMA copies, barriers, slots, race detector), where
the wgmma is a plain dot on the same tiles, and lower the real path for CUDA.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.pallas_kernels import pallas_mode
from jlight.pallas_kernels.mosaic_common import interpret_params, swizzled_smem
from jlight.core.quantization import QuantizedWeightT
from jlight.pallas_kernels.tiling import NUM_SMS

_ROWS = 64  # output channels per unit: the wgmma's M
MAX_ROWS = 64  # token rows (the wgmma's N, a multiple of 8)


def supports(x, w) -> bool:
    """Whether this kernel takes x [..., in] times w (else XLA's dequantize-dot does)."""
    if not isinstance(w, QuantizedWeightT) or w.values_t.ndim != 2 or w.values_t.dtype != jnp.int8:
        return False
    rows = x.size // x.shape[-1] if x.ndim else 0
    out, k = w.values_t.shape
    return (x.dtype in (jnp.bfloat16, jnp.float16) and 0 < rows <= MAX_ROWS and rows % 8 == 0
            and out % _ROWS == 0 and k % 128 == 0)


def _w8a16_mosaic_kernel(*refs, num_units, num_programs, num_splits,
                         steps_per_unit, tile_k, num_stages, int8_activations, pdl, interpreting):
    # x's parts (x, or the two int8 terms q1 and q2), the weights and scales, the output, then scratch
    *x_refs, w_ref, s_ref, out_ref, x_smem, w_smem, bars = refs
    num_rows = x_refs[0].shape[0]
    program = lax.axis_index("program")
    first_unit = program * num_units // num_programs
    my_units = (program + 1) * num_units // num_programs - first_unit
    my_steps = my_units * steps_per_unit

    def issue(step, slot, weights=True, activations=True):  # TMA the program's step-th tiles into the slot
        unit = first_unit + step // steps_per_unit
        k_block = (unit % num_splits) * steps_per_unit + step % steps_per_unit
        cols = pl.ds(k_block * tile_k, tile_k)
        if weights:
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((unit // num_splits) * _ROWS, _ROWS), cols], w_smem.at[slot],
                                    bars.at[slot])
        if activations:
            for i, x_ref in enumerate(x_refs):  # the parts stack on the slot's rows
                plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_smem.at[slot, pl.ds(i * num_rows, num_rows)],
                                        bars.at[slot])

    def refill(step):  # the step's slot is read: fetch a later step into it
        @pl.when(step + num_stages < my_steps)
        def _():
            issue(step + num_stages, lax.rem(step, num_stages))

    pdl = pdl and not interpreting
    for s in range(num_stages):  # with pdl, the weights only: they do not depend on the kernel before
        @pl.when(s < my_steps)
        def _():
            issue(s, s, activations=not pdl)
    if pdl:
        # Programmatic dependent launch: this kernel may start while the one before it (which writes x)
        # still runs, so the first slots' weight copies overlap its tail. Wait for it before reading x,
        # then let the next kernel launch (it waits for this one's end before reading the output).
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
        for s in range(num_stages):
            @pl.when(s < my_steps)
            def _():
                issue(s, s, weights=False)

    acc_shape = (_ROWS, num_rows * len(x_refs))  # [channels, token rows (of each part)]
    acc_dtype = jnp.int32 if int8_activations else jnp.float32

    def step_body(acc_ref, step, first_of_unit):
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(bars.at[slot])
        if interpreting:
            w = w_smem[slot] if int8_activations else w_smem[slot].astype(x_smem.dtype)
            acc_ref[...] += jnp.dot(w, x_smem[slot].T, preferred_element_type=acc_dtype)
            plgpu.commit_smem()  # the dot read the slot through the generic proxy; the TMA refill writes it
            refill(step)
            return
        if int8_activations:
            # Both operands from shared memory, where only TMA writes and the wgmma reads (the async
            # proxy): one wgmma in flight, so the previous step's is done and its slot can be refilled.
            plgpu.wgmma(acc_ref, w_smem.at[slot], plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
            plgpu.wgmma_wait(1)

            @pl.when(jnp.logical_not(first_of_unit))  # the previous unit's last slot is refilled after its loop
            def _():
                refill(step - 1)
            return
        # 2-byte loads straight into the wgmma layout (4-byte loads moved between lanes afterwards, the
        # WGMMA_UPCAST_2X layout, were 4-8% slower on the H200), converted to x's dtype (exact)
        w = plgpu.load(w_smem.at[slot], (), layout=plgpu.Layout.WGMMA).astype(x_smem.dtype)
        plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
        # Wait for this wgmma before the loop comes round: the next step's converted tile lands in the
        # same registers, which an in-flight wgmma still reads (with one wgmma left in flight, on the
        # H200 results came out wrong whenever two programs shared an SM).
        plgpu.wgmma_wait(0)
        refill(step)

    def unit_body(u, carry):
        unit = first_unit + u
        first = u * steps_per_unit

        def unit_scope(acc_ref):
            if interpreting:
                acc_ref[...] = jnp.zeros(acc_shape, acc_dtype)

            @pl.loop(0, steps_per_unit)
            def _(kk):
                step_body(acc_ref, first + kk, kk == 0)
            return acc_ref[...]  # waits for the last wgmma

        alloc = plgpu.SMEM(acc_shape, acc_dtype) if interpreting else plgpu.ACC(acc_shape, acc_dtype)
        acc = pl.run_scoped(unit_scope, alloc)
        if int8_activations and not interpreting:
            refill(first + steps_per_unit - 1)
        channels = pl.ds((unit // num_splits) * _ROWS, _ROWS)
        if num_splits == 1 and not int8_activations:  # scale per output channel here; the output is final
            scales = s_ref[channels] if interpreting else plgpu.load(
                s_ref.at[channels], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            acc = acc * lax.broadcast_in_dim(scales, acc_shape, [0])
            dst = out_ref.at[:, channels]
        else:
            dst = out_ref.at[unit % num_splits, :, channels]
        value = acc.astype(out_ref.dtype)
        if interpreting:
            dst[...] = value.T
        else:  # [channels, rows] registers into [rows, channels] global memory
            if int8_activations:
                value = plgpu.layout_cast(value, plgpu.Layout.WGMMA)
            value = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(dst, (1, 0))[...] = value
        return carry

    lax.fori_loop(0, my_units, unit_body, 0)


def split_int8(x):
    """x [M, K] as two int8 terms per element, x ~= s1 * q1 + s2 * q2 (per row: s1 = max|x| / 127,
    s2 = s1 / 254): (q1, q2), each [M, K] int8 (the kernel stacks them in its slots, so no
    concatenation runs in XLA), and their scales [2M] float32 (s1's rows, then s2's).
    The second term holds the first's rounding error, so the pair is within max|x| / 64516 of x
    (16 bits against the row's largest element; bf16 itself keeps 8 bits of each element)."""
    xf = x.astype(jnp.float32)
    s1 = jnp.max(jnp.abs(xf), axis=1, keepdims=True) / 127.0
    s1 = jnp.where(s1 > 0, s1, 1.0)
    q1 = jnp.clip(jnp.round(xf / s1), -127, 127)
    s2 = s1 / 254.0
    q2 = jnp.clip(jnp.round((xf - q1 * s1) / s2), -127, 127)
    return (q1.astype(jnp.int8), q2.astype(jnp.int8)), jnp.concatenate([s1, s2])[:, 0]


def _choose_splits(num_tiles: int, k_blocks: int, num_programs: int) -> int:
    """Fewest splits of `in` that give every program a unit (or, past that, that keep the programs'
    unit counts within ~10% of each other), among those that divide the k blocks."""
    best = 1
    for splits in range(1, k_blocks + 1):
        if k_blocks % splits:
            continue
        units = num_tiles * splits
        best = splits
        per_program = -(-units // num_programs)
        if units >= num_programs and units / (per_program * num_programs) >= 0.9:
            break
    return best


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tile_k", "num_stages", "num_splits",
                                             "ctas_per_sm", "num_sms", "int8_activations", "pdl"))
def w8a16_mosaic_matmul(x, w: QuantizedWeightT, out_dtype=None, *, interpret=None, tile_k: int = 256,
                        num_stages: int = 4, num_splits: int | None = None, ctas_per_sm: int = 1,
                        num_sms: int = NUM_SMS, int8_activations: bool = False, pdl: bool = False):
    """x [M, in] (bf16/f16, M a multiple of 8 up to MAX_ROWS) times int8 w.values_t [out, in] * w.scales
    [out] -> [M, out] in out_dtype (default x's). Same result as matmul_reference.matmul up to the
    order of the float32 sums (and, with int8_activations, x's two-term split: split_int8). pdl: start the
    weight copies before waiting for the kernel that wrote x (programmatic dependent launch; ignored when
    interpreting)."""
    out_dtype = out_dtype or x.dtype
    if not supports(x, w):
        raise ValueError(f"w8a16_mosaic_matmul does not take x {x.dtype}{x.shape} with int8 weights "
                         f"{getattr(w, 'values_t', w).shape}: it needs bf16/f16 x of 8..{MAX_ROWS} rows (a multiple "
                         "of 8), a K-major QuantizedWeightT, out a multiple of 64 and in of 128")
    interpreting = pallas_mode.resolve(interpret)
    m, k = x.shape
    n = w.values_t.shape[0]
    if tile_k % 128:
        raise ValueError(f"tile_k={tile_k} must be a multiple of 128 (one 128-byte swizzle row of the int8 tile)")
    if int8_activations and k > 131072:  # 127 x 127 x in must fit the int32 accumulator
        raise ValueError(f"int8_activations takes in <= 131072 (int32 sums of int8 products), got {k}")
    tile_k = min(tile_k, k)
    if k % tile_k:
        tile_k = 128
    k_blocks = k // tile_k
    num_tiles = n // _ROWS
    max_programs = num_sms * ctas_per_sm
    num_splits = num_splits or _choose_splits(num_tiles, k_blocks, max_programs)
    if k_blocks % num_splits:
        raise ValueError(f"num_splits={num_splits} must divide in / tile_k = {k_blocks}")
    num_units = num_tiles * num_splits
    num_programs = min(num_units, max_programs)
    if int8_activations:
        x_parts, x_scales = split_int8(x)  # 2 x [M, in] int8, [2M]
    else:
        x_parts = (x,)
    slot_rows = m * len(x_parts)
    final = num_splits == 1 and not int8_activations  # the kernel scales and writes [M, out] itself
    out_shape = (m, n) if final else (num_splits, slot_rows, n)
    kernel = functools.partial(
        _w8a16_mosaic_kernel, num_units=num_units, num_programs=num_programs, num_splits=num_splits,
        steps_per_unit=k_blocks // num_splits, tile_k=tile_k, num_stages=num_stages, int8_activations=int8_activations,
        pdl=pdl, interpreting=interpreting)
    y = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype if final else jnp.float32),
        scratch_types=[
            swizzled_smem((num_stages, slot_rows, tile_k), x_parts[0].dtype),  # x slots
            swizzled_smem((num_stages, _ROWS, tile_k), jnp.int8),  # weight slots
            plgpu.Barrier(num_arrivals=1 + len(x_parts), num_barriers=num_stages),  # a slot's copies landed
        ],
        grid=(num_programs,),
        grid_names=("program",),
        interpret=interpret_params() if interpreting else None,
    )(*x_parts, w.values_t, w.scales.astype(jnp.float32))
    if final:
        return y
    return combine_partials(y, w.scales, out_dtype, x_scales if int8_activations else None)


def combine_partials(partials, w_scales, out_dtype, x_scales=None):
    """The kernel's float32 split-K partial sums [splits, rows, out] -> [M, out] in out_dtype: added as
    slices (elementwise, so XLA can fuse them into the consumer), then scaled. With x_scales [2M] (int8
    activations) the rows are W q1 then W q2, combined as s1 * (W q1) + s2 * (W q2)."""
    total = partials[0]
    for s in range(1, partials.shape[0]):
        total = total + partials[s]
    if x_scales is not None:
        m = total.shape[0] // 2
        total = total[:m] * x_scales[:m, None] + total[m:] * x_scales[m:, None]
    return (total * w_scales.astype(jnp.float32)).astype(out_dtype)
