"""One NIXL agent per rank, and the READ that moves a source's resident weights into ours.

The agent runs with the progress thread OFF (it spins a core) and the listen thread OFF (it binds
INADDR_ANY). Metadata goes out of band instead: a source returns `get_agent_metadata()` and its tensor
descriptors in the gRPC manifest. Descriptors travel as plain (address, length, device) numbers rather
than NIXL's pickled descriptor lists, so a target never unpickles bytes from the network.

Without a progress thread, UCX on a source only makes progress when someone calls into its agent: a
target's connection wire-up then never completes. A serving peer therefore runs `start_progress()`, a
light pump thread; the agent is created with STRICT thread sync because of it. The pump ticks every 5 ms, and
every 1 ms for a second after `expedite()` (a lease was just granted: a reader is about to connect, and each
wire-up step waits for a tick; at 5 ms that was ~10 ms of a 64 MiB load).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferry_agent import logs
from ferry_agent.store.resident import ResidentWeights, device_id, mem_type

log = logging.getLogger(__name__)

INIT_AGENT = "NIXL_INIT_AGENT"
PUMP_INTERVAL_S = 0.005  # a serving agent's progress pump, idle
PUMP_FAST_INTERVAL_S = 0.001  # ... and while a reader connects
PUMP_FAST_S = 1.0  # how long after `expedite()` it stays fast


class ManifestMismatchError(ValueError):
    """Source and target tensors do not pair up by name, size, dtype and shape."""


class TransferStalled(TimeoutError):
    """A READ in flight completed no transfer for the stall limit: the source is wedged or too slow to wait on."""


@dataclass(frozen=True)
class RemoteTensor:
    """A tensor as a source describes it on the wire."""

    name: str
    addr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int


def describe(resident: ResidentWeights) -> list[RemoteTensor]:
    """The descriptors a source publishes for its resident weights, in manifest order."""
    kind, dev = mem_type(resident.device), device_id(resident.device)
    return [
        RemoteTensor(
            name=spec.name,
            addr=resident.tensors[spec.name].data_ptr(),
            nbytes=spec.nbytes,
            dtype=spec.dtype,
            shape=spec.shape,
            mem_type=kind,
            device_id=dev,
        )
        for spec in resident.manifest
    ]


def default_device_sync(device: torch.device) -> None:
    """GPUDirect writes bypass torch streams, so the device must be synchronised before the bytes are used."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair(remote_tensors: Sequence[RemoteTensor], local: ResidentWeights) -> list[tuple[RemoteTensor, torch.Tensor]]:
    """Match by name, requiring the exact catalog: sources of one version share one manifest."""
    remote = {r.name: r for r in remote_tensors}
    if len(remote) != len(remote_tensors):
        raise ManifestMismatchError("source manifest lists a tensor name twice")
    missing = sorted(set(local.tensors) - set(remote))
    extra = sorted(set(remote) - set(local.tensors))
    if missing or extra:
        raise ManifestMismatchError(f"tensor sets differ: missing at source {missing[:5]}, unexpected {extra[:5]}")
    pairs = []
    for spec in local.manifest:
        r = remote[spec.name]
        if (r.dtype, r.nbytes, r.shape) != (spec.dtype, spec.nbytes, spec.shape):
            raise ManifestMismatchError(
                f"{spec.name}: source has {r.dtype}{list(r.shape)} ({r.nbytes} B), "
                f"target has {spec.dtype}{list(spec.shape)} ({spec.nbytes} B)"
            )
        if spec.nbytes:
            pairs.append((r, local.tensors[spec.name]))
    return pairs


