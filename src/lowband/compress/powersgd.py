"""PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization"), as the transport ``"powersgd"`` of the compressed reducers.

It computes what torch's ``powerSGD_hook`` computes on the same gradients, options and seed, bit for
bit: before ``start_iter`` a plain average (each gradient divided by the group size, then summed);
then per unit, each gradient viewed as a matrix ``M`` (``shape[0]`` rows) is compressed when
``(rows + cols) * r * min_compression_rate < rows * cols`` (``r = min(rows, cols, rank)``), the rest
averaged in one buffer; for the compressed ones ``P = M Q`` summed over ranks in one buffer,
orthogonalized, ``Q = M^T P`` averaged in one buffer, and ``M ~ P Q^T``. Matrices are taken grouped by
shape (first occurrence order) as torch does, so the summed buffers have torch's layout and sum order.
``Q`` starts from ``torch.randn`` under a seed drawn from ``numpy.random.RandomState(seed)`` (one draw
per unit that needs it: every step without ``warm_start``, the first compressed step of a unit with
it), and is reused (re-orthogonalized) across steps with ``warm_start``.

Error feedback is the reducer's memory: ``"residual"`` is torch's ``use_error_feedback`` (the memory
holds the compensated gradient minus the unit's *averaged* result, compressed or not, as torch's hook
does), ``"none"`` turns it off. The compressor carries the three summed buffers (uncompressed
gradients, P, Q) on the wire: it must be summable (identity by default; ``fp16`` halves them).

Differences from torch's hook, all in state, none in arithmetic: the error memory, the ``Q`` factors
and the units already seen are keyed by parameter name, never by bucket index, so they survive a
rebucketing and go into ``state_dict`` (with the random state and the iteration counter); hence
``start_iter`` may be 0 or 1 (torch needs 2 with error feedback or warm start, because DDP rebuilds its
buckets after the first iteration). ``P`` is not kept: it is recomputed from ``Q`` at every step.

Collective order. The second round depends on the first, and lowband issues every collective on the
caller's thread in program order (torch's hook issues its later rounds from callback threads). So
:meth:`PowerSGDReducer.reduce` issues the uncompressed buffer's and P's allreduces, waits for them
(bounded), computes Q and returns a handle over Q's allreduce: one small round on the caller's path.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lowband.comm.handle import Handle
from lowband.comm.reduce import iallreduce
from lowband.compress.base import CompressContext, Compressor, Payload
from lowband.compress.memory import Memory, NoMemory, reshard_memories
from lowband.compress.reducer import (
    TRANSPORT_OPTIONS,
    TRANSPORTS,
    CompressedReducer,
    flatten,
    segments,
    unflatten_into,
)
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import ReduceContext, Unit
from lowband.options import Opt, Options

Tensor = torch.Tensor


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalize the columns of each matrix of a batch ``(b, n, r)`` in place, as torch's hook:
    Gram-Schmidt for ``r <= 2`` or half precision (``epsilon`` added to each column's norm), else QR."""
    b, _, r = matrices.shape
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrices[:, :, i : i + 1]
            if epsilon == 0:
                col /= torch.norm(col, dim=1, keepdim=True)
            else:
                col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < r:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(
            matrices, out=(matrices, torch.empty(b, r, r, dtype=matrices.dtype, device=matrices.device))
        )
    return matrices


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether a ``rows x cols`` matrix is worth compressing at rank ``rank`` (torch's rule)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def _matrix_shape(g: Tensor) -> tuple[int, int]:
    if g.dim() == 0 or g.numel() == 0:
        return (1, g.numel())  # never compressed (a scalar, or an empty gradient)
    return (g.shape[0], g.numel() // g.shape[0])


def _same(a: Any, b: Any) -> bool:
    """Deep equality of state values (tensors exactly, dtype and shape included)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@TRANSPORTS.registering(
    "powersgd",
    "PowerSGD low-rank factors averaged by two allreduces (torch's powerSGD_hook)",
    TRANSPORT_OPTIONS
    | Options(
        {
            "seed": Opt(int, min=0, lt=2**32, doc="torch's random_seed (numpy's RandomState)"),
            "rank": Opt(int, min=1, doc="matrix_approximation_rank"),
            "start_iter": Opt(int, min=0, unit="steps", doc="start_powerSGD_iter: plain averaging before"),
            "min_compression_rate": Opt(float, min=0, doc="tensors compressed less than this go whole"),
            "warm_start": Opt(bool, doc="Q reused from the last step"),
            "orthogonalization_epsilon": Opt(float, min=0, doc="added in the Gram-Schmidt division"),
            "batch_same_shape": Opt(bool, doc="batch_tensors_with_same_shape"),
        }
    ),
)
class PowerSGDReducer(CompressedReducer):
    """PowerSGD; see the module docstring. ``rank`` is torch's ``matrix_approximation_rank``,
    ``start_iter`` its ``start_powerSGD_iter``, ``batch_same_shape`` its
    ``batch_tensors_with_same_shape``, ``seed`` its ``random_seed``."""

    transport = "powersgd"

    def __init__(
        self,
        compressor: Compressor | str = "identity",
        memory: Memory | str | None = "residual",
        *,
        seed: int = 0,
        rank: int = 1,
        start_iter: int = 1000,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        batch_same_shape: bool = False,
    ) -> None:
        super().__init__(compressor, memory, seed=seed)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = warm_start
        self.epsilon = float(orthogonalization_epsilon)
        self.batch_same_shape = batch_same_shape
        self.rng = np.random.RandomState(seed)
        self.q: dict[str, Tensor] = {}
        self.seen: set[tuple[str, ...]] = set()
        self.iteration = 0
        self.last_step: int | None = None

    def check_compressor(self, compressor: Compressor) -> None:
        if not compressor.summable:
            raise InvalidArgumentError(
                f"{type(self).__name__}: the factors are summed on the wire; compressor {compressor.name!r} "
                "is not summable (use identity, fp16 or bf16)"
            )

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        """The average over ranks of a summable payload's decodes: their sum decoded, then divided by the
        group size (as torch's hook averages its uncompressed buffer and Q)."""
        return self._summed(payload, cctx, group).map(lambda total: total.div_(group.size))

    def _summed(self, payload: Payload, cctx: CompressContext, group: Group) -> Handle[Tensor]:
        h = iallreduce(payload.data[0], "sum", inplace=True, name=cctx.name, group=group)
        return h.map(lambda total: self.decode(Payload((total,), payload.numel, payload.dtype), cctx))

    def _allreduce(
        self, x: Tensor, what: str, unit: Unit, ctx: ReduceContext, *, average: bool
    ) -> Handle[Tensor]:
        cctx = CompressContext(f"{unit.key}/{what}", ctx.step, ctx.group.rank, self.seed)
        payload = self.compressor.compress(x, cctx)
        return (
            self.exchange(payload, cctx, unit, ctx.group)
            if average
            else self._summed(payload, cctx, ctx.group)
        )

    def _advance(self, step: int) -> None:
        if self.last_step is not None and step != self.last_step:
            self.iteration += 1
        self.last_step = step

    # -- reduce -------------------------------------------------------------------------------------
    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        self._advance(ctx.step)
        n = ctx.group.size
        t0 = time.perf_counter()
        with torch.no_grad():
            flat = flatten(grads)
            if self.iteration < self.start_iter:
                self.timings.units += 1
                return self._allreduce(flat.div_(n), "full", unit, ctx, average=False).map(
                    lambda avg: unflatten_into(avg, grads)
                )
            segs = segments(unit, grads)
            x = self.memory.compensate(segs, flat)
            kept = None if isinstance(self.memory, NoMemory) else x.clone()
            plan = self._plan(unit, grads, x)
            unc = plan["uncompressed"]
            unc_buf = torch.cat([t.reshape(-1) for t in unc]) if unc else x.new_empty(0)
            p_buf, q_buf, ms, ps, qs = self._factors(unit, plan, x)
            for m, p, q in zip(ms, ps, qs):
                torch.bmm(m, q, out=p)
            self.timings.compress_s += time.perf_counter() - t0
            self.timings.units += 1
            h_unc = self._allreduce(unc_buf, "uncompressed", unit, ctx, average=True)
            h_p = self._allreduce(p_buf, "P", unit, ctx, average=False)  # orthogonalized: no division
            averaged = h_unc.wait()
            pos = 0
            for t in unc:
                t.copy_(averaged[pos : pos + t.numel()].view_as(t))
                pos += t.numel()
            p_buf.copy_(h_p.wait())
            t0 = time.perf_counter()
            for m, p, q in zip(ms, ps, qs):
                orthogonalize(p, self.epsilon)
                torch.bmm(m.transpose(1, 2), p, out=q)
            self.timings.compress_s += time.perf_counter() - t0
        h_q = self._allreduce(q_buf, "Q", unit, ctx, average=True)

        def finish(q_avg: Tensor) -> list[Tensor]:
            t1 = time.perf_counter()
            with torch.no_grad():
                q_buf.copy_(q_avg)
                for m, p, q in zip(ms, ps, qs):
                    torch.bmm(p, q.transpose(1, 2), out=m)
                for m, originals in zip(ms, plan["batches"]):
                    if m.shape[0] > 1:
                        for k, t in enumerate(originals):
                            t.copy_(m[k])
                if self.warm_start:
                    for names, q in zip(plan["batch_names"], qs):
                        for k, name in enumerate(names):
                            self.q[name] = q[k].clone()
                if kept is not None:
                    self.memory.update(segs, kept, x)
            self.timings.decompress_s += time.perf_counter() - t1
            return unflatten_into(x, grads)

        return h_q.map(finish)

    def _plan(self, unit: Unit, grads: list[Tensor], x: Tensor) -> dict[str, Any]:
        """Split the unit's compensated gradients (views of ``x``) into uncompressed tensors and
        batches of same-shaped matrices to compress, in torch's order."""
        uncompressed: list[Tensor] = []
        by_shape: dict[tuple[int, int], list[tuple[str, Tensor]]] = {}
        pos = 0
        for name, g in zip(unit.names, grads):
            view = x[pos : pos + g.numel()]
            pos += g.numel()
            rows, cols = _matrix_shape(g)
            r = min(rows, cols, self.rank)
            if g.numel() and should_compress(rows, cols, r, self.min_compression_rate):
                by_shape.setdefault((rows, cols), []).append((name, view.view(rows, cols)))
            else:
                uncompressed.append(view)
        batches: list[list[Tensor]] = []
        batch_names: list[list[str]] = []
        for items in by_shape.values():
            groups = [items] if self.batch_same_shape else [[it] for it in items]
            for grp in groups:
                batch_names.append([nm for nm, _ in grp])
                batches.append([t for _, t in grp])
        return {"uncompressed": uncompressed, "batches": batches, "batch_names": batch_names}

    def _factors(
        self, unit: Unit, plan: dict[str, Any], x: Tensor
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """The P and Q buffers (torch's layout) with the batched matrices and their P, Q views; Q filled
        from the warm-start memory (re-orthogonalized) or freshly drawn."""
        ms: list[Tensor] = []
        shapes: list[tuple[int, int, int, int]] = []
        for batch in plan["batches"]:
            m = batch[0].unsqueeze(0) if len(batch) == 1 else torch.stack(batch)
            b, rows, cols = m.shape
            ms.append(m)
            shapes.append((b, rows, cols, min(rows, cols, self.rank)))
        p_buf = x.new_empty(sum(b * rows * r for b, rows, _, r in shapes))
        q_buf = x.new_empty(sum(b * cols * r for b, _, cols, r in shapes))
        ps, qs = [], []
        pp = qp = 0
        for b, rows, cols, r in shapes:
            ps.append(p_buf[pp : pp + b * rows * r].view(b, rows, r))
            qs.append(q_buf[qp : qp + b * cols * r].view(b, cols, r))
            pp += b * rows * r
            qp += b * cols * r
        names = [nm for grp in plan["batch_names"] for nm in grp]
        fresh = not self.warm_start or unit.names not in self.seen or any(nm not in self.q for nm in names)
        self.seen.add(unit.names)
        if fresh:
            # drawn on the CPU and copied to the device, as torch's hook does: the same Q on any device
            g = torch.Generator(device="cpu").manual_seed(int(self.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=g, dtype=x.dtype, device="cpu"))
                orthogonalize(q, self.epsilon)
        else:
            for grp, q in zip(plan["batch_names"], qs):
                for k, nm in enumerate(grp):
                    if self.q[nm].shape != q.shape[1:]:
                        raise InvalidArgumentError(
                            f"{type(self).__name__}: parameter {nm!r}'s Q is {tuple(self.q[nm].shape)}, "
                            f"expected {tuple(q.shape[1:])}"
                        )
                    q[k].copy_(self.q[nm])
                orthogonalize(q, self.epsilon)
        return p_buf, q_buf, ms, ps, qs

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        st: Any = self.rng.get_state()
        keys, pos, has_gauss, gauss = np.asarray(st[1]), st[2], st[3], st[4]
        return {
            **super().state_dict(),
            "powersgd": {
                "iteration": self.iteration,
                "last_step": self.last_step,
                "q": {k: v.clone() for k, v in self.q.items()},
                "seen": sorted(list(u) for u in self.seen),
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)},
            },
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = state.get("powersgd") if isinstance(state, Mapping) else None
        if not isinstance(own, Mapping) or not {"iteration", "q", "seen", "rng"} <= set(own):
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: expects a 'powersgd' entry with iteration, q, seen, rng"
            )
        super().load_state_dict(state)
        rng = own["rng"]
        keys = np.asarray(rng["keys"].numpy(), dtype=np.uint32)
        self.rng.set_state(("MT19937", keys, int(rng["pos"]), int(rng["has_gauss"]), float(rng["gauss"])))
        self.iteration = int(own["iteration"])
        self.last_step = None if own.get("last_step") is None else int(own["last_step"])
        self.q = {str(k): v.clone() for k, v in own["q"].items()}
        self.seen = {tuple(u) for u in own["seen"]}

    @classmethod
    def reshard_states(cls, states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Every rank's state for ``world_size`` ranks: the error memories re-sharded
        (:func:`~lowband.compress.memory.reshard_memories`: per parameter, their sum over ranks kept);
        the Q factors, random state and counters, the same on every rank, copied (refused if they
        differ, as a compressor state that differs)."""
        where = f"{cls.__name__}.reshard_states"
        if not states or not all(
            isinstance(s, Mapping) and "powersgd" in s and "memory" in s for s in states
        ):
            raise InvalidArgumentError(f"{where}: expects every rank's state with 'memory' and 'powersgd'")
        for key in ("powersgd", "compressor"):
            for r, st in enumerate(states[1:], 1):
                if not _same(st.get(key, {}), states[0].get(key, {})):
                    raise InvalidArgumentError(
                        f"{where}: the {key!r} state differs between rank 0 and rank {r}"
                    )
        memories = reshard_memories([s["memory"] for s in states], world_size)
        keep = {k: v for k, v in states[0].items() if k != "memory"}
        return [{"memory": m, **copy.deepcopy(keep)} for m in memories]

    def __repr__(self) -> str:
        return (
            f"PowerSGDReducer(rank={self.rank}, start_iter={self.start_iter}, "
            f"min_compression_rate={self.min_compression_rate:g}, warm_start={self.warm_start}, "
            f"{self.compressor!r}, {self.memory!r})"
        )
