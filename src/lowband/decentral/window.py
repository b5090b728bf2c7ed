"""One-sided windows for asynchronous decentralized algorithms (BlueFog paper §III-C, §IV-C, §VI-B).

A *window* is a named tensor registered by every rank of a group (:func:`win_create`, collective) plus,
on each rank, one buffer per in-neighbor of a static topology. Neighbors then write into a rank's
buffers and read its tensor without that rank calling anything:

- :func:`win_put` / :func:`win_accumulate`: ``tensor * dst_weights[r]`` overwrites / is added to the
  buffer that each destination ``r`` keeps for this rank (default: every out-neighbor, weight 1); then
  ``tensor *= self_weight`` in place (default 1), as in BlueFog;
- :func:`win_get`: each source's registered tensor ``* src_weights[r]`` is fetched into this rank's
  buffer for it (default: every in-neighbor, weight 1);
- :func:`win_update`: this rank's tensor becomes ``self_weight * tensor + sum_r src_weights[r] * buffer_r``
  (default: the static topology's pull weights), :func:`win_update_then_collect`:
  ``tensor += sum_r buffer_r`` and the buffers are zeroed;
- :func:`win_mutex` / :func:`win_lock` and ``require_mutex``: the distributed mutex of each rank's window.

Each ``win_put`` / ``win_accumulate`` / ``win_get`` has a ``_nonblocking`` form returning a
:class:`~lowband.comm.handle.Handle` (:func:`win_wait`, :func:`win_poll`). Ranks in ``dst_weights`` /
``src_weights`` / ``ranks`` must be neighbors in the window's static topology.

This module creates and frees windows and re-exports the rest: :mod:`~lowband.decentral.window_ops`
(put, accumulate, get and their handles), :mod:`~lowband.decentral.window_state` (update, versions,
state dicts), :mod:`~lowband.decentral.mutex` (the mutex). Transport:
:mod:`lowband.decentral.window_service` (a process group of its own and one receiver thread per
neighbor, which applies requests as they arrive; wire format in
:mod:`~lowband.decentral.window_protocol`).

Consistency model
-----------------
- *Completion means applied*: a put/accumulate/get handle is complete (its blocking form returns) once
  every destination has applied it (for get: once the data is in this rank's buffer). No destination's
  main thread takes part; a busy rank's window still receives.
- *Atomic operations*: each operation is applied under the window's lock, so it is atomic with respect
  to every other operation and to :func:`win_update`, :func:`win_update_then_collect`,
  :func:`get_win_version` and the state dict: a reader never sees half an update, and accumulate +
  update_then_collect conserve the total exactly (what makes push-sum exact). A get reads the source's
  registered tensor; the source's own in-place changes to that tensor (an optimizer step) are not
  covered by the window lock: hold ``win_mutex(name, for_self=True)`` while making them and pass
  ``require_mutex=True`` to the get to exclude torn reads.
- *Per-pair FIFO*: operations from one rank to another are applied in the order they were issued.
  Operations from different ranks interleave arbitrarily.
- *Mutex*: every rank's window has one distributed mutex, granted first come, first served.
  ``require_mutex=True`` makes an operation wait for (and hold, while it is applied) the destination's
  mutex; operations without it are applied even while someone holds the mutex. A rank that holds a
  neighbor's mutex (``win_mutex``) has its own operations to it applied at once. ``win_lock`` holds this
  rank's own mutex and holds back *every* incoming operation until it exits (their handles complete
  then). Acquire several mutexes in ascending rank order (``win_mutex`` does) to avoid deadlock.
- *Versions*: :func:`get_win_version` counts, per in-neighbor, the writes into its buffer since the last
  :func:`win_update` that read that buffer.
- *Failures*: every wait is bounded by the runtime timeout; a dead peer makes operations fail with
  :class:`CommFailedError` (or :class:`CommTimeoutError`); an error inside the service surfaces on this
  rank's next window call. A gloo timeout closes the window process group: the windows are then unusable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowband.comm import validate
from lowband.comm.agree import agree, crc
from lowband.decentral.mutex import WindowMutex, win_lock, win_mutex
from lowband.decentral.state import check_topology_arg, load_topology
from lowband.decentral.window_ops import (
    win_accumulate,
    win_accumulate_nonblocking,
    win_get,
    win_get_nonblocking,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_wait,
)
from lowband.decentral.window_protocol import check_flag
from lowband.decentral.window_service import (
    WindowRecord,
    WindowService,
    lookup,
    registry,
    service_for,
    where,
)
from lowband.decentral.window_state import (
    get_win_version,
    win_load_state_dict,
    win_state_dict,
    win_update,
    win_update_then_collect,
)
from lowband.errors import CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.runtime import current, destroy_group, world_group
from lowband.teardown import break_group
from lowband.topology import Topology

Tensor = torch.Tensor


# ---------------------------------------------------------------- create / free


def _signature(t: Tensor, name: str, topo: Topology) -> list[int]:
    """What every rank must create alike (checked with :func:`lowband.comm.agree.agree`)."""
    return [
        validate.DTYPE_CODES[t.dtype],
        t.dim(),
        crc(tuple(t.shape)),
        crc(name),
        crc(topo.weights.tobytes()),
    ]


_FIELDS = (
    "the dtype code",
    "the number of dimensions",
    "the shape hash",
    "the name hash",
    "the topology hash",
)


def win_create(
    tensor: Tensor,
    name: str,
    *,
    zero_init: bool = False,
    topology: Topology | None = None,
    group: Group | None = None,
) -> bool:
    """Register ``tensor`` as window ``name`` on every rank of ``group`` (collective; default: the world).

    The tensor itself (not a copy) is the window's registered value, read by neighbors' gets and written
    by :func:`win_update`. One buffer per in-neighbor of ``topology`` (default: the group's static
    topology, :func:`lowband.decentral.state.load_topology`) is made: a copy of ``tensor``, or zeros with
    ``zero_init``. Every rank must pass the same name, dtype, shape and topology. Returns True.
    """
    op = "win_create"
    ctx, g = world_group(group, op)
    at = where(op, ctx, name)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{where(op, ctx)}: name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise InvalidArgumentError(f"{at}: tensor must be a dense torch.Tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point or tensor.dtype not in validate.DTYPE_CODES:
        raise InvalidArgumentError(
            f"{at}: tensor has dtype {tensor.dtype}; windows hold floating-point tensors (weights apply)"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{at}: tensor is on {tensor.device}; windows live on the CPU or a GPU")
    zero_init = check_flag(at, "zero_init", zero_init)
    reg = registry(ctx)
    if name in reg.by_name:
        raise InvalidArgumentError(f"{at}: a window named {name!r} already exists; free it first (win_free)")
    topo = load_topology(g) if topology is None else check_topology_arg(op, ctx, topology, g.size, "topology")
    if g.size > 1:
        what = "the window to create (every rank gives the same name, dtype, shape and topology)"
        agree(g, what, _signature(tensor, name, topo), fields=_FIELDS, where=at)
    svc = service_for(ctx, g)
    svc.check()
    me = g.rank
    data = tensor.detach()
    ins = tuple(int(r) for r in topo.in_neighbors(me))
    rec = WindowRecord(
        name=name,
        wid=svc.next_wid,
        tensor=tensor,
        topology=topo,
        me=me,
        in_nbrs=ins,
        out_nbrs=tuple(int(r) for r in topo.out_neighbors(me)),
        buffers={r: torch.zeros_like(data) if zero_init else data.clone() for r in ins},
        versions=dict.fromkeys(ins, 0),
        mutex=WindowMutex(),
    )
    svc.next_wid += 1
    svc.register(rec)
    reg.by_name[name] = (svc, rec)
    svc.start_receivers(rec.peers)
    # nobody sends to a window that a neighbor has not registered yet
    agree(g, "the window registered", [rec.wid], fields=("the window id",), where=at)
    return True


def win_free(name: str | None = None) -> bool:
    """Free window ``name`` (every window with ``None``) on every rank of its group (collective).

    Waits for this rank's operations in flight, then a barrier: once it returns every operation any rank
    issued on the window has been applied. When a group's last window goes, its receiver threads stop
    (a later :func:`win_create` starts them again). Returns True.
    """
    op = "win_free"
    ctx = current(op)
    reg = registry(ctx)
    names = list(reg.by_name) if name is None else [name]
    for n in names:
        _, svc, rec = lookup(op, n)
        at = where(op, ctx, n)
        if rec.held or rec.mutex.holds_local():
            raise InvalidArgumentError(
                f"{at}: this rank still holds window mutexes (ranks {sorted(rec.held)}); exit win_mutex/win_lock first"
            )
        svc.wait_pending()
        agree(svc.group, "the window to free", [crc(n)], fields=("the name hash",), where=at)
        svc.drop(rec.wid)
        del reg.by_name[n]
        if not svc.windows:
            svc.stop(at)
    return True


def win_abandon(names: Sequence[str], *, timeout: float) -> None:
    """Give up windows ``names`` on this rank alone, with no collective (a peer is lost: ``win_free``'s
    barrier would wait for it; :mod:`lowband.decentral.winput_strategy`). A local step: this rank's
    connections of their groups' window process groups are closed (:func:`lowband.teardown.break_group`),
    so every receive pending on them ends at once, here and at the peers (whose next operation toward this
    rank fails: they notice the loss too); this rank's receivers for those groups are joined (at most
    ``timeout`` seconds each, else :class:`CommTimeoutError`), its operations in flight are forgotten
    (their handles fail), and the windows and their groups' services are dropped. What the windows'
    buffers held is lost. Names not on this rank are skipped. Other windows of the same groups stop
    receiving too (their service's connections are closed): give every window of a group that lost a
    peer."""
    op = "win_abandon"
    ctx = current(op)
    reg = registry(ctx)
    services: dict[int, WindowService] = {}
    for n in names:
        entry = reg.by_name.pop(n, None)
        if entry is not None:
            entry[0].drop(entry[1].wid)
            services[id(entry[0])] = entry[0]
    for svc in services.values():
        svc.stopping = True  # (set first: a receiver whose receive fails now ends without an error)
        if svc.group.size > 1:
            break_group(svc.channel.group)
        for p, t in svc.receivers.items():
            t.join(timeout)
            if t.is_alive():
                raise CommTimeoutError(
                    f"{where(op, ctx)}: the window receiver for rank {p} did not stop within {timeout:g} s"
                )
        svc.receivers.clear()
        svc.pending = []
        if not svc.windows:
            reg.services = {k: v for k, v in reg.services.items() if v[1] is not svc}
            if svc.group.size > 1:
                destroy_group(svc.channel.group)


def window_names() -> list[str]:
    """Names of this rank's windows, in creation order."""
    return list(registry(current("window_names")).by_name)


__all__ = [
    "get_win_version",
    "win_abandon",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_load_state_dict",
    "win_lock",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_state_dict",
    "win_update",
    "win_update_then_collect",
    "win_wait",
    "window_names",
]
