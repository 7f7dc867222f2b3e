"""Training state as a few flat buffers, and its peer-to-peer handoff.

* ``snapshot(objs, extra) -> FlatState``: every tensor of every ``state_dict()`` (nested
  dicts/lists/tuples) copied into one contiguous 1-D buffer per (dtype, device), plus a
  picklable skeleton (the structure, non-tensor leaves, per-tensor dtype/shape/offset).
* ``FlatState.restore(objs)``: rebuilds each state dict and calls ``load_state_dict``
  (module parameters are copied in place, so optimizers keep referencing them; an optimizer
  that never stepped accepts a peer's full state).
* ``send_state`` / ``recv_state``: a transfer plan ``{recipient rank: [source ranks]}``. The
  first source sends the skeleton and per-chunk checksums; buffer bytes are cut into
  ``len(sources)`` contiguous chunks, chunk ``i`` sent by ``sources[i]``, so big state is
  striped over all sources. Point-to-point over an ``AbortableGroup`` (abort-aware waits).
  The recipient verifies every chunk: a mismatch raises ``StateMismatch``, never silently.
* ``checksum(buffers)`` (exact, ~30 GB/s on CPU) and ``digest(model)`` (a strided sample of
  the parameters, for heartbeats).

Wire format per (source -> recipient), all on tag ``TAG_BASE + n``:
  +0  int64[4] control: MAGIC, layout hash, skeleton bytes (first source, else 0), state bytes
  +1  uint8[skeleton bytes] pickle of (skeleton, chunk checksums)   (first source only)
  +16+b  uint8 chunk ``i`` of buffer ``b``                          (every source, if not empty)
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .collectives import on_wire

MAGIC = 0x6365_6173_6531  # "ceas" "e1"
TAG_BASE = 0x3EA0_0000
_TAG_CTRL, _TAG_SKEL, _TAG_BUF = 0, 1, 16
_ALIGN = 64          # chunk boundaries (bytes): int64 views of chunks stay aligned
_BLOCK = 1024        # int64 words per checksum block
_M64 = (1 << 64) - 1


class StateMismatch(Exception):
    """Received state does not match what the sources sent (checksum/layout): never use it."""

    def __init__(self, msg: str, bad: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(msg)
        self.bad = list(bad)  # (buffer index, source rank)


class TensorMeta(NamedTuple):
    buffer: int
    offset: int          # in elements of the buffer's dtype
    numel: int
    shape: tuple[int, ...]


class BufferSpec(NamedTuple):
    dtype: torch.dtype
    device: str
    numel: int


class _TRef(NamedTuple):
    """Placeholder for a tensor in a skeleton."""

    index: int


class _DRef(NamedTuple):
    """Placeholder for a ``DTensor`` (a sharded parameter or optimizer state of FSDP2): its
    local shard is tensor ``index``; placements, global shape and stride say how to rebuild
    it on the mesh of the object it is restored into (``FlatState.restore``)."""

    index: int
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors: nothing is one
        return ()
    return DTensor


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a ``DTensor``'s local shard (FSDP2), any other tensor as is."""
    DTensor = _dtensor_type()
    return t.to_local() if DTensor and isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------- flat state
