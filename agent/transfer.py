"""The peer-to-peer state transfer: from the sources' live tensors into the recipient's own.

``send_state(group, state, my_rank, plan)`` / ``recv_state(group, my_rank, sources, into)``
with a transfer plan ``{recipient rank: [source ranks]}``. Nothing is staged whole on either
side (issue 34: at 1B parameters a second copy of the state does not fit): a source sends
from the tensors it trains (``state.describe``: the state is at the restore step and nothing
changes it during a handoff), a recipient receives into its own parameters and optimizer
state where they fit (``state.destinations``) and allocates only what it lacks (an
optimizer that never stepped).

The tensors' bytes, laid end to end (each 64-byte aligned), are cut into ``len(sources)``
contiguous stripes, stripe ``i`` sent by ``sources[i]``, and each tensor's part of a stripe
into pieces of at most ``PIECE_BYTES``; both ends compute the same pieces (``plan_pieces``).
The first source sends the skeleton; each source checksums its pieces while they are on the
wire and sends the checksums after them; the recipient checksums each piece as its window
completes and compares at the end: a mismatch raises ``StateMismatch``, never silently. At
most two windows per peer are in flight (``WINDOW_BYTES`` shared by the peers). A recipient
receives each piece into its source's staging (two slots per source, one per window in
flight, allocated once per transfer and reused) and copies it into place once its window
completed: an abandoned receive may still complete later (gloo's works are parked, not
cancelled) and must land there, never in tensors a later transfer filled and verified. That
staging, like the one a device mismatch needs (CUDA tensors over gloo), stays bounded by the
windows.

A recipient that received into its own tensors and then failed holds garbage: the caller
must treat its state as lost (``TrainState.forget`` before receiving).

Each source's header carries ``digests.exact`` of the tensors it sends (computed on their
device, one number read back): the recipient refuses sources that disagree before anything
else moves, since each stripe is checked against its own sender only and sources holding
different states (optimizer state, a second module) would hand it a mix.

Wire format per (source -> recipient), version 4 (``MAGIC``), in the order sent and received
(NCCL matches a peer's sends and receives in order and ignores tags; gloo uses them):
  tag +0   int64[5] control: MAGIC, layout hash, skeleton bytes (first source, else 0), state
           bytes, exact digest of the state
  tag +1   uint8[skeleton bytes] pickle of the skeleton                 (first source only)
  tag +16+n  uint8 piece ``n`` of ``plan_pieces`` (the source it names)
  tag +2   int64[pieces of this source, 2] their checksums, in piece order (after them)
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from .collectives import on_wire
from .digests import exact
from .state import (_ALIGN, FlatState, StateMismatch, TensorSpec, TensorState,
                    _checksum_u8, _layout_hash, chunk_bounds)

MAGIC = 0x6365_6173_6534  # "ceas" "e4": per-tensor pieces, the state's digest (digests.exact, v2)
TAG_BASE = 0x3EA0_0000
_TAG_CTRL, _TAG_SKEL, _TAG_SUMS, _TAG_PIECE = 0, 1, 2, 16
_M64 = (1 << 64) - 1
PIECE_BYTES = 32 * 2**20    # a piece: one message, one checksum
WINDOW_BYTES = 64 * 2**20  # a window, shared by the peers; two in flight per peer


class Piece(NamedTuple):
    tensor: int
    start: int   # bytes into the tensor
    end: int
    source: int  # index into the plan's sources


def plan_pieces(nbytes: Sequence[int], k: int, piece_bytes: int | None = None) -> list[Piece]:
    """The pieces ``k`` sources send tensors of ``nbytes`` bytes in (see module docstring;
    pieces of at most ``piece_bytes``, default ``PIECE_BYTES``); every piece starts 64-byte
    aligned within its tensor."""
    piece_bytes = piece_bytes or PIECE_BYTES
    if piece_bytes % _ALIGN:
        raise ValueError(f"piece_bytes must be a multiple of {_ALIGN}")
    starts, total = [], 0
    for n in nbytes:
        starts.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    bounds = chunk_bounds(total, k)
    out = []
    for i, (a0, n) in enumerate(zip(starts, nbytes)):
        for s in range(k):
            lo, hi = max(a0, bounds[s]), min(a0 + n, bounds[s + 1])
            while lo < hi:
                e = min(hi, lo + piece_bytes)
                out.append(Piece(i, lo - a0, e - a0, s))
                lo = e
    return out


def _windows(items: list[Any], lanes: int = 1) -> list[list[Any]]:
    """``items`` (piece index, piece) cut into runs of at most ``WINDOW_BYTES / lanes`` (one
    piece at least), so what is in flight (and staged) stays bounded however many peers.
    The two ends need not cut alike: both post a pair's pieces in the same order and wait
    only for pieces they posted, so the earliest unfinished piece is always posted on both."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    size, limit = 0, WINDOW_BYTES // max(1, lanes)
    for it in items:
        n = it[-1].end - it[-1].start
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    if cur:
        out.append(cur)
    return out


