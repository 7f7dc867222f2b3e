"""Training state as a picklable skeleton plus tensors: live, flat-copied, or received.

* ``describe(objs, extra) -> TensorState``: every tensor of every ``state_dict()`` (nested
  dicts/lists/tuples) by reference, no copy, plus a picklable skeleton (the structure,
  non-tensor leaves, each tensor's dtype/shape/device). What a source sends from.
* ``snapshot(objs, extra) -> FlatState``: the same tensors copied into one contiguous 1-D
  buffer per (dtype, device): a frozen copy (checkpoints, a shadow spare's first state).
* ``destinations(objs, skeleton)``: where a recipient receives each tensor: the objects' own
  tensor of the same path, dtype and shape (received in place: no second copy of the state),
  else a new one (an optimizer that never stepped has no state yet).
* ``TensorState.restore`` / ``FlatState.restore``: rebuild each state dict and call
  ``load_state_dict`` (module parameters keep their identity, so optimizers keep referencing
  them; an optimizer that never stepped adopts the received tensors without a copy).
* ``checksum(buffers)`` (exact, ~30 GB/s on CPU). The heartbeat's cheap digest of every
  registered object's state: ``agent/digests.py``. The wire: ``agent/transfer.py``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

_ALIGN = 64          # chunk boundaries (bytes): int64 views of chunks stay aligned
_BLOCK = 1024        # int64 words per checksum block
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # the tail's weight, as a signed int64


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


class TensorSpec(NamedTuple):
    """One tensor of a ``TensorState``: what a recipient allocates or matches."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


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


@functools.cache  # asked per tensor at every commit (the digest): the import once
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


