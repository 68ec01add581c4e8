"""Progressive push: P WRITEs each layer's KV while the forward pass computes the next.

A whole push WRITEs once the forward pass that completes the prompt has ended, so the
transfer adds to the request's time to first token. When D has registered its blocks
before that forward pass reaches a layer, P can WRITE that layer's KV as soon as vLLM's
per-layer hook (`save_kv_layer`, on exit of each attention layer) says it is computed;
only the last layer's transfer is left when the forward pass ends.

How a push is cut into layers. vLLM's push code decides what a push WRITEs: which of P's
blocks go to which of D's (TP mapping, the trim of a prefix hit on D), as one transfer
per D rank, each a list of NIXL descriptors, one per (region, block). A region is one
contiguous KV tensor of one layer (K and V may be two). The worker runs that code with
the transfers recorded instead of posted (`PlannedWrite`), and `RegionLayers.split` cuts
each by the layer its local descriptors belong to: a local descriptor's id is its block
plus its region's offset, so its region, and so its layer, follow from the id.

The order of a push's parts (`LayeredWrite`): each layer's part, without a notification,
once that layer is computed; the last layer's part, which carries vLLM's notification to
D (`"<D request id>:<P's world size>"`), only once every other part is done. NIXL sends a
transfer's notification once that transfer is complete, but says nothing of transfers
posted before it: holding the last part back is what makes the notification mean "every
layer of every block has landed".

What cannot be cut this way is written whole (the caller's `refusal`): regions that
several layers share, or that hold no layer's KV (Mamba state, written by vLLM from
outside the attention hook), and more than one KV cache group (descriptors routed by
layer name).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class PlannedWrite:
    """One NIXL WRITE as vLLM's push code would post it (`make_prepped_xfer`'s args)."""

    local_handle: object  # P's prepared descriptor list
    local_ids: np.ndarray  # int32 descriptor ids into it
    remote_handle: object  # D's rank's prepared descriptor list
    remote_ids: np.ndarray
    notif: bytes  # D's notification, sent when the WRITE is done; b"": none


class _Held:
    """The placeholder handle that keeps a layered push open in vLLM's bookkeeping of WRITE
    handles (`_sending_transfers`) until its final parts are posted: while it is there,
    the push is never all done. NIXL never sees it (`RecordingAgent`)."""

    def __repr__(self) -> str:
        return "HELD"


HELD: Any = _Held()


class RecordingAgent:
    """vLLM's NIXL agent, whose WRITEs can be recorded instead of posted, so that vLLM's
    own push code plans a push (`recording`), and which answers for the `HELD` placeholder
    (in flight until removed; releasing it releases nothing). Everything else goes to the
    agent. Recording is per thread: only the planning thread's WRITEs are recorded."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    @contextmanager
    def recording(self) -> Iterator[list[PlannedWrite]]:
        """While inside, this thread's WRITEs are appended to the list yielded, not posted."""
        planned: list[PlannedWrite] = []
        self._local.planned = planned
        try:
            yield planned
        finally:
            self._local.planned = None

    def make_prepped_xfer(self, operation: str, local: Any, local_ids: Any, remote: Any,
                          remote_ids: Any, notif_msg: bytes = b"", *args: Any,
                          **kwargs: Any) -> Any:
        planned = getattr(self._local, "planned", None)
        if planned is None or operation != "WRITE":
            return self._agent.make_prepped_xfer(operation, local, local_ids, remote,
                                                 remote_ids, notif_msg, *args, **kwargs)
        planned.append(PlannedWrite(local, np.asarray(local_ids, dtype=np.int32), remote,
                                    np.asarray(remote_ids, dtype=np.int32), bytes(notif_msg)))
        return HELD

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if handle is HELD:
            return "PROC"
        return self._agent.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle: Any) -> Any:
        if handle is HELD:
            return "PROC"
        return self._agent.check_xfer_state(handle)

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if handle is HELD:
            return None
        return self._agent.release_xfer_handle(handle, *args, **kwargs)


class RegionLayers:
    """Which layer each of this worker's NIXL regions holds, from its registration (vLLM's
    `region_names` and `region_num_blocks`, in region order)."""

    def __init__(self, region_names: Sequence[str], region_num_blocks: Sequence[int]) -> None:
        if len(region_names) != len(region_num_blocks) or not region_names:
            raise ValueError("one name and one block count per region, and some regions")
        self.names: list[str] = list(dict.fromkeys(region_names))  # layers in region order
        self.index = {name: i for i, name in enumerate(self.names)}
        self._region_layer = np.asarray([self.index[n] for n in region_names], dtype=np.int64)
        # Where each region's descriptors start: a local id is block + its region's start.
        self._starts = np.cumsum([0, *region_num_blocks[:-1]], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.names)

    def layer_of(self, local_ids: np.ndarray) -> np.ndarray:
        """The layer index of each local descriptor id."""
        regions = np.searchsorted(self._starts, local_ids, side="right") - 1
        return self._region_layer[regions]

    def split(self, write: PlannedWrite) -> list[PlannedWrite | None]:
        """`write` cut by layer (index = layer; None: nothing of that layer), each part
        without a notification."""
        local = np.asarray(write.local_ids)
        remote = np.asarray(write.remote_ids)
        if local.shape != remote.shape:
            raise ValueError(f"{local.size} local descriptors against {remote.size} remote")
        layers = self.layer_of(local)
        parts: list[PlannedWrite | None] = []
        for layer in range(len(self.names)):
            mask = layers == layer
            if not mask.any():
                parts.append(None)
                continue
            parts.append(PlannedWrite(write.local_handle, local[mask].astype(np.int32),
                                      write.remote_handle, remote[mask].astype(np.int32),
                                      b""))
        return parts


