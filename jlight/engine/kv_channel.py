"""Moves a handoff's K/V pages from the prefill process to the decode process of a disaggregated pair
(disaggregated_roles.py) through JAX's own runtime. The two processes are one jax.distributed job, each with its
own mesh over its own devices; the pages cross by a cross-process jax.device_put from the prefill pools'
sharding to the same sharding over the decode process's devices (on GPUs the PjRt client's own cross-host
transfers, device to device; on CPUs, and with any client that lacks them, JAX's socket transfer server, which
`distributed.initialize(transfer_address=...)` starts). Small control records go through the job's key-value
store (the coordination service's): nothing else is sent between the two.

A cross-process device_put pairs the two processes' calls by order: each process numbers its cross-process
transfers, and its k-th send meets the other's k-th receive. So the decode process, which knows when it has room,
decides the order: it writes order k (`{ns}/order/{k}`: a transfer id and its page count, or a cancel) and then
posts its receive, and the prefill process answers the orders in k order (`PageSender.serve`, from its engine
loop). At start the two processes move the scratch page once, which starts and connects JAX's transfer servers,
so that no later receive waits for the peer's server to start.
Invariants:
- for each order both processes call device_put exactly once, or (a cancel) neither does;
- the prefill process writes its answer (`{ns}/sent/{k}`: ok, or why not) before its device_put, and when it cannot
  send the pages (an unknown or expired transfer id, a failed read) it sends the scratch page's K/V in the ordered
  shape instead, so every receive completes; the decode side reads the answer before it uses the data;
- a device_put that raises, or a receive that has not arrived after `timeout_s`, leaves the numbering unknown:
  that process writes `{ns}/broken`, and from then on neither moves pages (each later handoff is recomputed on the
  decode side, a cancel frees its prefill pages);
- a transfer id the decode side never orders (its request never reached the decode side) is released by the
  prefill process after `timeout_s`;
- the decode process deletes order k's records only once the prefill process has answered it.
Both processes publish their page layout (`{ns}/layout/{role}`) at start and refuse a peer whose pages differ.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jlight.engine.disaggregated import device_put_tree, page_layout, pool_shardings
from jlight.engine.handoff import Handoff, moved_ready
from jlight.engine.llm_engine import LLMEngine
from jlight.engine.model_runner import padded_pages

logger = logging.getLogger(__name__)

NAMESPACE = "jlight/pd"


class KVTransferError(RuntimeError):
    """A handoff's pages did not arrive (the prefill process could not send them, the copy failed or timed out);
    the decode side recomputes the prompt."""


def layout_record(engine: LLMEngine) -> dict:
    """What a peer must match for pages to move, and the devices its pools live on (mesh order)."""
    shardings = jax.tree.leaves(pool_shardings(engine))
    first = shardings[0]
    named = isinstance(first, NamedSharding)
    return {"page_size": engine.config.page_size, "max_model_len": engine.max_model_len,
            "pages": json.loads(json.dumps(jax.tree.leaves(page_layout(engine), is_leaf=lambda x: isinstance(x, list)))),
            "specs": [str(s.spec) if named else "single" for s in shardings],
            "mesh_shape": list(first.mesh.devices.shape) if named else [],
            "devices": [d.id for d in (first.mesh.devices.flat if named else first.device_set)]}


def check_peer(mine: dict, peer: dict, peer_role: str) -> None:
    for key, fix in (("page_size", "give both roles one --page-size"), ("max_model_len", "give both roles one --max-model-len"),
                     ("pages", "give both roles the same model, --kv-cache-dtype and --dtype"),
                     ("specs", "give both roles the same --tensor-parallel-size"),
                     ("mesh_shape", "give both roles the same --tensor-parallel-size")):
        if mine[key] != peer[key]:
            raise ValueError(f"the {peer_role} process's {key} ({peer[key]}) differs from this one's ({mine[key]}); {fix}")


def on_devices(sharding, device_ids: list[int]):
    """`sharding` over other devices (the peer's, in its mesh order): the same spec and mesh shape."""
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in device_ids]
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return NamedSharding(Mesh(np.array(devices, dtype=object).reshape(mesh.devices.shape), mesh.axis_names,
                                  axis_types=mesh.axis_types), sharding.spec)
    return SingleDeviceSharding(devices[0])


