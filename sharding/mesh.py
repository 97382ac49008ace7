"""Device meshes from a one-line spec ("tp=2", "dp=2,tp=4", "tp=2,ep=4").

Every mesh jlight builds has the same three axes in the same order, (dp, ep, tp), with
size 1 for the axes the spec leaves out, so the sharding rules can always name all
three and a spec change never changes code. `tp` is the innermost (fastest-varying)
axis so tensor-parallel peers are neighbouring devices (same NVLink island / host).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

# Data-parallel replicas, expert parallelism, tensor parallelism; outermost first.
MESH_AXES = ("dp", "ep", "tp")

_SPEC_HELP = "write it as comma-separated axis=size pairs over the axes dp, ep, tp, e.g. 'tp=2' or 'dp=2,tp=4'"


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """'dp=2,tp=4' -> {'dp': 2, 'ep': 1, 'tp': 4}. Raises ValueError naming the spec and the fix."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec {spec!r} is empty; {_SPEC_HELP}")
    sizes = {axis: 1 for axis in MESH_AXES}
    seen = set()
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"mesh spec {spec!r}: {part.strip()!r} has no '='; {_SPEC_HELP}")
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; {_SPEC_HELP}")
        if name in seen:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} is given twice; give each axis once")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size {value.strip()!r} of axis {name!r} is not an integer; {_SPEC_HELP}") from None
        if size < 1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} has size {size}; sizes must be >= 1")
        seen.add(name)
        sizes[name] = size
    return sizes


def spec_from_tensor_parallel_size(tensor_parallel_size: int) -> str | None:
    """--tensor-parallel-size N is the same as --mesh tp=N (None for a single device)."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer")
    return None if tensor_parallel_size == 1 else f"tp={tensor_parallel_size}"


def make_mesh(spec: str | None, devices=None) -> Mesh | None:
    """Build the (dp, ep, tp) mesh a spec describes over `devices` (default: all devices of
    all processes). `None` or "" means a single device: returns None (no mesh, no shard_map).

    The sizes must multiply to the number of devices, so a mistyped spec fails here with a
    message rather than later with an XLA error.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ValueError(
            f"mesh spec {spec!r} needs {total} devices but {len(devices)} are available; "
            f"choose axis sizes whose product is {len(devices)}"
        )
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    # Devices in jax.devices() order: process-major, so a tp group stays within one host
    # whenever tp divides the number of devices per host.
    grid = np.array(devices, dtype=object).reshape(shape)  # [dp, ep, tp]
    return Mesh(grid, MESH_AXES)


def mesh_sizes(mesh: Mesh | None) -> dict[str, int]:
    """Axis sizes of a jlight mesh ({'dp': 1, 'ep': 1, 'tp': 1} for no mesh)."""
    if mesh is None:
        return {axis: 1 for axis in MESH_AXES}
    return {axis: int(mesh.shape.get(axis, 1)) for axis in MESH_AXES}


def describe(mesh: Mesh | None) -> str:
    """Short label for tables and logs, e.g. 'dp=2,tp=4' (or 'single' for no mesh)."""
    parts = [f"{a}={s}" for a, s in mesh_sizes(mesh).items() if s > 1]
    return ",".join(parts) or "single"