# ---------------------------------------------------------------------------- skeletons
def _fill(node: Any, get: Callable[[int], Tensor], clone: bool, mesh: Any = None) -> Any:
    """``node`` (a skeleton part) with its placeholders replaced by ``get(index)`` (cloned
    when ``clone``); a ``_DRef`` becomes a ``DTensor`` on ``mesh``."""
    if isinstance(node, _TRef):
        t = get(node.index)
        return t.clone() if clone else t
    if isinstance(node, _DRef):
        if mesh is None:
            raise TypeError("sharded (DTensor) state restored into objects with no "
                            "sharded parameter to take the mesh from")
        t = get(node.index)
        return _dtensor_type().from_local(t.clone() if clone else t, mesh, node.placements,
                                          run_check=False, shape=torch.Size(node.shape),
                                          stride=node.stride)
    if isinstance(node, dict):
        new = copy.copy(node)  # keeps the dict type and attributes (``_metadata``)
        for k, v in node.items():
            new[k] = _fill(v, get, clone, mesh)
        return new
    if isinstance(node, list):
        return [_fill(v, get, clone, mesh) for v in node]
    if isinstance(node, tuple):
        items = [_fill(v, get, clone, mesh) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    return node


def _strip(objs: Mapping[str, Any], extra: Mapping[str, Any] | None
           ) -> tuple[dict[str, Any], Any, list[Tensor]]:
    """The state dicts of ``objs`` and ``extra`` with every tensor replaced by a placeholder,
    and the tensors (by reference; tensors sharing memory, tied weights, once)."""
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
    return structures, strip(dict(extra or {})), refs


def _check_names(have: Mapping[str, Any], objs: Mapping[str, Any], strict: bool) -> None:
    if strict and set(have) != set(objs):
        raise KeyError(f"state holds {sorted(have)}, objects are {sorted(objs)}")


# ---------------------------------------------------------------------------- live / received
@dataclass
class TensorState:
    """State dicts as a picklable ``skeleton`` (``objs``, ``extra``, ``tensors``: one
    ``TensorSpec`` per placeholder) and the ``tensors`` themselves: the objects' live tensors
    (``describe``), views into a snapshot (``FlatState.view``) or what a recipient received
    (``in_place``: the indices received straight into the objects' own tensors)."""

    skeleton: dict[str, Any]
    tensors: list[Tensor]
    stats: dict[str, Any] = field(default_factory=dict)  # transfer telemetry (recv_state)
    in_place: frozenset[int] = frozenset()

    @property
    def specs(self) -> list[TensorSpec]:
        return self.skeleton["tensors"]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def extra(self) -> dict[str, Any]:
        return _fill(self.skeleton["extra"], self.tensors.__getitem__, clone=True)

    def layout_hash(self) -> int:
        return _layout_hash([(s.dtype, s.shape) for s in self.specs])

    def restore(self, objs: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
        """``load_state_dict`` on every object, with the tensors themselves (no copy:
        received tensors become the optimizer's state); module entries received in place
        are left out of the load (they are the module's own tensors already). Returns
        ``extra``."""
        have = self.skeleton["objs"]
        _check_names(have, objs, strict)
        mesh = _mesh_of(objs)
        get = self.tensors.__getitem__
        for name, obj in objs.items():
            node = have.get(name)
            if node is None:
                continue
            done: set[str] = set()
            if isinstance(obj, torch.nn.Module) and isinstance(node, dict) and self.in_place:
                live = obj.state_dict()
                done = {k for k, v in node.items() if type(v) is _TRef and v.index in self.in_place
                        and isinstance(live.get(k), Tensor)
                        and live[k].data_ptr() == self.tensors[v.index].data_ptr()}
            if not done:
                obj.load_state_dict(_fill(node, get, clone=False, mesh=mesh))
                continue
            rest = copy.copy(node)
            for k in done:
                del rest[k]
            missing, unexpected = obj.load_state_dict(_fill(rest, get, False, mesh),
                                                      strict=False)
            if unexpected or set(missing) - done:
                raise KeyError(f"{name}: state does not fit (missing "
                               f"{sorted(set(missing) - done)}, unexpected {unexpected})")
        return self.extra


def describe(objs: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> TensorState:
    """The state of ``objs`` (name -> object with ``state_dict()``) and ``extra`` by
    reference: no copy. Valid while nothing changes the objects (a source sends from it)."""
    structures, extra_s, refs = _strip(objs, extra)
    specs = [TensorSpec(t.dtype, tuple(t.shape), str(t.device)) for t in refs]
    skeleton = {"version": 2, "objs": structures, "extra": extra_s, "tensors": specs}
    return TensorState(skeleton=skeleton, tensors=refs)


def destinations(objs: Mapping[str, Any], skeleton: Mapping[str, Any],
                 device: torch.device | None = None) -> tuple[list[Tensor], frozenset[int]]:
    """Where a recipient receives each tensor of ``skeleton``: the objects' own tensor at the
    same place of their state dicts when it has the same dtype, shape and device type and is
    contiguous and aligned (received in place), else a new one: on ``device`` (the
    recipient's model device) where the source's was a GPU, so a pod whose model is on
    another index than the source's gets it on its own; else on the spec's device. Returns
    the tensors and the indices received in place."""
    specs: list[TensorSpec] = skeleton["tensors"]
    out: list[Tensor | None] = [None] * len(specs)
    used: set[int] = set()   # data pointers taken: two indices never share one tensor
    DTensor = _dtensor_type()

    def match(node: Any, live: Any) -> None:
        if isinstance(node, (_TRef, _DRef)):
            t = live.to_local() if DTensor and isinstance(live, DTensor) else live
            sp = specs[node.index]
            if (out[node.index] is None and isinstance(t, Tensor)
                    and t.dtype == sp.dtype and tuple(t.shape) == sp.shape
                    and t.device.type == torch.device(sp.device).type and t.is_contiguous()
                    and t.data_ptr() % _ALIGN == 0 and t.data_ptr() not in used):
                out[node.index] = t.detach() if t.requires_grad else t  # keep identity
                used.add(t.data_ptr())
        elif isinstance(node, dict) and isinstance(live, dict):
            for k, v in node.items():
                if k in live:
                    match(v, live[k])
        elif isinstance(node, (list, tuple)) and isinstance(live, (list, tuple)) \
                and len(node) == len(live):
            for v, w in zip(node, live):
                match(v, w)

    for name, node in skeleton["objs"].items():
        if name in objs:
            match(node, objs[name].state_dict())
    in_place = frozenset(i for i, t in enumerate(out) if t is not None)
    def home(sp: TensorSpec) -> Any:
        on_gpu = torch.device(sp.device).type == "cuda"
        return device if on_gpu and device is not None and device.type == "cuda" else sp.device

    tensors = [t if t is not None else torch.empty(sp.shape, dtype=sp.dtype, device=home(sp))
               for t, sp in zip(out, specs)]
    return tensors, in_place


# ---------------------------------------------------------------------------- flat state
@dataclass
class FlatState:
    """State dicts split into a picklable ``skeleton`` and a few 1-D ``buffers``: a frozen
    copy of the state (``snapshot``, a checkpoint)."""

    skeleton: dict[str, Any]
    buffers: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def names(self) -> list[str]:
        return list(self.skeleton["objs"])

    @property
    def extra(self) -> dict[str, Any]:
        """The ``extra`` dict given to ``snapshot`` (tensors in it are fresh copies)."""
        return _fill(self.skeleton["extra"], self.tensor, clone=True)

    def tensor(self, i: int) -> Tensor:
        """Tensor ``i`` of the skeleton, as a view into its buffer."""
        m: TensorMeta = self.skeleton["metas"][i]
        return self.buffers[m.buffer][m.offset:m.offset + m.numel].view(m.shape)

    def view(self) -> TensorState:
        """This copy as a ``TensorState`` of views into the buffers (what is sent)."""
        metas: list[TensorMeta] = self.skeleton["metas"]
        specs = self.skeleton["specs"]
        tspecs = [TensorSpec(specs[m.buffer].dtype, tuple(m.shape), specs[m.buffer].device)
                  for m in metas]
        sk = {"version": 2, "objs": self.skeleton["objs"], "extra": self.skeleton["extra"],
              "tensors": tspecs}
        return TensorState(skeleton=sk, tensors=[self.tensor(i) for i in range(len(metas))])

    def state_dict_of(self, name: str, clone: bool = True) -> Any:
        """The rebuilt state dict of ``name`` (``clone=False``: views into the buffers)."""
        return _fill(self.skeleton["objs"][name], self.tensor, clone)

    def restore(self, objs: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
        """``load_state_dict`` on every object; returns ``extra``. Modules get views into the
        buffers (their load copies in place, parameters keep their identity); everything
        else gets fresh tensors, so optimizer state never aliases these buffers.
        ``strict``: the names of ``objs`` and of the state must be the same."""
        have = self.skeleton["objs"]
        _check_names(have, objs, strict)
        mesh = _mesh_of(objs)  # sharded (FSDP2) state is rebuilt on the objects' mesh
        for name, obj in objs.items():
            if name in have:
                is_module = isinstance(obj, torch.nn.Module)
                obj.load_state_dict(_fill(have[name], self.tensor, not is_module, mesh))
        return self.extra


def snapshot(objs: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
             to_host: bool = False, reuse: FlatState | None = None,
             non_blocking: bool = False) -> FlatState:
    """Copy the state of ``objs`` (name -> object with ``state_dict()``) and ``extra`` into a
    FlatState: one contiguous buffer per (dtype, device). Tensors that share memory (tied
    weights) are stored once. Non-tensor leaves must be picklable. ``to_host``: buffers of
    CUDA tensors are built in pinned host memory, tensor by tensor (no second copy of the
    state on the GPU); the specs keep the device, so a restore puts them back there.
    ``reuse``: an older snapshot of the same layout whose buffers are written over (no new
    allocation: a periodic copy of a 70B model's state is not re-allocated each time); its
    buffers are used only where their dtype, device and size match. ``non_blocking``: device
    to pinned-host copies are queued on the current CUDA stream (the caller waits for it
    before the state changes or the copy is read)."""
    structures, extra_s, refs = _strip(objs, extra)
    groups: dict[tuple[torch.dtype, str], list[int]] = {}
    for i, t in enumerate(refs):
        groups.setdefault((t.dtype, str(t.device)), []).append(i)
    metas: list[TensorMeta | None] = [None] * len(refs)
    buffers: list[Tensor] = []
    specs: list[BufferSpec] = []
    for b, ((dtype, dev), idx) in enumerate(groups.items()):
        # every tensor starts 64-byte aligned: a view of it can be checksummed and sent as is
        step = max(1, _ALIGN // dtype.itemsize)
        off = 0
        for i in idx:
            n = refs[i].numel()
            metas[i] = TensorMeta(b, off, n, tuple(refs[i].shape))
            off += -(-n // step) * step
        host = to_host and torch.device(dev).type == "cuda"
        old = reuse.buffers[b] if reuse is not None and b < len(reuse.buffers) else None
        if (old is not None and old.dtype == dtype and old.numel() == off
                and reuse.skeleton["specs"][b].device == dev):
            buf = old
        else:
            buf = (torch.empty(off, dtype=dtype, pin_memory=True) if host
                   else torch.empty(off, dtype=dtype, device=dev))
        for j, i in enumerate(idx):
            m = metas[i]
            buf[m.offset:m.offset + m.numel].copy_(refs[i].reshape(-1),
                                                   non_blocking=non_blocking)
            end = metas[idx[j + 1]].offset if j + 1 < len(idx) else off
            buf[m.offset + m.numel:end].zero_()  # padding: checksums see the same bytes
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


def checksum_words(u8: Tensor) -> Tensor:
    """The two 64-bit sums of ``_checksum_u8`` as one int64 tensor of 2 on ``u8``'s device
    (wrapping arithmetic: the same bits as the exact sums modulo 2**64): many of them are
    read to the host at once (``shadow.state_word``), not 3 reads a tensor."""
    n = u8.numel()
    n8 = n - n % 8
    s1 = s2 = torch.zeros((), dtype=torch.int64, device=u8.device)
    if n8:
        w = u8[:n8].view(torch.int64)
        nb = w.numel() // _BLOCK
        rest = w[nb * _BLOCK:].sum()
        if nb:
            body = w[:nb * _BLOCK].view(nb, _BLOCK).sum(1)
            weights = torch.arange(1, nb + 1, dtype=torch.int64, device=body.device)
            s1, s2 = body.sum(), (body * weights).sum()
        s1, s2 = s1 + rest, s2 + rest * (nb + 1)
    if n8 != n:  # the last bytes as a little-endian word (zero-padded)
        pad = torch.zeros(8, dtype=torch.uint8, device=u8.device)
        pad[:n - n8] = u8[n8:]
        tail = pad.view(torch.int64)[0]
        s1, s2 = s1 + tail, s2 + tail * _GOLDEN
    return torch.stack([s1, s2])


def checksum_of(words: Sequence[int], nbytes: int) -> int:
    """``_checksum_u8``'s value from ``checksum_words`` read to the host."""
    return (words[0] & _M64) | ((words[1] & _M64) << 64) | (nbytes << 128)


def _checksum_u8(u8: Tensor) -> int:
    """Exact checksum of a byte range whose start is 8-byte aligned: wrapping int64 sums of
    1024-word blocks, combined plainly and weighted by block position, plus the length. Any
    change of one 64-bit word changes it; so do swapped or misplaced blocks. One read."""
    return checksum_of(checksum_words(u8).tolist(), u8.numel())


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


def _layout_hash(specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Dtypes and shapes of a state's tensors, as a non-negative int62."""
    h = hashlib.blake2b(repr([(str(d), tuple(sh)) for d, sh in specs]).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)