class _Channel:
    """The key-value records both sides share, and the layouts exchanged at start."""

    def __init__(self, store, engine: LLMEngine, role: str, peer_role: str, timeout_s: float, namespace: str,
                 start_timeout_s: float):
        """start_timeout_s: how long to wait at start for the peer's layout (it may still be loading, compiling)."""
        self.store, self.engine, self.timeout_s, self.ns = store, engine, timeout_s, namespace
        self.layout = layout_record(engine)
        store.key_value_set(f"{namespace}/layout/{role}", json.dumps(self.layout))
        try:
            peer = json.loads(store.blocking_key_value_get(f"{namespace}/layout/{peer_role}", int(start_timeout_s * 1000)))
        except Exception as e:
            raise ValueError(f"the {peer_role} process did not start within {start_timeout_s:.0f} s ({e}); start both "
                             "roles with the same --coordinator-address") from None
        check_peer(self.layout, peer, peer_role)
        self.own_shardings = pool_shardings(engine)
        self.peer_shardings = jax.tree.map(lambda s: on_devices(s, peer["devices"]), self.own_shardings)
        self.next_order = 0
        self._broken = False

    def get(self, key: str) -> str | None:
        try:
            return self.store.key_value_try_get(f"{self.ns}/{key}")
        except Exception:  # not there (yet): the store answers NOT_FOUND as an error
            return None

    def set(self, key: str, value: dict, overwrite: bool = False) -> None:
        self.store.key_value_set(f"{self.ns}/{key}", json.dumps(value), allow_overwrite=overwrite)

    def delete(self, key: str) -> None:
        try:
            self.store.key_value_delete(f"{self.ns}/{key}")
        except Exception:  # gone already
            pass

    @property
    def broken(self) -> bool:
        if not self._broken and self.get("broken") is not None:
            self._broken = True
        return self._broken

    def break_off(self, why: str) -> None:
        logger.error("KV page transfers between the prefill and decode processes stop (%s); every later request is "
                     "recomputed on the decode side", why)
        self._broken = True
        self.set("broken", {"why": why}, overwrite=True)  # both processes may find a failure


class PageSender(_Channel):
    """The prefill process's side: holds each handoff's pages under a transfer id and answers the decode side's
    orders, in order, from its engine loop (`serve`)."""

    def __init__(self, store, engine: LLMEngine, timeout_s: float, namespace: str = NAMESPACE, transfer=device_put_tree,
                 start_timeout_s: float = 600.0):
        """transfer(data, shardings): the cross-process copy; read_pages(pages): the gather (tests inject failures)."""
        super().__init__(store, engine, "prefill", "decode", timeout_s, namespace, start_timeout_s)
        self.transfer, self.read_pages = transfer, engine.runner.read_pages
        # One move of the scratch page before any order (the receiver makes its own at start): it starts JAX's
        # transfer servers and connects them, so that no later receive waits for the peer's server to start.
        transfer(device_put_tree(engine.runner.read_pages(np.zeros(1, np.int32)), self.own_shardings), self.peer_shardings)
        self.held: dict[str, tuple[list[int], float]] = {}  # transfer id -> (its pages, when it was held)
        self.num_sent = self.num_not_sent = 0

    def hold(self, h: Handoff) -> str:
        """Keep h's pages (its references) for the decode side; returns their transfer id."""
        transfer_id = uuid.uuid4().hex
        self.held[transfer_id] = (h.source, time.monotonic())
        h.source = []
        return transfer_id

    def order_waiting(self) -> bool:
        return self.get(f"order/{self.next_order}") is not None

    def wait_for_order(self, seconds: float) -> None:
        """Block up to `seconds` for the next order (an engine loop with nothing else to do)."""
        try:
            self.store.blocking_key_value_get(f"{self.ns}/order/{self.next_order}", max(1, int(seconds * 1000)))
        except Exception:  # none came
            pass

    def serve(self) -> None:
        """Answer every order written so far, in order; release holds past timeout_s."""
        while (raw := self.get(f"order/{self.next_order}")) is not None:
            self._answer(self.next_order, json.loads(raw))
            self.next_order += 1
        now = time.monotonic()
        for transfer_id, (pages, since) in list(self.held.items()):
            if now - since > self.timeout_s:
                logger.warning("KV pages of transfer %s were not asked for within %.0f s; releasing them", transfer_id, self.timeout_s)
                del self.held[transfer_id]
                self.engine.block_manager.release(pages)

    def _answer(self, k: int, order: dict) -> None:
        pages = self.held.pop(order["transfer_id"], (None, 0))[0]
        try:
            if order.get("cancel"):
                self.delete(f"order/{k}")
                return
            if self.broken:
                self.set(f"sent/{k}", {"ok": False, "why": "transfers stopped after an earlier failure"})
                return
            self._send(k, pages, order["num_pages"])
        finally:
            if pages is not None:
                # The gather was dispatched before anything can write these pages again (the device runs in order).
                self.engine.block_manager.release(pages)

    def _send(self, k: int, pages: list[int] | None, num_pages: int) -> None:
        why, data = None, None
        if pages is None:
            why = "unknown transfer id (never held here, or released after the timeout)"
        elif len(pages) != num_pages:
            why = f"the order asks for {num_pages} pages, the prefill holds {len(pages)}"
        else:
            try:
                data = self.read_pages(padded_pages(pages))
            except Exception as e:
                why = f"reading its pages failed: {e}"
        try:
            if data is None:  # the scratch page in the ordered shape: the receive must complete all the same
                data = self.engine.runner.read_pages(np.zeros(len(padded_pages([0] * num_pages)), np.int32))
            data = device_put_tree(data, self.own_shardings)  # the pools' own sharding, as the receive expects
            self.set(f"sent/{k}", {"ok": why is None, "why": why})
            self.transfer(data, self.peer_shardings)
        except Exception as e:
            self.break_off(f"sending the pages of order {k} raised {type(e).__name__}: {e}")
            return
        if why is None:
            self.num_sent += 1
        else:
            self.num_not_sent += 1
            logger.warning("KV transfer order %d: not sent (%s); the decode side recomputes", k, why)