class NixlPeer:
    """A rank's NIXL agent: registration, remote agents it loaded, READs and teardown."""

    def __init__(
        self,
        agent_name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        device_sync: Callable[[torch.device], None] = default_device_sync,
        agent: Any = None,
    ) -> None:
        """`agent`: an existing `nixl_agent` (or a stand-in) instead of creating one."""
        if agent is None:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # slow; only when used

            logs.adopt("nixl")  # its import configured a handler of its own

            config = nixl_agent_config(
                enable_prog_thread=False,
                enable_listen_thread=False,
                backends=list(backends),
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            agent = nixl_agent(agent_name, config)
        self.name = agent_name
        self._agent: Any = agent
        self._device_sync = device_sync
        self._remotes: set[str] = set()
        self._registered: dict[int, tuple[ResidentWeights, Any]] = {}
        self._pump: threading.Thread | None = None
        self._pump_stop = threading.Event()
        self._pump_wake = threading.Event()
        self._pump_fast_until = 0.0

    # -- local memory ---------------------------------------------------------------------------------

    def register(self, resident: ResidentWeights) -> None:
        """Register `resident` with NIXL; a second call for the same weights is a no-op."""
        if resident.registration is not None:
            if resident.registration is not self:
                raise RuntimeError(f"weights already registered with another agent ({resident.registration.name})")
            return
        regions = [(addr, size, device_id(resident.device), "") for addr, size in resident.storage_regions()]
        reg = self._agent.register_memory(regions, mem_type(resident.device)) if regions else None
        resident.registration = self
        self._registered[id(resident)] = (resident, reg)

    def deregister(self, resident: ResidentWeights) -> None:
        entry = self._registered.pop(id(resident), None)
        if entry is None:
            return
        resident.registration = None
        if entry[1] is not None:
            self._agent.deregister_memory(entry[1])

    def metadata(self) -> bytes:
        """This agent's metadata blob (connection info and registered regions): fetch it after `register`."""
        return bytes(self._agent.get_agent_metadata())

    # -- remote agents --------------------------------------------------------------------------------

    @property
    def remote_names(self) -> frozenset[str]:
        return frozenset(self._remotes)

    def add_remote(self, blob: bytes) -> str:
        """Load a peer's metadata blob; returns the agent name it declares."""
        name = self._agent.add_remote_agent(blob)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> bool:
        """Drop a loaded peer and disconnect from it. Never raises: it runs in `finally` blocks.

        Only the side that loaded a peer can close the pair, so a target that skips this leaves a
        half-open connection on the source.
        """
        try:
            self._agent.remove_remote_agent(name)
            return True
        except Exception as exc:
            log.warning("remove_remote_agent(%s) failed: %s", name, exc)
            return False
        finally:
            self._remotes.discard(name)

    # -- data plane -----------------------------------------------------------------------------------

    def read(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        timeout_s: float,
        *,
        on_start: Callable[[int], None] | None = None,
    ) -> int:
        """READ every remote tensor into the local tensor of the same name with one prepped transfer (`read_groups`
        with a single group; what bench_p2p measures a peer load against). Returns the bytes moved."""
        return self.read_groups(
            remote_name, remote_tensors, local, [[r.name for r in remote_tensors]], timeout_s, on_start=on_start
        )

    def read_groups(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        groups: Sequence[Sequence[str]],
        timeout_s: float,
        *,
        on_start: Callable[[int], None] | None = None,
        on_done: Callable[[int], None] = lambda _i: None,
        window: int = 2,
        stall_s: float | None = None,
    ) -> int:
        """READ the tensors of each group into the local tensors of the same names: one transfer per group, all
        prepared at once and posted `window` at a time in order, so that groups land one after the other (and can
        be checked: `on_done(i)`, called from this thread as group i completes; a transfer that completes as it is
        posted, a shared-memory copy, is done before the next is posted) while the next ones are in flight;
        all posted together, they would share the link and all land at the end. `on_start(total_bytes)` runs before
        the first is posted. A transfer still in progress at the deadline raises `TimeoutError`, and none completing
        for `stall_s` (from the start, then from the last completion) raises `TransferStalled`; every handle is
        released (an xfer in flight is aborted) on every path. Returns the bytes moved."""
        if local.registration is not self:
            raise RuntimeError("target weights must be registered with this agent before a read")
        pairs = _pair(remote_tensors, local)
        slot = {r.name: i for i, (r, _) in enumerate(pairs)}
        wanted = [[slot[name] for name in group if name in slot] for group in groups]
        total = sum(pairs[i][0].nbytes for group in wanted for i in group)
        remote_kinds = {pairs[i][0].mem_type for group in wanted for i in group}
        if len(remote_kinds) > 1:
            raise ManifestMismatchError(f"source tensors span memory types {sorted(remote_kinds)}")
        handles: list[Any] = []
        xfers: dict[int, Any] = {}
        try:
            if remote_kinds:
                local_dev = device_id(local.device)
                local_descs = np.array([(t.data_ptr(), r.nbytes, local_dev) for r, t in pairs], dtype=np.uint64)
                remote_descs = np.array([(r.addr, r.nbytes, r.device_id) for r, _ in pairs], dtype=np.uint64)
                local_side = self._agent.prep_xfer_dlist(INIT_AGENT, local_descs, mem_type(local.device))
                handles.append(local_side)
                remote_side = self._agent.prep_xfer_dlist(remote_name, remote_descs, remote_kinds.pop())
                handles.append(remote_side)
                for i, group in enumerate(wanted):
                    if group:
                        index = np.array(group, dtype=np.int64)
                        xfers[i] = self._agent.make_prepped_xfer("READ", local_side, index, remote_side, index)
                        handles.insert(0, xfers[i])  # xfers are released before the lists they were made from
            if on_start is not None:
                on_start(total)
            for i, group in enumerate(wanted):
                if not group:
                    on_done(i)  # empty tensors only: nothing to move
            self._wait_all(xfers, remote_name, total, timeout_s, on_done, window, stall_s)
        finally:
            for handle in handles:
                try:
                    handle.release()
                except Exception as exc:
                    log.warning("releasing a NIXL handle for %s failed: %s", remote_name, exc)
        return total

    def _wait_all(
        self,
        xfers: dict[int, Any],
        remote_name: str,
        total: int,
        timeout_s: float,
        on_done: Callable[[int], None],
        window: int,
        stall_s: float | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        moved_at = time.monotonic()  # the start, then the last completion
        pause = 0.0
        queued = sorted(xfers)
        pending: dict[int, str] = {}
        while pending or queued:
            while queued and len(pending) < max(1, window):
                i = queued.pop(0)
                state = self._agent.transfer(xfers[i])
                if state == "DONE":  # done as posted (a shared-memory copy): checked while the next one moves
                    on_done(i)
                    pause, moved_at = 0.0, time.monotonic()
                else:
                    pending[i] = state
            for i, state in list(pending.items()):
                if state == "PROC":
                    pending[i] = self._agent.check_xfer_state(xfers[i])
                    state = pending[i]
                if state == "DONE":
                    del pending[i]
                    on_done(i)
                    pause, moved_at = 0.0, time.monotonic()
                elif state != "PROC":
                    raise RuntimeError(f"NIXL READ of group {i} from {remote_name} ended in state {state}")
            if not pending and not queued:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"NIXL READ of {total} B from {remote_name} still in progress after {timeout_s:g}s")
            if stall_s is not None and now - moved_at >= stall_s:
                raise TransferStalled(f"NIXL READ from {remote_name}: no transfer completed for {stall_s:g}s")
            if pause:
                time.sleep(pause)
            pause = min(0.002, pause * 2 or 0.00005)

    def synchronize(self, device: torch.device) -> None:
        self._device_sync(device)

    # -- serving --------------------------------------------------------------------------------------

    def start_progress(self, interval_s: float = PUMP_INTERVAL_S) -> None:
        """Pump UCX progress so targets can connect to this agent while it serves."""
        if self._pump is not None:
            return
        self._pump_stop.clear()

        def pump() -> None:
            while not self._pump_stop.is_set():
                fast = time.monotonic() < self._pump_fast_until
                self._pump_wake.wait(PUMP_FAST_INTERVAL_S if fast else interval_s)
                self._pump_wake.clear()
                if self._pump_stop.is_set():
                    return
                try:
                    self._agent.get_new_notifs()
                except Exception as exc:  # keep serving; a broken agent shows up in the reads instead
                    log.warning("NIXL progress pump: %s", exc)

        self._pump = threading.Thread(target=pump, name=f"nixl-progress-{self.name}", daemon=True)
        self._pump.start()

    def expedite(self, seconds: float = PUMP_FAST_S) -> None:
        """A reader is about to connect (its lease was granted): pump fast for `seconds`, starting now."""
        self._pump_fast_until = max(self._pump_fast_until, time.monotonic() + seconds)
        self._pump_wake.set()

    def stop_progress(self) -> None:
        if self._pump is not None:
            self._pump_stop.set()
            self._pump_wake.set()
            self._pump.join()
            self._pump = None

    def shutdown(self) -> None:
        """Disconnect every loaded peer, deregister memory (newest first) and drop the agent. Idempotent."""
        if self._agent is None:
            return
        self.stop_progress()
        for name in sorted(self._remotes):
            self.remove_remote(name)
        for resident, _ in reversed(list(self._registered.values())):
            try:
                self.deregister(resident)
            except Exception as exc:
                log.warning("deregistering memory of %s failed: %s", self.name, exc)
        self._agent = None
