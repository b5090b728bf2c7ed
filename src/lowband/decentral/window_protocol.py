"""The request codec of the window service: what goes on the wire, and what a request may ask.

A request is a header, ``int64[6] = [kind, window id, flags, reply tag, numel, dtype code]`` on tag
:data:`TAG_HEADER`, followed for PUT and ACCUMULATE by the payload (``numel`` elements of the dtype) on
tag :data:`TAG_PAYLOAD`. The requester posts, before sending, the receive of the answer on the reply tag
it chose: a status word (:data:`OK` or the reason of a refusal) and, for an accepted GET, the data on
the next tag. Window ids are given in creation order (creation is collective, so they agree across ranks).

A request is checked against the destination's window (:func:`vet`) *before* its payload is received,
so a peer declaring a size that does not fit costs no allocation: the destination answers the refusal
and, when the refused payload is larger than the window (it cannot be received and discarded within the
window's size), stops serving that peer (:mod:`lowband.decentral.window_service`). The requester waits
neither for a payload its destination refused nor for the data of a refused GET
(:attr:`lowband.comm.batch.P2POp.abandon_if`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lowband.comm.batch import P2POp, recv_op, send_op
from lowband.comm.validate import CODE_DTYPES, DTYPE_CODES
from lowband.errors import CommFailedError, InvalidArgumentError
from lowband.group import Group

if TYPE_CHECKING:  # window_service.py imports this module
    from lowband.decentral.window_service import WindowRecord

PUT, ACCUMULATE, GET, LOCK, UNLOCK, STOP = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    PUT: "win_put",
    ACCUMULATE: "win_accumulate",
    GET: "win_get",
    LOCK: "win_mutex",
    UNLOCK: "win_mutex",
}
F_MUTEX = 1

OK, UNKNOWN, NOT_NEIGHBOR, MISMATCH, NOT_HOLDER = 0, 1, 2, 3, 4
STATUS_TEXT = {
    UNKNOWN: "has no such window (freed, or never created there)",
    NOT_NEIGHBOR: "is not a neighbor of the requesting rank in the window's static topology",
    MISMATCH: "has a window of another dtype or size",
    NOT_HOLDER: "is not held by the requesting rank",
}
#: the status word before an answer arrived
NO_ANSWER = -1

HEADER = 6
TAG_HEADER, TAG_PAYLOAD, TAG_REPLY = 0, 1, 2
TAG_SPAN = 1 << 29
#: receivers wait for their peer's next request without a timeout (see window_service's docstring)
IDLE_SECONDS = datetime.timedelta(days=3650).total_seconds()


@dataclass(frozen=True)
class Request:
    """A decoded request header."""

    kind: int
    wid: int
    flags: int
    tag: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def mutexed(self) -> bool:
        return bool(self.flags & F_MUTEX)


def encode(kind: int, wid: int, tag: int, *, mutexed: bool, numel: int, dtype: torch.dtype) -> torch.Tensor:
    flags = F_MUTEX if mutexed else 0
    return torch.tensor([kind, wid, flags, tag, numel, DTYPE_CODES[dtype]], dtype=torch.int64, device="cpu")


def stop_header() -> torch.Tensor:
    return torch.tensor([STOP, -1, 0, 0, 0, 0], dtype=torch.int64, device="cpu")


def decode(where: str, vals: Sequence[int]) -> Request:
    """The request in a received header; a malformed header raises :class:`CommFailedError`."""
    kind, wid, flags, tag, numel, code = vals
    dtype = CODE_DTYPES.get(code)
    if kind not in KIND_NAMES or dtype is None or numel < 0:
        raise CommFailedError(f"{where}: malformed request header {list(vals)}")
    return Request(kind, wid, flags, tag, numel, dtype)


def request_ops(
    dst: int,
    kind: int,
    wid: int,
    tag: int,
    *,
    mutexed: bool = False,
    payload: torch.Tensor | None = None,
    numel: int = 0,
    dtype: torch.dtype = torch.float32,
    reply: torch.Tensor | None = None,
) -> tuple[list[P2POp], torch.Tensor]:
    """The messages of one request to ``dst`` (the answer's receives first, then the header and the
    payload) and the status tensor (valid once they completed). ``reply`` receives GET's data."""
    status = torch.full((1,), NO_ANSWER, dtype=torch.int64, device="cpu")

    def refused() -> bool:
        return int(status.item()) not in (NO_ANSWER, OK)

    ops = [recv_op(status, dst, tag, control=True)]
    if reply is not None and reply.numel():
        ops.append(recv_op(reply, dst, tag + 1, abandon_if=refused))
    header = encode(kind, wid, tag, mutexed=mutexed, numel=numel, dtype=dtype)
    ops.append(send_op(header, dst, TAG_HEADER, control=True))
    if payload is not None and payload.numel():
        ops.append(send_op(payload, dst, TAG_PAYLOAD, abandon_if=refused))
    return ops, status


def vet(rec: WindowRecord | None, src: int, req: Request) -> int:
    """The status of ``req`` from ``src`` against this rank's window ``rec`` (None: no such window)."""
    if rec is None:
        return UNKNOWN
    data = rec.data
    if req.kind in (PUT, ACCUMULATE, GET) and (req.numel != data.numel() or req.dtype != data.dtype):
        return MISMATCH
    allowed = {PUT: rec.in_nbrs, ACCUMULATE: rec.in_nbrs, GET: rec.out_nbrs}.get(req.kind, rec.peers)
    return OK if src in allowed else NOT_NEIGHBOR


def check_statuses(at: str, what: str, peers: list[int], statuses: list[torch.Tensor], g: Group) -> None:
    """Raise :class:`CommFailedError` for the first peer that answered a request with an error status."""
    for p, s in zip(peers, statuses):
        code = int(s.item())
        if code != OK:
            text = STATUS_TEXT.get(code, f"answered status {code}")
            raise CommFailedError(f"{at}: rank {g.ranks[p]} rejected the {what}: its window {text}")


def check_flag(at: str, what: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{at}: {what} must be a bool, got {v!r}")
    return v


def check_neighbors(at: str, what: str, ranks: list[int], allowed: tuple[int, ...], kind: str) -> None:
    """Every rank of ``ranks`` is in ``allowed`` (the window topology's ``kind`` s of this rank)."""
    bad = [r for r in ranks if r not in allowed]
    if bad:
        raise InvalidArgumentError(
            f"{at}: {what} lists rank {bad[0]}, which is not an {kind} of this rank in the window's "
            f"static topology ({kind}s: {list(allowed)})"
        )