class PageReceiver(_Channel):
    """The decode process's side: a handoff.PageMover whose moves are orders to the prefill process (above)."""

    def __init__(self, store, engine: LLMEngine, timeout_s: float, namespace: str = NAMESPACE, transfer=device_put_tree,
                 start_timeout_s: float = 600.0):
        """transfer(data, shardings): the cross-process copy (tests inject failures here)."""
        super().__init__(store, engine, "decode", "prefill", timeout_s, namespace, start_timeout_s)
        self.transfer = transfer
        jax.block_until_ready(transfer(self._remote(1), self.own_shardings))  # PageSender's first move
        self._orphans: list[tuple[int, object]] = []  # (order, data) of moves aborted in flight, until their data arrived

    def _remote(self, num_pages: int):
        """read_pages' result for num_pages padded pages as arrays on the prefill devices (no data here): the source
        of a receive."""
        shapes = self.engine.runner.page_shapes(len(padded_pages([0] * num_pages)))
        return jax.tree.map(lambda s, src: None if s is None else jax.make_array_from_single_device_arrays(
            s.shape, src, [], dtype=s.dtype), shapes, self.peer_shardings, is_leaf=lambda x: x is None)

    @property
    def in_flight(self) -> bool:
        """Moves aborted in flight whose data has not arrived yet."""
        self._sweep()
        return bool(self._orphans)

    def start(self, h: Handoff):
        if self.broken:
            raise KVTransferError("transfers stopped after an earlier failure")
        remote = self._remote(h.num_pages)
        # The order goes first: the prefill process sends whatever happens here next, so a receive that raises
        # leaves the numbering unknown.
        h.ticket = (self.next_order, time.monotonic())
        self.set(f"order/{self.next_order}", {"transfer_id": h.transfer_id, "num_pages": h.num_pages})
        self.next_order += 1
        try:
            return self.transfer(remote, self.own_shardings)
        except Exception as e:
            self.break_off(f"receiving the pages of request {h.request_id} raised {type(e).__name__}: {e}")
            raise

    def ready(self, h: Handoff) -> bool:
        self._sweep()
        k, since = h.ticket
        if not moved_ready(h.moved):
            if time.monotonic() - since > self.timeout_s:
                self.break_off(f"the pages of order {k} did not arrive within {self.timeout_s:.0f} s")
                raise KVTransferError(f"the pages did not arrive within {self.timeout_s:.0f} s")
            return False
        answer = self.get(f"sent/{k}")
        answer = json.loads(answer) if answer is not None else {"ok": False, "why": "the prefill process wrote no answer"}
        if not answer["ok"]:
            raise KVTransferError(f"the prefill process did not send them: {answer['why']}")
        return True

    def done(self, h: Handoff) -> None:
        if h.ticket is None:  # never ordered (queued, or it failed to start): the prefill only frees its pages
            if h.transfer_id is not None:
                self.set(f"order/{self.next_order}", {"transfer_id": h.transfer_id, "cancel": True})
                self.next_order += 1
            return
        if _arrived(h.moved):
            self._forget(h.ticket[0])
        else:
            self._orphans.append((h.ticket[0], h.moved))

    def _sweep(self) -> None:
        arrived = [_arrived(moved) for _, moved in self._orphans]
        for (k, _), done in zip(self._orphans, arrived):
            if done:
                self._forget(k)
        self._orphans = [o for o, done in zip(self._orphans, arrived) if not done]

    def _forget(self, k: int) -> None:
        """Delete order k's records once the prefill process has answered it (before that it still reads the order:
        its answers go in k order, so a missing order would stop them)."""
        if self.get(f"sent/{k}") is not None:
            self.delete(f"order/{k}")
            self.delete(f"sent/{k}")


def _arrived(moved) -> bool:
    """Whether a move is over, landed or failed (nothing more will arrive)."""
    try:
        return moved_ready(moved)
    except Exception:
        return True