def layout_refusal(*, region_names: Sequence[str], has_state: bool, groups: int,
                   routed_by_layer: bool) -> str | None:
    """Why this worker's KV cannot be written layer by layer (then pushes are written
    whole); None: it can."""
    if has_state:
        return "the model keeps Mamba state, which vLLM writes outside the per-layer hook"
    if groups > 1 or routed_by_layer:
        return "more than one KV cache group (the layers of one region differ by group)"
    if not region_names:
        return "no KV regions registered"
    # Regions are registered layer by layer: a layer's regions are contiguous; a name
    # seen again after another layer's means a region shared across layers.
    seen: list[str] = []
    for name in region_names:
        if not seen or seen[-1] != name:
            if name in seen:
                return f"layer {name} shares KV regions with other layers"
            seen.append(name)
    return None


class ChunkCover:
    """The descriptors that a push's chunk WRITEs posted (P's blocks of a prompt's
    earlier chunks, written while later chunks computed), which its final WRITE skips:
    each a pair (P's local descriptor id, D's remote descriptor id) within a pair of
    prepared descriptor lists. The final WRITE is planned by vLLM's push code for the
    whole prompt, so a block a chunk wrote is the same pair there."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[object, object], list[np.ndarray]] = {}

    def add(self, write: PlannedWrite) -> None:
        self._pairs.setdefault((write.local_handle, write.remote_handle), []).append(
            _pair_codes(write))

    def skip(self, write: PlannedWrite) -> PlannedWrite | None:
        """`write` without the pairs covered (None: nothing left). A write with D's
        notification keeps at least its last pair: the notification must go."""
        covered = self._pairs.get((write.local_handle, write.remote_handle))
        if not covered:
            return write
        keep = ~np.isin(_pair_codes(write), np.concatenate(covered))
        if not keep.any():
            if not write.notif:
                return None
            keep[-1] = True
        return PlannedWrite(write.local_handle, write.local_ids[keep], write.remote_handle,
                            write.remote_ids[keep], write.notif)


def _pair_codes(write: PlannedWrite) -> np.ndarray:
    """Each (local id, remote id) pair of `write` as one int64."""
    return (np.asarray(write.local_ids, dtype=np.int64) << 32) | \
        np.asarray(write.remote_ids, dtype=np.int64)


class Part(enum.Enum):
    WAITING = "waiting"  # its layer is not computed yet
    POSTED = "posted"


@dataclass(slots=True)
class LayeredWrite:
    """One push written layer by layer: its parts by layer, which are posted, and the
    final parts (the last layer's, with D's notification), posted once every other part
    is done (module docstring). Its handles and deadline are the worker's, in vLLM's
    bookkeeping."""

    request_id: str
    parts: list[list[PlannedWrite]]  # by layer index, one per D rank written
    final: list[PlannedWrite]  # the last layer's parts, with the notifications
    state: list[Part] = field(default_factory=list)

    @classmethod
    def plan(cls, request_id: str, writes: Iterable[PlannedWrite], layers: RegionLayers,
             *, notify: bool = True) -> LayeredWrite:
        """Cut a push's planned WRITEs (one per D rank) into layers. The last layer that
        has descriptors carries each WRITE's notification; with `notify` False (a chunk's
        WRITE) there are no final parts, and every layer's part goes as it is computed."""
        by_layer: list[list[PlannedWrite]] = [[] for _ in range(len(layers))]
        final: list[PlannedWrite] = []
        for write in writes:
            parts = layers.split(write)
            present = [i for i, part in enumerate(parts) if part is not None]
            if not present:
                continue
            last = present[-1] if notify else len(parts)
            for i in present:
                part = parts[i]
                assert part is not None
                if i < last:
                    by_layer[i].append(part)
                else:
                    final.append(PlannedWrite(part.local_handle, part.local_ids,
                                              part.remote_handle, part.remote_ids, write.notif))
        if not final and not any(by_layer):
            raise ValueError(f"push {request_id}: nothing to write")
        if notify and not final:
            raise ValueError(f"push {request_id}: no part carries D's notification")
        return cls(request_id, by_layer, final, state=[Part.WAITING] * len(by_layer))

    def due(self, computed: Iterable[int]) -> list[PlannedWrite]:
        """The parts of the `computed` layers not posted yet; marks them posted."""
        out: list[PlannedWrite] = []
        for layer in computed:
            if self.state[layer] is Part.WAITING:
                self.state[layer] = Part.POSTED
                out += self.parts[layer]
        return out

    def rest(self) -> list[PlannedWrite]:
        """Every part not posted yet but the final ones (the forward pass is over)."""
        return self.due(range(len(self.parts)))

    @property
    def all_parts_posted(self) -> bool:
        return all(state is Part.POSTED or not parts
                   for state, parts in zip(self.state, self.parts, strict=True))

    @property
    def blocks(self) -> int:
        """Descriptors written, all layers and ranks."""
        return sum(p.local_ids.size for layer in self.parts for p in layer) + \
            sum(p.local_ids.size for p in self.final)
