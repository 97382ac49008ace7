"""Several W8A16 matmuls in one persistent Mosaic GPU kernel: the probe for a fused decode layer.

Why: on the H200 a batch-1 decode layer's four int8 matmuls take 68 us back to back as four kernels
and 55 us when the same bytes stream through one kernel (benchmarks/matmul_chain.py --concat,
docs/BENCHMARKS.md, thirteenth session): each kernel boundary costs ~3 us of ramp-up and tail. A
kernel that runs the matmuls as phases, with a grid-wide barrier between them (0.78 us on the H200,
benchmarks/grid_barrier.py), pays the boundary once. This module measures that structure; the engine
does not call it. Measured on the H200 (matmul_chain.py, 16 layers, 8 rows): 64.3 us a layer without
barriers against XLA's 67.5, but 70.7 with the three barriers a dependent layer needs: in place a
barrier costs ~2.2 us, since it waits for the last program of its phase. A fused layer needs finer
dependencies than a global barrier.

Each phase is w8a16_mosaic's int8-activation path (x split into two int8 terms, int8 wgmma from
shared memory, float32 split-K partials combined in XLA) on the same grid of one program per SM and
the same shared-memory slots. A program's steps are numbered across all phases, so its slots stream
straight from one phase into the next: the next phase's first weight tiles are copied during the
current phase's last steps and during the barrier. Its x tiles are copied only after the barrier,
as they would be if the phase before had computed them. Here the phases' inputs are all given up
front and no phase reads another's output, so the barrier only models the cost of a dependent chain
(a real fused layer would also have to make the earlier phase's stores visible before signalling).

The barrier is one counter in a kernel-global GMEM semaphore (pl.get_global; a barrier on a
scratch_types semaphore never returned on the H200, which suggests each program gets its own). Every program adds 1 and
waits until the counter reads programs x phase; program 0 returns it to zero at the end of the
launch, after every program has said it is done. Mosaic GPU's interpreter (CPU tests) has no
semaphores, so there the phases run without barriers (the same outputs here), and each product is a
plain dot on the same slots; the slots' copies, their barriers and the cross-phase order are the same.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.pallas_kernels import pallas_mode
from jlight.pallas_kernels.mosaic_common import interpret_params, swizzled_smem
from jlight.pallas_kernels.tiling import NUM_SMS
from jlight.pallas_kernels.w8a16_mosaic import _ROWS, _choose_splits, combine_partials, split_int8, supports


class _Phase(NamedTuple):  # the static plan of one matmul
    num_units: int  # 64-channel tiles x splits of `in`
    num_splits: int
    steps_per_unit: int


def _kernel(*refs, phases, num_programs, num_stages, tile_k, barrier, interpreting):
    num_phases = len(phases)
    io = [refs[4 * p:4 * p + 4] for p in range(num_phases)]  # per phase: q1, q2, weights, partial sums
    x_smem, w_smem, bars = refs[4 * num_phases:]
    num_rows = io[0][0].shape[0]
    program = lax.axis_index("program")
    first_unit, my_units, start = [], [], [0]  # per phase, this program's (dynamic) share
    for ph in phases:
        first = program * ph.num_units // num_programs
        first_unit.append(first)
        my_units.append((program + 1) * ph.num_units // num_programs - first)
        start.append(start[-1] + my_units[-1] * ph.steps_per_unit)
    total_steps = start[-1]
    acc_shape = (_ROWS, 2 * num_rows)  # [channels, token rows of q1 then q2]
    barrier = barrier and not interpreting  # the interpreter has no semaphores
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((2,))) if barrier else None

    def issue_in_phase(p, step, slot, weights, activations):  # TMA phase p's step-th tiles into the slot
        q1_ref, q2_ref, w_ref, _ = io[p]
        ph = phases[p]
        unit = first_unit[p] + step // ph.steps_per_unit
        cols = pl.ds(((unit % ph.num_splits) * ph.steps_per_unit + step % ph.steps_per_unit) * tile_k, tile_k)
        if weights:
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((unit // ph.num_splits) * _ROWS, _ROWS), cols], w_smem.at[slot],
                                    bars.at[slot])
        if activations:
            for i, x_ref in enumerate((q1_ref, q2_ref)):  # the two terms stack on the slot's rows
                plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_smem.at[slot, pl.ds(i * num_rows, num_rows)],
                                        bars.at[slot])

    def issue(g, slot, x_phase):  # the program's g-th step overall: its weights, and its x if its phase is x_phase
        for p in range(num_phases):
            @pl.when((start[p] <= g) & (g < start[p + 1]))
            def _():
                issue_in_phase(p, g - start[p], slot, weights=True, activations=p == x_phase)

    for s in range(num_stages):  # the first slots; phase 0 needs no barrier
        @pl.when(s < total_steps)
        def _():
            issue(s, s, x_phase=0)

    for p, ph in enumerate(phases):
        if p:
            if barrier:  # every program has finished phase p - 1
                plgpu.semaphore_signal(sem.at[0], 1, memory_scope="gpu")
                plgpu.semaphore_wait(sem.at[0], num_programs * p, decrement=False, memory_scope="gpu")
            for s in range(num_stages):  # x of this phase's steps whose weights were copied before the barrier
                @pl.when(s < start[p + 1] - start[p])
                def _():
                    issue_in_phase(p, s, lax.rem(start[p] + s, num_stages), weights=False, activations=True)

        def refill(g, p=p):  # step g's slot is read: fetch a later step into it
            @pl.when(g + num_stages < total_steps)
            def _():
                issue(g + num_stages, lax.rem(g, num_stages), x_phase=p)

        def unit_body(u, carry, p=p, ph=ph, refill=refill):
            first = start[p] + u * ph.steps_per_unit

            def unit_scope(acc_ref):
                if interpreting:
                    acc_ref[...] = jnp.zeros(acc_shape, jnp.int32)

                @pl.loop(0, ph.steps_per_unit)
                def _(kk):
                    g = first + kk
                    slot = lax.rem(g, num_stages)
                    plgpu.barrier_wait(bars.at[slot])
                    if interpreting:  # a plain dot on the same tiles; the slot is free at once
                        acc_ref[...] += jnp.dot(w_smem[slot], x_smem[slot].T, preferred_element_type=jnp.int32)
                        plgpu.commit_smem()  # the dot read the slot through the generic proxy; the TMA refill writes it
                        refill(g)
                        return
                    plgpu.wgmma(acc_ref, w_smem.at[slot], plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
                    plgpu.wgmma_wait(1)  # one wgmma in flight: the previous step's slot is free

                    @pl.when(kk > 0)  # the previous unit's last slot is refilled after its loop
                    def _():
                        refill(g - 1)
                return acc_ref[...]  # waits for the last wgmma

            alloc = plgpu.SMEM(acc_shape, jnp.int32) if interpreting else plgpu.ACC(acc_shape, jnp.int32)
            acc = pl.run_scoped(unit_scope, alloc)
            unit = first_unit[p] + u
            dst = io[p][3].at[unit % ph.num_splits, :, pl.ds((unit // ph.num_splits) * _ROWS, _ROWS)]
            if interpreting:
                dst[...] = acc.astype(jnp.float32).T
                return carry
            refill(first + ph.steps_per_unit - 1)
            value = plgpu.layout_cast(acc.astype(jnp.float32), plgpu.Layout.WGMMA)
            plgpu.transpose_ref(dst, (1, 0))[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)
            return carry

        lax.fori_loop(0, my_units[p], unit_body, 0)

    if barrier and num_phases > 1:  # the counter back to zero for the next launch, once every program is done
        plgpu.semaphore_signal(sem.at[1], 1, memory_scope="gpu")

        @pl.when(program == 0)
        def _():
            plgpu.semaphore_wait(sem.at[1], num_programs, memory_scope="gpu")
            plgpu.semaphore_wait(sem.at[0], num_programs * (num_phases - 1), memory_scope="gpu")


def w8a16_mosaic_phases(xs, ws, out_dtype=None, *, interpret=None, tile_k: int = 256, num_stages: int = 4,
                        num_sms: int = NUM_SMS, barrier: bool = True, split_factor: int = 1):
    """[x @ w for x, w in zip(xs, ws)] in one kernel launch, each x [M, in] bf16/f16 (the same M, a multiple
    of 8 up to 64) times a K-major int8 QuantizedWeightT; each result as w8a16_mosaic_matmul(x, w,
    int8_activations=True) gives it. barrier: a grid-wide barrier between phases (the cost a dependent
    chain would pay; the outputs do not depend on it). split_factor: that many times the split-K ranges
    of w8a16_mosaic's choice (shorter units, so a phase's tail before a barrier is shorter, at the cost of
    more partial sums), where `in` divides into them. Call it under jit: an x passed for several phases
    (the same array object) is split into int8 terms once."""
    if len(xs) != len(ws) or not xs:
        raise ValueError(f"w8a16_mosaic_phases needs one x per weight, got {len(xs)} x and {len(ws)} weights")
    m = xs[0].shape[0]
    for x, w in zip(xs, ws):
        if not supports(x, w) or x.shape[0] != m or w.values_t.shape[1] % tile_k:
            raise ValueError(f"w8a16_mosaic_phases does not take x {x.dtype}{x.shape} with int8 weights "
                             f"{getattr(w, 'values_t', w).shape}: every x needs {m} rows (bf16/f16, a multiple of 8 up "
                             f"to 64), every weight a K-major QuantizedWeightT with out a multiple of 64 and in of "
                             f"tile_k={tile_k}")
    interpreting = pallas_mode.resolve(interpret)
    out_dtype = out_dtype or xs[0].dtype
    splits_of = {}  # x's two int8 terms, once per distinct x
    phases, inputs, out_types = [], [], []
    for x, w in zip(xs, ws):
        if id(x) not in splits_of:
            splits_of[id(x)] = split_int8(x)
        (q1, q2), _ = splits_of[id(x)]
        n, k = w.values_t.shape
        k_blocks = k // tile_k
        splits = _choose_splits(n // _ROWS, k_blocks, num_sms)
        if k_blocks % (splits * split_factor) == 0:
            splits *= split_factor
        phases.append(_Phase(n // _ROWS * splits, splits, k_blocks // splits))
        inputs += [q1, q2, w.values_t]
        out_types.append(jax.ShapeDtypeStruct((splits, 2 * m, n), jnp.float32))
    # The outputs follow the inputs in the kernel's refs; interleave them per phase for the body.
    body = functools.partial(_kernel, phases=tuple(phases), num_programs=num_sms, num_stages=num_stages,
                             tile_k=tile_k, barrier=barrier, interpreting=interpreting)
    num_phases = len(phases)

    def per_phase_refs(*refs):
        ins, outs, scratch = refs[:3 * num_phases], refs[3 * num_phases:4 * num_phases], refs[4 * num_phases:]
        grouped = [r for p in range(num_phases) for r in (*ins[3 * p:3 * p + 3], outs[p])]
        body(*grouped, *scratch)

    partials = plgpu.kernel(
        per_phase_refs,
        out_type=tuple(out_types),
        scratch_types=[
            swizzled_smem((num_stages, 2 * m, tile_k), jnp.int8),  # x slots (q1 rows, then q2 rows)
            swizzled_smem((num_stages, _ROWS, tile_k), jnp.int8),  # weight slots
            plgpu.Barrier(num_arrivals=3, num_barriers=num_stages),  # a slot's three copies landed
        ],
        grid=(num_sms,),
        grid_names=("program",),
        interpret=interpret_params() if interpreting else None,
    )(*inputs)
    return [combine_partials(y, w.scales, out_dtype, splits_of[id(x)][1]) for y, x, w in zip(partials, xs, ws)]
