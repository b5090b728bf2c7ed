"""Two-stage compressed allreduce with server-side error feedback ("twostage"), the scheme of the 1-bit
Adam / 1-bit LAMB papers (DeepSpeed's compressed allreduce), for any compressor.

1. Worker: the unit's flat gradient plus the worker memory (the reducer's error feedback, on the whole
   tensor) is compressed chunk by chunk (``f"{unit}#shard{j}"``), and one all-to-all sends chunk ``j``'s
   payload to rank ``j``.
2. Server: rank ``j`` averages the decodes of every rank's chunk ``j`` (in rank order), adds its server
   memory, compresses the result again (``f"{unit}#server{j}"``) and keeps what that compression lost
   as its new server memory.
3. One allgather brings every chunk's compressed average to every rank, which decodes all of them:
   every rank holds the same, bit-identical result.

Both directions are compressed, so with a 1-bit format a rank sends and receives about ``2 * (n-1)/n``
bits per element, against the parameter-server pattern's full-precision return.

Chunks. Chunk ``j`` is the ``j``-th of ``n`` near-equal parts of *every parameter* of the unit
(:func:`~lowband.compress.ps.parameter_shards`), not of the unit's flat tensor: so the server memory is
kept per parameter name (each rank holds its part of each parameter it serves), goes into
``state_dict`` as ``{name: tensor}``, and stays exact when the units are rebucketed (a parameter's part
depends on the parameter and ``n`` only). DeepSpeed instead pads the flat buffer to a multiple of
``8n`` and splits it evenly; its server error is lost on checkpoint load. DeepSpeed also scales the
worker's signs by one norm of the whole tensor; here each chunk is compressed separately, so a scaled
compressor computes its scale per chunk.

Another world size. A rank's server memory holds its parts only; a state saved at ``n`` ranks is
loaded at ``m != n`` ranks by :func:`reshard_server_memories` (pure: per parameter, the ``n`` parts
concatenated in rank order and split again into ``m``), given every rank's state. A single state
loaded at another world size (without re-sharding) is dropped with a warning at the first reduction,
and the server memory starts from zero.

Blocking: as in :mod:`lowband.compress.ps`, the all-to-all and the server's work are waited for inside
``reduce``; the returned handle waits for the allgather.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowband.comm.gather import iallgather
from lowband.comm.handle import Handle
from lowband.compress.allgather import rank_context, read_payload, split_frames, wire_bytes
from lowband.compress.base import CompressContext, Compressor, Payload
from lowband.compress.memory import Memory, ResidualMemory, Segments
from lowband.compress.ps import (
    PSCompressedReducer,
    Shard,
    parameter_shards,
    scatter_shard,
    shard_segments,
    split_sizes,
)
from lowband.compress.reducer import TRANSPORT_OPTIONS, TRANSPORTS
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import Unit
from lowband.options import Opt, Options

Tensor = torch.Tensor


def server_context(cctx: CompressContext, j: int) -> CompressContext:
    """The context of chunk ``j``'s server payload (its owner's rank ``j``; the same on every rank)."""
    return rank_context(cctx, j, f"{cctx.name}#server{j}")


@TRANSPORTS.registering(
    "twostage",
    "compressed alltoall to chunk owners, server error feedback, compressed allgather",
    TRANSPORT_OPTIONS
    | Options({"server_memory": Opt(bool, doc="the servers' error feedback (false: an ablation)")}),
)
class TwoStageCompressedReducer(PSCompressedReducer):
    """Two-stage compressed allreduce; see the module docstring. ``server_memory=False`` drops the
    server's error feedback (an ablation).

    Bytes per rank ``me`` (lowband's counters): the all-to-all as the ``ps`` transport's
    (``sum_{j != me} B[me][j]`` sent, ``sum_{q != me} B[q][me]`` received); the allgather sends and
    receives ``(n - 1) * max_j S[j]``, ``S[j]`` the size of chunk ``j``'s server payload (for a
    fixed-size compressor ``S[j] = B[.][j]``; a data-dependent one adds ``8 * (1 + 2k)`` header bytes
    to each payload of either phase).
    """

    transport = "twostage"

    def __init__(
        self,
        compressor: Compressor | str,
        memory: Memory | str | None = "residual",
        *,
        seed: int = 0,
        server_memory: bool = True,
    ) -> None:
        super().__init__(compressor, memory, seed=seed)
        #: the server's error feedback (this rank's part of each parameter), or None
        self.server: ResidualMemory | None = ResidualMemory() if server_memory else None
        #: the world size the server memory's parts were cut for (None: not known yet)
        self.server_world: int | None = None

    def layout(self, segs: Segments, n: int) -> tuple[Shard, ...]:
        return parameter_shards(segs, n)

    def _check_world(self, n: int) -> None:
        if self.server is None or self.server_world == n:
            return
        if self.server_world is not None and self.server.tensors:
            warnings.warn(
                f"{type(self).__name__}: the server memory was cut for {self.server_world} ranks and the "
                f"group has {n}; it starts from zero (re-shard every rank's state with "
                "lowband.compress.reshard_server_memories to keep it)",
                RuntimeWarning,
                stacklevel=4,
            )
            self.server.tensors = {}
        self.server_world = n

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        sp = self.sharded(payload)
        n, me = group.size, group.rank
        self._check_world(n)
        avg = self.to_owners(sp, cctx, unit, group)
        # the server: its memory added, compressed again, what was lost remembered
        t0 = time.perf_counter()
        with torch.no_grad():
            segs = shard_segments(sp.layout[me])
            sctx = server_context(cctx, me)
            c = self.server.compensate(segs, avg) if self.server is not None else avg
            spay = self.compressor.compress(c, sctx)
            if self.server is not None:
                self.server.update(segs, c, self.compressor.decompress(spay, sctx))
        self.timings.compress_s += time.perf_counter() - t0
        fixed = self.compressor.fixed_size
        buf = wire_bytes(spay, fixed, c.device)
        if fixed:  # chunk j's server payload has the layout of any payload of chunk j's size
            sizes = [pl.nbytes for pl in sp.shards]
            h = iallgather(buf, sizes=sizes, name=unit.key, group=group)
        else:
            h = iallgather(buf, name=unit.key, group=group)

        def finish(allb: Tensor) -> Tensor:
            if fixed:
                parts, pos = [], 0
                for s in sizes:
                    parts.append(allb[pos : pos + s])
                    pos += s
            else:
                parts = split_frames(allb, n)
            out = torch.empty(sp.numel, dtype=sp.dtype, device=allb.device)
            for j, (b, shard) in enumerate(zip(parts, sp.layout, strict=True)):
                pl = read_payload(b, sp.shards[j], fixed)
                scatter_shard(out, shard, self.decode(pl, server_context(cctx, j)))
            return out

        return h.map(finish)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.server is not None:
            state["server"] = {"world_size": self.server_world, "memory": self.server.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        server = state.get("server")
        if self.server is None:
            if server is not None and server.get("memory", {}).get("tensors"):
                raise InvalidArgumentError(
                    f"{type(self).__name__}.load_state_dict: the state holds a server memory but this "
                    "reducer was built with server_memory=False"
                )
            return
        if server is None:
            self.server.tensors = {}
            self.server_world = None
            return
        if not isinstance(server, Mapping) or "memory" not in server:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: 'server' must be a dict with 'world_size' and 'memory'"
            )
        self.server.load_state_dict(server["memory"])
        w = server.get("world_size")
        self.server_world = w if isinstance(w, int) and not isinstance(w, bool) else None


def reshard_server_memories(states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Every rank's :class:`TwoStageCompressedReducer` state (in rank order) as states for
    ``world_size`` ranks: the worker memories by :func:`~lowband.compress.memory.reshard_memories`
    (their sum over ranks kept), the server memory exactly (per parameter, the parts of the old ranks
    concatenated in rank order, then cut into ``world_size`` parts). Pure (no communication)."""
    from lowband.compress.memory import reshard_memories

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(
            f"reshard_server_memories: world_size must be an int >= 1, got {world_size!r}"
        )
    if not states or any(not isinstance(s, Mapping) or "memory" not in s for s in states):
        raise InvalidArgumentError(
            "reshard_server_memories: expects every rank's reducer state (with 'memory')"
        )
    workers = reshard_memories([s["memory"] for s in states], world_size)
    out: list[dict[str, Any]] = [
        {"memory": w, "compressor": dict(states[0].get("compressor", {}))} for w in workers
    ]
    servers = [s.get("server") for s in states]
    if all(sv is None for sv in servers):
        return out
    if any(sv is None for sv in servers):
        raise InvalidArgumentError(
            "reshard_server_memories: some ranks' states hold a server memory, others not"
        )
    old = {sv.get("world_size") for sv in servers if sv is not None and sv["memory"].get("tensors")}
    if old and old != {len(states)}:
        raise InvalidArgumentError(
            f"reshard_server_memories: {len(states)} states, cut for world sizes {sorted(map(str, old))}"
        )
    names = sorted({k for sv in servers if sv is not None for k in sv["memory"].get("tensors", {})})
    parts: list[dict[str, Tensor]] = [{} for _ in range(world_size)]
    for name in names:
        pieces = [sv["memory"]["tensors"].get(name) for sv in servers if sv is not None]
        if any(p is None for p in pieces):
            raise InvalidArgumentError(
                f"reshard_server_memories: parameter {name!r} has a server memory on some ranks only"
            )
        full = torch.cat([p for p in pieces if p is not None])
        pos = 0
        for j, size in enumerate(split_sizes(full.numel(), world_size)):
            parts[j][name] = full[pos : pos + size].clone()
            pos += size
    kind = servers[0]["memory"].get("kind", "residual") if servers[0] is not None else "residual"
    for j in range(world_size):
        out[j]["server"] = {
            "world_size": world_size,
            "memory": {"kind": kind, "beta": 1.0, "tensors": parts[j]},
        }
    return out
