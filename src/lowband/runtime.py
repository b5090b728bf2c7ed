"""The runtime context: who am I, who are my peers, which process groups exist.

One context per rank. In a normal program (torchrun, ``lowband run``, :func:`lowband.launch`, or a
plain ``python`` with no launcher, which makes a world of one) the context is process-wide. The test
harness runs ranks as threads of one process; each thread then has a context of its own with its own
gloo process group, so nothing here may assume one rank per process.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore, PrefixStore  # type: ignore[attr-defined]

from lowband import devices
from lowband.comm import contract
from lowband.comm.handle import check_timeout
from lowband.comm.trace import Tracer
from lowband.config import Config
from lowband.errors import InvalidArgumentError, LowbandError, NotInitializedError
from lowband.group import Group
from lowband.rendezvous import join_env
from lowband.teardown import break_connections, close_pg, join_threads, lowband_threads, release_pgs


@dataclass(eq=False)
class Context:
    rank: int
    size: int
    local_rank: int
    local_size: int
    config: Config
    world: Group
    tracer: Tracer
    threaded: bool = False
    #: the device this rank computes on (lowband.device()): cuda:LOCAL_RANK when CUDA is present
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    store: Any = None
    owns_default_pg: bool = False
    #: a replacement of a lost rank (``LOWBAND_JOIN=1``, set by ``lowband run --replacements``): its world
    #: is itself alone until a strategy with ``on_peer_loss="continue"`` admits it
    #: (:mod:`lowband.strategies.peer_join`); ``store`` is then the members' rendezvous store
    joining: bool = False
    local_group: Group | None = None
    machine_group: Group | None = None
    #: per-rank state of subsystems built on the core (the decentralized topology, window
    #: registries, ...), keyed by the subsystem's module name; never module-level globals
    state: dict[str, Any] = field(default_factory=dict, repr=False)
    _group_counter: int = field(default=0, repr=False)
    _groups: list[Group] = field(default_factory=list, repr=False)

    @property
    def machine_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def machine_size(self) -> int:
        return self.size // self.local_size

    def timeout_td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.timeout)


_global: Context | None = None
_local = threading.local()


def current(op: str = "this operation") -> Context:
    """The calling rank's context; raises :class:`NotInitializedError` naming ``op`` if there is none."""
    ctx: Context | None = getattr(_local, "ctx", None) or _global
    if ctx is None:
        raise NotInitializedError(
            f"lowband.{op}: lowband is not initialised on this process; call lowband.init() first"
        )
    return ctx


def is_initialized() -> bool:
    return (getattr(_local, "ctx", None) or _global) is not None


