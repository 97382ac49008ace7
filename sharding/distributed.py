"""Multi-host: join the processes of one job into a single JAX runtime, so one mesh spans
every device of every process (jax.distributed; no home-made transport).

Call `initialize()` once per process before anything touches a device; afterwards
jax.devices() lists all processes' devices and make_mesh builds meshes over them.
With `transfer_address`, arrays also move between processes by jax.device_put from one process's
devices to another's (JAX's socket transfer server where the PjRt client has no cross-host
transfers of its own, as on CPUs), and `key_value_store()` is the job's coordination-service
store for small control records (disaggregated prefill/decode uses both).
"""
from __future__ import annotations

import os

import jax
from jax._src import distributed as jax_distributed  # the coordination service's client: no public accessor

# The settings can come from arguments or from these environment variables (JAX's own
# names; on Slurm / Cloud TPU / MPI JAX also detects them itself when all are unset).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; set it to a process count/index") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               transfer_address: str | None = None) -> None:
    """jax.distributed.initialize with jlight's validation.

    coordinator_address: "host:port" of process 0 (every process passes the same one).
    num_processes / process_id: the job's size and this process's index in [0, num_processes).
    Missing arguments are read from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
    if all are still missing JAX's cluster auto-detection is used. A single process
    (num_processes == 1) needs no coordination and returns at once.
    transfer_address: "host:port" (a concrete port) where this process serves the arrays other processes
    pull from it in a cross-process jax.device_put (jax_cross_host_transfer_socket_address); None: only
    the PjRt client's own cross-host transfers, which CPUs lack.
    """
    if transfer_address is not None:
        host, _, port = transfer_address.rpartition(":")
        if not host or not port.isdigit() or int(port) == 0:
            raise ValueError(f"transfer_address={transfer_address!r} must be 'host:port' with a port other than 0 "
                             "(the other process connects to it), e.g. '10.0.0.2:8476'")
        # Read when the backend starts, so before anything touches a device.
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes == 1:
        return
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "multi-process setup needs coordinator_address, num_processes and process_id together "
            f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r}); pass all three or set "
            f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}"
        )
    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"num_processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, {num_processes}); number processes from 0")
        if ":" not in coordinator_address:
            raise ValueError(f"coordinator_address={coordinator_address!r} must be 'host:port' of process 0, e.g. '10.0.0.1:1234'")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)


def shutdown() -> None:
    jax.distributed.shutdown()


def key_value_store():
    """The key-value store of this job's coordination service (jax.distributed's), for small control records:
    key_value_set(key, value), key_value_try_get(key) (raises when absent), blocking_key_value_get(key, timeout_ms),
    key_value_delete(key). Raises ValueError when this process has not joined a job."""
    client = jax_distributed.global_state.client
    if client is None:
        raise ValueError("this process has not joined a jax.distributed job; call jlight.sharding.distributed.initialize "
                         "(or pass --coordinator-address) before building the engine")
    return client