def _staging_slots(lanes: Sequence[list[list[Any]]]) -> dict[Any, Any]:
    """Where each piece of ``lanes`` (``_windows`` of (piece index, piece)) is received:
    ``{piece index: (lane, slot, byte offset)}``, window ``w`` of a lane in slot ``w % 2``
    (``_pipeline`` posts window ``w + 2`` only once window ``w`` is done), and
    ``{("size", lane): bytes of that lane's largest window}``."""
    out: dict[Any, Any] = {}
    for j, wins in enumerate(lanes):
        size = 0
        for w, win in enumerate(wins):
            off = 0
            for n, p in win:
                out[n] = (j, w % 2, off)
                off += -(-(p.end - p.start) // _ALIGN) * _ALIGN
            size = max(size, off)
        out["size", j] = size
    return out


def _bytes_of(t: Tensor) -> Tensor:
    """``t``'s bytes as a 1-D uint8 view (a copy only if ``t`` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _aligned(u8: Tensor) -> Tensor:
    """``u8`` itself when its start is 8-byte aligned (checksums read int64 words), else a
    copy of it."""
    return u8 if u8.data_ptr() % 8 == 0 else u8.clone()


def _piece_sum(tensors: Sequence[Tensor], p: Piece) -> tuple[int, int]:
    """The exact checksum of a piece (``state._checksum_u8``) as two int64 words (its length
    is the piece's)."""
    c = _checksum_u8(_aligned(_bytes_of(tensors[p.tensor])[p.start:p.end]))
    return _signed(c & _M64), _signed((c >> 64) & _M64)


def _signed(w: int) -> int:
    return w - (1 << 64) if w >= 1 << 63 else w


def _pipeline(group: Any, lanes: Sequence[list[list[Any]]],
              post: Callable[[Any], tuple[Any, Tensor]], done: Callable[[Any, Tensor], None],
              abort: threading.Event | None, what: str, timeout_s: float | None) -> None:
    """Run ``lanes`` (one per peer, each a list of windows) with two windows per lane in
    flight: ``post(item) -> (work, tensor on the wire)`` for each item of a window (the
    tensor is kept alive until its work is waited), then ``done(item, tensor)``."""
    pending: list[list[tuple[list[Any], list[Any], list[Tensor]]]] = [[] for _ in lanes]
    nxt = [0] * len(lanes)

    def post_next(j: int) -> None:
        if nxt[j] < len(lanes[j]):
            win = lanes[j][nxt[j]]
            nxt[j] += 1
            posted = [post(it) for it in win]
            pending[j].append((win, [w for w, _ in posted], [t for _, t in posted]))

    for j in range(len(lanes)):
        post_next(j)
        post_next(j)
    while any(pending):
        for j in range(len(lanes)):
            if pending[j]:
                win, works, wires = pending[j].pop(0)
                group.wait_all(works, abort, what, timeout_s=timeout_s)
                for it, t in zip(win, wires):
                    done(it, t)
                post_next(j)


def _as_tensors(state: TensorState | FlatState) -> TensorState:
    return state.view() if isinstance(state, FlatState) else state


# ---------------------------------------------------------------------------- send
def send_state(group: Any, state: TensorState | FlatState, my_rank: int,
               recipients: dict[int, Sequence[int]], abort: threading.Event | None,
               timeout_s: float | None = None) -> int:
    """Send ``state`` (live tensors, or a snapshot) to every recipient that lists ``my_rank``
    among its sources (plan: ``{recipient: [sources]}``). Returns the bytes this rank sent.
    Raises Aborted / PeerError like the group's waits."""
    st = _as_tensors(state)
    dev = group.device
    lh, nbytes = st.layout_hash(), [s.nbytes for s in st.specs]
    agreed: int | None = None  # the state's exact digest, once, if any recipient needs it
    sums: dict[tuple[int, int], tuple[int, int]] = {}  # (sources, piece) -> checksum words
    heads: list[Any] = []
    keep: list[Tensor] = []  # tensors outlive their sends
    per_peer: list[list[Any]] = []  # each recipient's pieces from this source, in order
    trailers: list[tuple[int, int, list[int]]] = []  # (recipient, sources, my pieces)
    sent = 0
    for r, sources in sorted(recipients.items()):
        sources = [int(s) for s in sources]
        if my_rank not in sources:
            continue
        i, k = sources.index(my_rank), len(sources)
        pieces = plan_pieces(nbytes, k)
        blob = None
        if i == 0:
            payload = pickle.dumps(st.skeleton, protocol=pickle.HIGHEST_PROTOCOL)
            blob = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        if agreed is None:
            agreed = int(exact(st.tensors))
        ctrl = torch.tensor([MAGIC, lh, 0 if blob is None else blob.numel(), st.nbytes,
                             agreed], dtype=torch.int64, device=dev)
        heads.append(group.isend(ctrl, r, TAG_BASE + _TAG_CTRL))
        keep.append(ctrl)
        if blob is not None:
            heads.append(group.isend(blob, r, TAG_BASE + _TAG_SKEL))
            keep.append(blob)
            sent += blob.numel()
        mine = [(n, p) for n, p in enumerate(pieces) if p.source == i]
        sent += sum(p.end - p.start for _, p in mine)
        per_peer.append([(r, k, n, p) for n, p in mine])
        trailers.append((r, k, [n for n, _ in mine]))
    lanes = [_windows(items, len(per_peer)) for items in per_peer]

    def post(item: tuple[int, int, int, Piece]) -> tuple[Any, Tensor]:
        r, k, n, p = item
        u8 = on_wire(_bytes_of(st.tensors[p.tensor])[p.start:p.end], dev)
        work = group.isend(u8, r, TAG_BASE + _TAG_PIECE + n)
        if (k, n) not in sums:  # while the piece is on the wire
            sums[(k, n)] = _piece_sum(st.tensors, p)
        return work, u8

    _pipeline(group, lanes, post, lambda it, t: None, abort, "state send", timeout_s)
    for r, k, ns in trailers:  # this source's checksums, after its pieces
        if ns:
            t = torch.tensor([sums[(k, n)] for n in ns], dtype=torch.int64, device=dev)
            keep.append(t)
            heads.append(group.isend(t, r, TAG_BASE + _TAG_SUMS))
    group.wait_all(heads, abort, "state header send", timeout_s=timeout_s)
    del keep
    return sent


# ---------------------------------------------------------------------------- receive
def recv_state(group: Any, my_rank: int, sources: Sequence[int],
               abort: threading.Event | None, timeout_s: float | None = None,
               tamper: Callable[[list[Tensor]], None] | None = None,
               into: Callable[[dict[str, Any]], tuple[list[Tensor], frozenset[int]]] | None
               = None, on_write: Callable[[], None] | None = None) -> TensorState:
    """Receive a state striped over ``sources`` (the first one also sends the skeleton) and
    verify every piece. ``into(skeleton) -> (tensors, in_place)`` says where each tensor goes
    (``state.destinations``: the objects' own tensors); without it, new tensors. ``on_write()``
    is called once, just before the first byte lands in one of those own tensors: until then
    they hold what they held (a transfer that fails before leaves them usable). ``.stats``
    holds bytes, seconds and bytes per source. ``tamper`` (tests only) may modify the
    received tensors before verification. Raises StateMismatch (layout or checksum),
    Aborted / PeerError (transport)."""
    t0 = time.perf_counter()
    sources = [int(s) for s in sources]
    if not sources or my_rank in sources:
        raise ValueError(f"bad sources {sources} for recipient {my_rank}")
    dev = group.device
    ctrls = [torch.zeros(5, dtype=torch.int64, device=dev) for _ in sources]
    group.wait_all([group.irecv(c, s, TAG_BASE + _TAG_CTRL) for c, s in zip(ctrls, sources)],
                   abort, "state header", timeout_s=timeout_s)
    heads = [c.cpu().tolist() for c in ctrls]
    t_head = time.perf_counter()
    for s, h in zip(sources, heads):
        if h[0] != MAGIC:
            raise StateMismatch(f"source {s} sent a bad header {h} (another wire version?)")
    if len({h[1] for h in heads}) != 1 or len({h[3] for h in heads}) != 1:
        raise StateMismatch("sources hold different state layouts: " + ", ".join(
            f"rank {s}: hash {h[1]:x}, {h[3]} bytes" for s, h in zip(sources, heads)))
    if len({h[4] for h in heads}) != 1:
        raise StateMismatch("sources hold different states (same layout, other values): " +
                            ", ".join(f"rank {s}: digest {h[4] & _M64:016x}"
                                      for s, h in zip(sources, heads)))
    blob = torch.empty(heads[0][2], dtype=torch.uint8, device=dev)
    group.wait_all([group.irecv(blob, sources[0], TAG_BASE + _TAG_SKEL)], abort,
                   "state skeleton", timeout_s=timeout_s)
    skeleton = pickle.loads(blob.cpu().numpy().tobytes())
    specs: list[TensorSpec] = skeleton["tensors"]
    if _layout_hash([(s.dtype, s.shape) for s in specs]) != heads[0][1]:
        raise StateMismatch("skeleton does not match the announced layout")
    tensors, in_place = into(skeleton) if into is not None else (
        [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in specs], frozenset())
    k = len(sources)
    pieces = plan_pieces([s.nbytes for s in specs], k)
    per_source = {s: 0 for s in sources}
    per_source[sources[0]] += blob.numel()
    owned = [[n for n, p in enumerate(pieces) if p.source == i] for i in range(k)]
    mine: dict[int, tuple[int, int]] = {}
    verify, copy = [0.0], [0.0]

    def check(n: int, p: Piece) -> None:
        v0 = time.perf_counter()
        mine[n] = _piece_sum(tensors, p)
        verify[0] += time.perf_counter() - v0

    lanes = [_windows([(n, p) for n, p in enumerate(pieces) if p.source == i], k)
             for i in range(k)]
    slot_of = _staging_slots(lanes)
    staging: dict[tuple[int, int], Tensor] = {}
    pin = dev.type == "cpu" and any(t.device.type == "cuda" for t in tensors)

    def post(item: tuple[int, Piece]) -> tuple[Any, Tensor]:
        # Never straight into the destination: an abandoned receive (a newer plan, a peer
        # error) is parked, not cancelled, and gloo may still finish it later. It then lands
        # in this transfer's staging (kept alive by the parked work, never reused by another
        # transfer), never in the model's tensors a later transfer has filled and verified.
        # Two staging slots per source, allocated once and reused window after window (a
        # fresh buffer per piece faulted its pages in again: 32 MiB pieces are mmapped).
        n, p = item
        lane, slot, off = slot_of[n]
        buf = staging.get((lane, slot))
        if buf is None:
            buf = staging[(lane, slot)] = torch.empty(
                slot_of["size", lane], dtype=torch.uint8, device=dev, pin_memory=pin)
        wire = buf[off:off + p.end - p.start]
        return group.irecv(wire, sources[p.source], TAG_BASE + _TAG_PIECE + n), wire

    untouched = [True]  # no byte written into the objects' own tensors yet

    def done(item: tuple[int, Piece], wire: Tensor) -> None:
        n, p = item
        if untouched[0] and p.tensor in in_place:
            untouched[0] = False
            if on_write is not None:
                on_write()
        c0 = time.perf_counter()
        _bytes_of(tensors[p.tensor])[p.start:p.end].copy_(wire)
        copy[0] += time.perf_counter() - c0
        per_source[sources[p.source]] += p.end - p.start
        if tamper is None:
            check(n, p)

    _pipeline(group, lanes, post, done, abort, "state chunks", timeout_s)
    # Each source's checksums come after its pieces, and are received after them: NCCL
    # matches a peer's messages in the order they were posted, whatever their tags.
    theirs = [torch.zeros(len(ns), 2, dtype=torch.int64, device=dev) for ns in owned]
    group.wait_all([group.irecv(t, s, TAG_BASE + _TAG_SUMS)
                    for t, s in zip(theirs, sources) if t.numel()],
                   abort, "state checksums", timeout_s=timeout_s)
    t_recv = time.perf_counter()
    if tamper is not None:
        tamper(tensors)
        for n, p in enumerate(pieces):
            check(n, p)
    bad = [(pieces[n].tensor, sources[i]) for i, ns in enumerate(owned)
           for n, w in zip(ns, theirs[i].cpu().tolist()) if tuple(w) != mine[n]]
    if bad:
        raise StateMismatch(f"checksum mismatch in {len(bad)} piece(s) "
                            f"(tensor, source rank): {bad}", bad)
    t1 = time.perf_counter()
    st = TensorState(skeleton=skeleton, tensors=tensors, in_place=in_place)
    st.stats = {"bytes": sum(per_source.values()), "state_bytes": st.nbytes,
                "seconds": t1 - t0, "transfer_seconds": t_recv - t0,
                "verify_seconds": verify[0], "header_seconds": t_head - t0,
                "copy_seconds": copy[0], "per_source": per_source,
                "in_place_bytes": sum(specs[i].nbytes for i in in_place)}
    return st