def _resolve_local_size(size: int, local_size: int | None) -> int:
    if local_size is None:
        env = os.environ.get("LOWBAND_LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
        local_size = int(env) if env else size
    if local_size < 1 or size % local_size != 0:
        raise InvalidArgumentError(
            f"lowband.init: local_size={local_size} must be >= 1 and divide the world size {size} "
            "(ranks are laid out machine by machine, local_size ranks per machine)"
        )
    return local_size


def init(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    check: bool | None = None,
    fusion_threshold: int | None = None,
    trace: bool | None = None,
    local_size: int | None = None,
    device: str | torch.device | None = None,
    emulate_nccl: bool | None = None,
) -> Context:
    """Initialise lowband on this process.

    Under torchrun or ``lowband run`` it joins the world described by the ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``/``MASTER_PORT`` environment (env://). If torch.distributed is already initialised
    it adopts the default process group. With no launcher at all it makes a world of one.

    ``local_size`` ranks form one machine (default: ``LOWBAND_LOCAL_SIZE``, else torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole world); it may be set smaller to emulate several machines.
    ``device`` (default: ``LOWBAND_DEVICE``, else ``auto``) picks the device this rank computes on and
    binds it before any process group exists (:mod:`lowband.devices`): with CUDA, ``cuda:LOCAL_RANK``
    and NCCL's communicator created eagerly for it; ``lowband.device()`` returns it. The default backend
    (``backend``, else ``LOWBAND_BACKEND``) is ``cpu:gloo,cuda:nccl`` on a GPU and ``gloo`` on the CPU
    (``gloo`` lets several ranks share one GPU); whatever the backend, lowband's control
    messages go on a CPU gloo group of its own.
    ``emulate_nccl`` (default: ``LOWBAND_EMULATE_NCCL=1``) makes the default process group the
    NCCL-semantics emulator over gloo (:mod:`lowband.comm.nccl_emulator`, CPU CI): lowband's data group
    and torch's default group then enforce NCCL's contract; the control group stays plain gloo.
    Calling ``init`` again returns the existing context.
    """
    global _global
    if timeout is not None:
        check_timeout("lowband.init", timeout)
    if is_initialized():
        return current()
    config = Config.from_env(timeout, check, fusion_threshold, trace)
    check_timeout("lowband.init (LOWBAND_TIMEOUT)", config.timeout)
    td = datetime.timedelta(seconds=config.timeout)
    owns = False
    adopted = dist.is_initialized()
    backend = backend if backend is not None else (os.environ.get("LOWBAND_BACKEND") or None)
    be = backend if backend is not None or not adopted else str(dist.get_backend())
    local_guess = devices.env_local("LOCAL_WORLD_SIZE", 1)
    dev = devices.select(device, devices.env_local("LOCAL_RANK", 0), local_guess, be)
    devices.bind(dev)
    if not adopted:
        from lowband.comm import nccl_emulator

        if emulate_nccl or (emulate_nccl is None and nccl_emulator.enabled_from_env()):
            if dev.type != "cpu":
                raise InvalidArgumentError(
                    "lowband.init: the NCCL emulator runs on CPU tensors; set LOWBAND_DEVICE=cpu with it"
                )
            be = nccl_emulator.register_backend()
        be = be or devices.default_backend(dev)
        # eager NCCL set-up for this rank's GPU (torch creates the communicator at init, not lazily)
        eager: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" and "nccl" in be else {}
        if "nccl" in be:  # a failed or timed-out NCCL op raises in Python (lowband.comm.contract)
            contract.nccl_env()
        gtd = contract.group_timeout(config.timeout, be)  # NCCL's watchdog fires after lowband's error
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get("LOWBAND_JOIN") == "1":
            return _init_joiner(be, gtd, config, dev, eager)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            store, r, n = join_env(config.timeout)  # names the ranks that did not join, if any
            dist.init_process_group(be, store=store, rank=r, world_size=n, timeout=gtd, **eager)
        else:
            dist.init_process_group(be, store=HashStore(), rank=0, world_size=1, timeout=gtd, **eager)
        owns = True
    rank, size = dist.get_rank(), dist.get_world_size()
    ls = _resolve_local_size(size, local_size)
    ctl = dist.new_group(list(range(size)), timeout=td, backend="gloo") if size > 1 else None
    world = Group(dist.group.WORLD, tuple(range(size)), rank, "world", ctl=ctl)
    ctx = Context(
        rank, size, rank % ls, ls, config, world, Tracer(rank, config.trace), owns_default_pg=owns, device=dev
    )
    _global = ctx
    _make_hierarchy(ctx)
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    return ctx


def _init_joiner(
    be: str, gtd: datetime.timedelta, config: Config, dev: torch.device, eager: dict[str, Any]
) -> Context:
    """:func:`init` for a replacement of a lost rank (``LOWBAND_JOIN=1``): the rank it replaces, in a world
    of its own (torch's default group is this process alone) until a strategy admits it; its
    :attr:`Context.store` is the view of the rendezvous store the members' default group has."""
    global _global
    import uuid

    store, r, n = join_env(config.timeout)  # the world met long ago: every rank's key is there
    own = PrefixStore(f"lowband/joiner/{r}/{uuid.uuid4().hex}", store)
    dist.init_process_group(be, store=own, rank=0, world_size=1, timeout=gtd, **eager)
    name = dist.distributed_c10d._get_default_group().group_name  # the members' default group: the same
    world = Group(dist.group.WORLD, (r,), 0, "joiner")
    ctx = Context(
        r, n, 0, n, config, world, Tracer(r, config.trace), owns_default_pg=True, device=dev,
        store=PrefixStore(f"{name}/", store), joining=True,
    )  # fmt: skip
    _global = ctx
    ctx.local_group = world
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    return ctx


def init_thread_rank(
    store: Any,
    rank: int,
    size: int,
    config: Config,
    local_size: int | None = None,
    emulate_nccl: bool = False,
) -> Context:
    """Make this *thread* a rank of its own gloo world (used by :mod:`lowband.testing`). ``emulate_nccl``:
    the world's data group is an NCCL-semantics emulator over gloo (lowband.comm.nccl_emulator); the
    control group stays plain gloo."""
    ls = _resolve_local_size(size, local_size if local_size is not None else size)
    pg: Any = dist.ProcessGroupGloo(
        PrefixStore("lowband/world", store), rank, size, datetime.timedelta(seconds=config.timeout)
    )
    if emulate_nccl:
        from lowband.comm.nccl_emulator import STATE_KEY, emulate

        pg = emulate(pg, PrefixStore("lowband/world-emu", store), rank, size, "world", config.timeout)
    ctl = dist.ProcessGroupGloo(
        PrefixStore("lowband/world-ctl", store), rank, size, datetime.timedelta(seconds=config.timeout)
    )
    world = Group(pg, tuple(range(size)), rank, "world", ctl=ctl)
    ctx = Context(
        rank, size, rank % ls, ls, config, world, Tracer(rank, config.trace), threaded=True, store=store
    )
    if emulate_nccl:
        ctx.state[STATE_KEY] = True  # groups made later (new_group, hierarchy) read it
    _local.ctx = ctx
    _make_hierarchy(ctx)
    return ctx


def bind_thread(ctx: Context | None) -> None:
    """Make the calling thread act for ``ctx``'s rank (a worker thread started by that rank, such as an
    asynchronous compression executor, sees the rank's context and groups); ``None`` unbinds it."""
    _local.ctx = ctx


def _make_hierarchy(ctx: Context) -> None:
    """Build the intra-machine and cross-machine groups when there is more than one machine."""
    if ctx.machine_size == 1:
        ctx.local_group = ctx.world
        return
    ls = ctx.local_size
    for m in range(ctx.machine_size):
        g = _new_group(ctx, list(range(m * ls, (m + 1) * ls)), f"machine{m}")
        if g is not None:
            ctx.local_group = g
    for lr in range(ls):
        g = _new_group(ctx, list(range(lr, ctx.size, ls)), f"local_rank{lr}")
        if g is not None:
            ctx.machine_group = g


def _new_group(ctx: Context, ranks: list[int], name: str) -> Group | None:
    key = ctx._group_counter
    ctx._group_counter += 1
    if ctx.threaded:
        if ctx.rank not in ranks:
            return None
        me, n, td = ranks.index(ctx.rank), len(ranks), ctx.timeout_td()
        pg: Any = dist.ProcessGroupGloo(PrefixStore(f"lowband/group{key}", ctx.store), me, n, td)
        ctl: Any = dist.ProcessGroupGloo(PrefixStore(f"lowband/group{key}-ctl", ctx.store), me, n, td)
        from lowband.comm import nccl_emulator

        if ctx.state.get(nccl_emulator.STATE_KEY):  # the thread ranks' data groups are emulated too
            store = PrefixStore(f"lowband/group{key}-emu", ctx.store)
            pg = nccl_emulator.emulate(pg, store, me, n, name, ctx.config.timeout)
    else:
        pg = dist.new_group(
            ranks=ranks, timeout=contract.group_timeout(ctx.config.timeout, str(dist.get_backend()))
        )
        ctl = dist.new_group(ranks=ranks, timeout=ctx.timeout_td(), backend="gloo")
        if ctx.rank not in ranks:
            return None
    g = Group(pg, tuple(ranks), ranks.index(ctx.rank), name, ctl=ctl, key=f"group{key}")
    ctx._groups.append(g)
    return g


def new_group(ranks: list[int], name: str | None = None) -> Group | None:
    """Create a process group of the given world ranks. Every rank of the world must call it, in the same
    order (as with ``torch.distributed.new_group``); ranks outside ``ranks`` get ``None``."""
    ctx = current("new_group")
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(
            f"lowband.new_group on rank {ctx.rank}: name must be a str or None, got {type(name).__name__}"
        )
    rl = list(ranks)
    if not rl or len(set(rl)) != len(rl) or any(not isinstance(r, int) or not 0 <= r < ctx.size for r in rl):
        raise InvalidArgumentError(
            f"lowband.new_group on rank {ctx.rank}: ranks must be distinct world ranks in [0, {ctx.size}), got {rl}"
        )
    return _new_group(ctx, sorted(rl), name or f"group{ctx._group_counter}")


def rendezvous_store(ctx: Context) -> Any:
    """The key-value store the ranks met through: the test harness's store for thread ranks, else the
    default process group's store (torch keeps it private; this is the one place lowband reads it)."""
    if ctx.threaded or ctx.joining:
        return ctx.store
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def open_member_group(ctx: Context, g: Group, key: str, name: str) -> Group:
    """A new gloo process group over ``g``'s ranks (no control group of its own): :func:`open_group`."""
    return open_group(ctx, g.ranks, key, name, control=False)


def open_group(ctx: Context, ranks: tuple[int, ...], key: str, name: str, *, control: bool = True) -> Group:
    """A new gloo group over the world ranks ``ranks`` (with ``control``, a second process group for its
    control messages), made from the rendezvous store under ``key`` (unique in the run). Only the members
    call it, all of them, in the same order; it needs nothing from the other ranks (a private channel, a
    membership change: :mod:`lowband.strategies.peer_loss`), is not in torch's group registry, and
    :func:`shutdown` closes it."""
    store, me, n, td = rendezvous_store(ctx), ranks.index(ctx.rank), len(ranks), ctx.timeout_td()
    if not control:
        g = Group(dist.ProcessGroupGloo(PrefixStore(key, store), me, n, td), ranks, me, name, key=key)
    else:
        pg = dist.ProcessGroupGloo(PrefixStore(f"{key}/data", store), me, n, td)
        ctl = dist.ProcessGroupGloo(PrefixStore(f"{key}/ctl", store), me, n, td)
        g = Group(pg, ranks, me, name, ctl=ctl, key=key)
    ctx._groups.append(g)
    return g


def destroy_group(group: Group) -> None:
    """Free a group made by :func:`new_group`: its process groups, their connections (~13 file descriptors
    per rank) and threads. A local step on each member (nothing is communicated); every member should call
    it once every op on the group is waited. Ops on a destroyed group raise :class:`InvalidArgumentError`;
    destroying it again does nothing. :func:`shutdown` destroys the groups lowband made. The sockets are
    released once nothing refers to the process groups any more (views made with ``Group.unchecked()``
    hold them too)."""
    ctx = current("destroy_group")
    if not isinstance(group, Group):
        raise InvalidArgumentError(
            f"lowband.destroy_group on rank {ctx.rank}: group must be a lowband Group, got {type(group).__name__}"
        )
    if group.pg is ctx.world.pg:
        raise InvalidArgumentError(
            f"lowband.destroy_group on rank {ctx.rank}: the world group lives until lowband.shutdown()"
        )
    if group.destroyed:
        return
    group._destroyed.set()
    ctx._groups[:] = [g for g in ctx._groups if g.pg is not group.pg]
    pgs = {id(p): p for p in (group.ctl, group.pg)}
    # torch frees a process group's sockets when the last reference goes: drop this one's (views of
    # the group made with ``unchecked`` before now keep theirs until they are dropped)
    group.pg = group.ctl = None
    for pg in pgs.values():
        close_pg(pg)


def shutdown() -> None:
    """Tear down this rank's context: destroy the groups lowband made (newest first), then
    torch.distributed if lowband initialised it. Runs at interpreter exit for a process that did not
    call it.

    A lowband thread (the completion thread waiting on a send/recv, a window receiver) still blocked in a gloo wait
    when the interpreter finalizes aborts the process as the wait returns ("terminate called without an
    active exception", exit -6), after the work succeeded. So first, while the interpreter still runs:
    give such threads a moment to end, close the connections their receives wait on (they fail and end:
    :func:`lowband.teardown.break_connections`) and wait for them."""
    global _global
    from lowband.comm.engine import close_engines
    from lowband.comm.heartbeat import finish_heartbeats

    ctx = getattr(_local, "ctx", None)
    if ctx is not None:
        finish_heartbeats(ctx)  # this rank is done: the others still training do not take it as lost
        close_engines(ctx)
        _local.ctx = None
        for g in [*reversed(ctx._groups), ctx.world]:
            g._destroyed.set()
            for pg in (g.pg, g.ctl):
                try:
                    pg.shutdown()
                except (RuntimeError, AttributeError):
                    pass
        return
    if _global is None:
        return
    ctx, _global = _global, None
    finish_heartbeats(ctx)
    close_engines(ctx)
    if join_threads(lowband_threads(), 0.2):
        break_connections(ctx)
        join_threads(lowband_threads(), 5.0)
    for g in reversed(ctx._groups):
        g._destroyed.set()
        close_pg(g.ctl)
        close_pg(g.pg)
        g.pg = g.ctl = None
    ctx._groups.clear()
    ctx.world._destroyed.set()
    close_pg(ctx.world.ctl)
    ctx.world.ctl = None
    if ctx.owns_default_pg and dist.is_initialized():
        dist.destroy_process_group()
    ctx.world.pg = None
    release_pgs()


def _at_exit() -> None:
    """Interpreter exit: shut down (see there why), then destroy the process groups lowband did not make
    (the default one that a user, Accelerate or Lightning initialised and lowband adopted) while the
    interpreter still runs.

    A gloo worker thread drops the last reference to a finished work (and to its tensors) after the rank
    has seen it finish. Dropping a tensor that Python knew takes the GIL; during interpreter finalization
    that ends the thread inside a C++ destructor, which aborts the process ("terminate called without an
    active exception", exit -6) after a run that succeeded: torch's open issue 190489, which any torch
    program that exits without ``destroy_process_group`` can meet. Destroying a process group joins its
    workers, and torch releases the GIL while it does. ``atexit`` runs hooks newest first, so those
    registered after ``init`` (the window service's, which stops its peers' receivers) have run.

    Then what is left is frozen (``gc.freeze``): finalization's own full collections walk every object a
    torch process holds (some 300,000), and they were what kept a rank from exiting: 1.9-3.4 s from a
    raised communication error to the process's end (a survivor of a stopped peer, 3 ranks on 2 cores),
    0.5 s frozen. Nothing lowband owns is left to a collection by then (its groups are destroyed), and
    Python never promised ``__del__`` at exit to objects still alive there."""
    try:
        shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()  # every group still in torch's registry
            release_pgs()
        gc.freeze()
    except Exception:  # exiting anyway: never turn a finished run into a failed exit
        pass


def set_check(enabled: bool) -> None:
    """Turn the cross-rank argument check on or off for this rank's later ops. Every rank must make the
    same call at the same point of the program (the check is itself a collective)."""
    import dataclasses

    ctx = current("set_check")
    ctx.config = dataclasses.replace(ctx.config, check=bool(enabled))


def world_group(group: Group | None, op: str) -> tuple[Context, Group]:
    ctx = current(op)
    if group is None:
        return ctx, ctx.world
    if not isinstance(group, Group):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {ctx.rank}: group must be a lowband Group (from lowband.new_group), "
            f"got {type(group).__name__}"
        )
    if group.destroyed:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {ctx.rank}: group {group.name!r} was destroyed (lowband.destroy_group)"
        )
    return ctx, group


def device() -> torch.device:
    """The device this rank computes on (bound by :func:`init`; see :mod:`lowband.devices`)."""
    return current("device").device


def rank() -> int:
    return current("rank").rank


def size() -> int:
    return current("size").size


def local_rank() -> int:
    return current("local_rank").local_rank


def local_size() -> int:
    return current("local_size").local_size


def machine_rank() -> int:
    return current("machine_rank").machine_rank


def machine_size() -> int:
    return current("machine_size").machine_size


def world() -> Group:
    return current("world").world


def local_group() -> Group:
    g = current("local_group").local_group
    if g is None:  # pragma: no cover - set by _make_hierarchy
        raise LowbandError("lowband.local_group: no intra-machine group")
    return g


def machine_group() -> Group | None:
    """Group of the ranks with this rank's local rank on every machine (None on a single machine)."""
    return current("machine_group").machine_group