@dataclass
class FlatState:
    """State dicts split into a picklable ``skeleton`` and a few 1-D ``buffers``."""

    skeleton: dict[str, Any]
    buffers: list[Tensor]
    stats: dict[str, Any] = field(default_factory=dict)  # transfer telemetry (recv_state)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def names(self) -> list[str]:
        return list(self.skeleton["objs"])

    @property
    def extra(self) -> dict[str, Any]:
        """The ``extra`` dict given to ``snapshot`` (tensors in it are fresh copies)."""
        return self._fill(self.skeleton["extra"], clone=True)

    def layout_hash(self) -> int:
        return _layout_hash(self.skeleton["specs"])

    def tensor(self, i: int) -> Tensor:
        """Tensor ``i`` of the skeleton, as a view into its buffer."""
        m: TensorMeta = self.skeleton["metas"][i]
        return self.buffers[m.buffer][m.offset:m.offset + m.numel].view(m.shape)

    def state_dict_of(self, name: str, clone: bool = True) -> Any:
        """The rebuilt state dict of ``name`` (``clone=False``: views into the buffers)."""
        return self._fill(self.skeleton["objs"][name], clone)

    def restore(self, objs: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
        """``load_state_dict`` on every object; returns ``extra``. Modules get views into the
        buffers (their load copies in place, parameters keep their identity); everything
        else gets fresh tensors, so optimizer state never aliases these buffers.
        ``strict``: the names of ``objs`` and of the state must be the same."""
        have = self.skeleton["objs"]
        if strict and set(have) != set(objs):
            raise KeyError(f"state holds {sorted(have)}, objects are {sorted(objs)}")
        self._mesh = _mesh_of(objs)  # sharded (FSDP2) state is rebuilt on the objects' mesh
        for name, obj in objs.items():
            if name not in have:
                continue
            is_module = isinstance(obj, torch.nn.Module)
            obj.load_state_dict(self._fill(have[name], clone=not is_module))
        return self.extra

    def _fill(self, node: Any, clone: bool) -> Any:
        if isinstance(node, _TRef):
            t = self.tensor(node.index)
            return t.clone() if clone else t
        if isinstance(node, _DRef):
            mesh = getattr(self, "_mesh", None)
            if mesh is None:
                raise TypeError("sharded (DTensor) state restored into objects with no "
                                "sharded parameter to take the mesh from")
            DTensor = _dtensor_type()
            t = self.tensor(node.index)
            return DTensor.from_local(t.clone() if clone else t, mesh, node.placements,
                                      run_check=False, shape=torch.Size(node.shape),
                                      stride=node.stride)
        if isinstance(node, dict):
            new = copy.copy(node)
            for k, v in node.items():
                new[k] = self._fill(v, clone)
            return new
        if isinstance(node, list):
            return [self._fill(v, clone) for v in node]
        if isinstance(node, tuple):
            items = [self._fill(v, clone) for v in node]
            return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        return node


def snapshot(objs: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
             to_host: bool = False) -> FlatState:
    """Copy the state of ``objs`` (name -> object with ``state_dict()``) and ``extra`` into a
    FlatState: one contiguous buffer per (dtype, device). Tensors that share memory (tied
    weights) are stored once. Non-tensor leaves must be picklable. ``to_host``: buffers of
    CUDA tensors are built in pinned host memory, tensor by tensor (no second copy of the
    state on the GPU); the specs keep the device, so a restore puts them back there."""
    refs: list[Tensor] = []
    seen: dict[tuple, int] = {}

    DTensor = _dtensor_type()

    def strip(node: Any) -> Any:
        if DTensor and isinstance(node, DTensor):  # FSDP2: this rank's shard only
            ref = strip(node.to_local())
            return _DRef(ref.index, tuple(node.placements), tuple(node.shape),
                         tuple(node.stride()))
        if isinstance(node, Tensor):
            if node.layout != torch.strided or node.is_quantized or node.device.type == "meta":
                raise TypeError(f"cannot snapshot a {node.layout} / quantized / meta tensor")
            key = (node.device, node.dtype, node.untyped_storage().data_ptr(),
                   node.storage_offset(), tuple(node.shape), tuple(node.stride()))
            i = seen.get(key)
            if i is None:
                i = seen[key] = len(refs)
                refs.append(node.detach())
            return _TRef(i)
        if isinstance(node, dict):
            new = copy.copy(node)  # keeps the dict type and attributes (``_metadata``)
            for k, v in node.items():
                new[k] = strip(v)
            return new
        if isinstance(node, list):
            return [strip(v) for v in node]
        if isinstance(node, tuple):
            items = [strip(v) for v in node]
            return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        return node

    structures = {name: strip(obj.state_dict()) for name, obj in objs.items()}
    extra_s = strip(dict(extra or {}))
    groups: dict[tuple[torch.dtype, str], list[int]] = {}
    for i, t in enumerate(refs):
        groups.setdefault((t.dtype, str(t.device)), []).append(i)
    metas: list[TensorMeta | None] = [None] * len(refs)
    buffers: list[Tensor] = []
    specs: list[BufferSpec] = []
    for b, ((dtype, dev), idx) in enumerate(groups.items()):
        off = 0
        for i in idx:
            n = refs[i].numel()
            metas[i] = TensorMeta(b, off, n, tuple(refs[i].shape))
            off += n
        if to_host and torch.device(dev).type == "cuda":
            buf = torch.empty(off, dtype=dtype, pin_memory=True)
            for i in idx:
                m = metas[i]
                buf[m.offset:m.offset + m.numel].copy_(refs[i].reshape(-1))
        elif off:
            buf = torch.cat([refs[i].reshape(-1) for i in idx])
        else:
            buf = torch.empty(0, dtype=dtype, device=dev)
        buffers.append(buf)
        specs.append(BufferSpec(dtype, dev, off))
    skeleton = {"version": 1, "objs": structures, "extra": extra_s, "metas": metas,
                "specs": specs}
    return FlatState(skeleton=skeleton, buffers=buffers)


def _mesh_of(objs: Mapping[str, Any]) -> Any:
    """The device mesh of the first sharded (DTensor) parameter of the modules in ``objs``
    (None: nothing is sharded). One mesh per job: the replica's shard group."""
    DTensor = _dtensor_type()
    if not DTensor:
        return None
    for obj in objs.values():
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if isinstance(p, DTensor):
                    return p.device_mesh
    return None


# ---------------------------------------------------------------------------- checksums
def _u8(buf: Tensor) -> Tensor:
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("checksums and transfers need contiguous 1-D buffers")
    return buf.view(torch.uint8)


def _checksum_u8(u8: Tensor) -> int:
    """Exact checksum of a byte range whose start is 8-byte aligned: wrapping int64 sums of
    1024-word blocks, combined plainly and weighted by block position, plus the length. Any
    change of one 64-bit word changes it; so do swapped or misplaced blocks."""
    n = u8.numel()
    n8 = n - n % 8
    s1 = s2 = 0
    if n8:
        w = u8[:n8].view(torch.int64)
        nb = w.numel() // _BLOCK
        rest = int(w[nb * _BLOCK:].sum().item()) if w.numel() % _BLOCK else 0
        if nb:
            body = w[:nb * _BLOCK].view(nb, _BLOCK).sum(1)
            s1 = int(body.sum().item())
            weights = torch.arange(1, nb + 1, dtype=torch.int64, device=body.device)
            s2 = int((body * weights).sum().item())
        s1 += rest
        s2 += rest * (nb + 1)
    if n8 != n:
        tail = int.from_bytes(bytes(u8[n8:].cpu().tolist()), "little")
        s1 += tail
        s2 += tail * 0x9E3779B97F4A7C15
    return (s1 & _M64) | ((s2 & _M64) << 64) | (n << 128)


def checksum(buffers: Sequence[Tensor]) -> list[int]:
    """One exact checksum per contiguous 1-D buffer (any dtype, any device)."""
    return [_checksum_u8(_u8(b)) for b in buffers]


def chunk_bounds(nbytes: int, k: int) -> list[int]:
    """``k + 1`` byte offsets cutting ``nbytes`` into ``k`` contiguous, 64-byte aligned
    chunks (some may be empty)."""
    if k < 1:
        raise ValueError("need at least one source")
    out = [0]
    for i in range(1, k):
        out.append(min(nbytes, -(-(nbytes * i // k) // _ALIGN) * _ALIGN))
    out.append(nbytes)
    return out


def _chunk_checksums(buffers: Sequence[Tensor], k: int) -> list[list[int]]:
    out = []
    for b in buffers:
        u8 = _u8(b)
        bd = chunk_bounds(u8.numel(), k)
        out.append([_checksum_u8(u8[bd[i]:bd[i + 1]]) for i in range(k)])
    return out


def _layout_hash(specs: Sequence[BufferSpec]) -> int:
    h = hashlib.blake2b(repr([(str(s.dtype), s.numel) for s in specs]).encode(),
                        digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


def digest(model: torch.nn.Module | Sequence[Tensor], samples: int = 4096) -> str:
    """Cheap hex digest of a strided sample (about ``samples`` elements in all) of the
    parameters of ``model`` (or of a list of tensors). Equal states give equal digests; it is
    a heartbeat hint, not a proof (use ``checksum`` for that)."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    params = [local(p) for p in params]
    total = sum(p.numel() for p in params)
    if not total:
        return hashlib.blake2b(b"", digest_size=8).hexdigest()
    h = hashlib.blake2b(digest_size=8)
    pieces: dict[torch.dtype, list[Tensor]] = {}
    with torch.no_grad():
        for p in params:
            n = p.numel()
            if not n:
                continue
            k = max(1, min(n, samples * n // total))
            flat = p.detach().reshape(-1)
            pieces.setdefault(p.dtype, []).append(flat[:: max(1, n // k)][:k])
        for dtype, ps in pieces.items():  # cat makes a fresh contiguous tensor
            h.update(str(dtype).encode())
            h.update(torch.cat(ps).view(torch.uint8).cpu().numpy().tobytes())
    h.update(total.to_bytes(8, "little"))
    return h.hexdigest()


# ---------------------------------------------------------------------------- transfer
def send_state(group: Any, state: FlatState, my_rank: int,
               recipients: Mapping[int, Sequence[int]], abort: threading.Event | None,
               timeout_s: float | None = None) -> int:
    """Send ``state`` to every recipient that lists ``my_rank`` among its sources (plan:
    ``{recipient: [sources]}``). All sends are posted, then waited (abort-aware). Returns the
    bytes this rank sent. Raises Aborted / PeerError like the group's waits."""
    dev = group.device
    lh = state.layout_hash()
    wire = [on_wire(b, dev) for b in state.buffers]
    u8s = [_u8(b) for b in wire]
    keep: list[Tensor] = []   # tensors must outlive their sends
    works = []
    sent = 0
    csums: dict[int, list[list[int]]] = {}
    for r, sources in sorted(recipients.items()):
        sources = [int(s) for s in sources]
        if my_rank not in sources:
            continue
        i, k = sources.index(my_rank), len(sources)
        blob = None
        if i == 0:
            if k not in csums:
                csums[k] = _chunk_checksums(wire, k)
            payload = pickle.dumps((state.skeleton, csums[k]), protocol=pickle.HIGHEST_PROTOCOL)
            blob = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        ctrl = torch.tensor([MAGIC, lh, 0 if blob is None else blob.numel(), state.nbytes],
                            dtype=torch.int64, device=dev)
        keep.append(ctrl)
        works.append(group.isend(ctrl, r, TAG_BASE + _TAG_CTRL))
        if blob is not None:
            keep.append(blob)
            works.append(group.isend(blob, r, TAG_BASE + _TAG_SKEL))
            sent += blob.numel()
        for b, u8 in enumerate(u8s):
            bd = chunk_bounds(u8.numel(), k)
            if bd[i + 1] > bd[i]:
                works.append(group.isend(u8[bd[i]:bd[i + 1]], r, TAG_BASE + _TAG_BUF + b))
                sent += bd[i + 1] - bd[i]
    group.wait_all(works, abort, "state send", timeout_s=timeout_s)
    del keep
    return sent


def recv_state(group: Any, my_rank: int, sources: Sequence[int],
               abort: threading.Event | None, timeout_s: float | None = None,
               tamper: Callable[[list[Tensor]], None] | None = None) -> FlatState:
    """Receive a FlatState striped over ``sources`` (the first one also sends the skeleton)
    and verify every chunk. ``.stats`` holds bytes, seconds and bytes per source.
    ``tamper`` (tests only) may modify the received buffers before verification.
    Raises StateMismatch (layout or checksum), Aborted / PeerError (transport)."""
    t0 = time.perf_counter()
    sources = [int(s) for s in sources]
    if not sources or my_rank in sources:
        raise ValueError(f"bad sources {sources} for recipient {my_rank}")
    dev = group.device
    ctrls = [torch.zeros(4, dtype=torch.int64, device=dev) for _ in sources]
    group.wait_all([group.irecv(c, s, TAG_BASE + _TAG_CTRL) for c, s in zip(ctrls, sources)],
                   abort, "state header", timeout_s=timeout_s)
    heads = [c.cpu().tolist() for c in ctrls]
    for s, h in zip(sources, heads):
        if h[0] != MAGIC:
            raise StateMismatch(f"source {s} sent a bad header {h}")
    if len({h[1] for h in heads}) != 1 or len({h[3] for h in heads}) != 1:
        raise StateMismatch("sources hold different state layouts: " + ", ".join(
            f"rank {s}: hash {h[1]:x}, {h[3]} bytes" for s, h in zip(sources, heads)))
    blob = torch.empty(heads[0][2], dtype=torch.uint8, device=dev)
    group.wait_all([group.irecv(blob, sources[0], TAG_BASE + _TAG_SKEL)], abort,
                   "state skeleton", timeout_s=timeout_s)
    skeleton, csums = pickle.loads(blob.cpu().numpy().tobytes())
    specs: list[BufferSpec] = skeleton["specs"]
    if _layout_hash(specs) != heads[0][1]:
        raise StateMismatch("skeleton does not match the announced layout")
    k = len(sources)
    wire = [torch.empty(sp.numel, dtype=sp.dtype, device=dev) for sp in specs]
    per_source = {s: 0 for s in sources}
    per_source[sources[0]] += blob.numel()
    works = []
    for b, buf in enumerate(wire):
        u8 = _u8(buf)
        bd = chunk_bounds(u8.numel(), k)
        for i, s in enumerate(sources):
            if bd[i + 1] > bd[i]:
                works.append(group.irecv(u8[bd[i]:bd[i + 1]], s, TAG_BASE + _TAG_BUF + b))
                per_source[s] += bd[i + 1] - bd[i]
    group.wait_all(works, abort, "state chunks", timeout_s=timeout_s)
    t_recv = time.perf_counter()
    if tamper is not None:
        tamper(wire)
    got = _chunk_checksums(wire, k)
    bad = [(b, sources[i]) for b in range(len(wire)) for i in range(k)
           if got[b][i] != csums[b][i]]
    if bad:
        raise StateMismatch(f"checksum mismatch in {len(bad)} chunk(s) "
                            f"(buffer, source rank): {bad}", bad)
    buffers = [w if w.device.type == torch.device(sp.device).type else w.to(sp.device)
               for w, sp in zip(wire, specs)]
    t1 = time.perf_counter()
    st = FlatState(skeleton=skeleton, buffers=buffers)
    st.stats = {"bytes": sum(per_source.values()), "state_bytes": st.nbytes,
                "seconds": t1 - t0, "transfer_seconds": t_recv - t0,
                "verify_seconds": t1 - t_recv, "per_source": per_source}
    return st
