"""The heartbeat's state digest (``digest``: a strided sample of the parameters), computed
on the device and read a step later (``DigestSlot``).

A commit begins its step's digest (``digest_begin``: device work and an asynchronous
copy to pinned host memory behind a CUDA event) and reports the newest digest whose copy has
already landed, without waiting: on a GPU usually the previous step's, since the step's one
host sync (the loss read) came after that digest was queued. A digest always names its own
step (``Heartbeat.digest_step``), never the step it was reported with. Whoever needs the
digest of one exact step (a prejoin's report to the state broker) asks ``of(step)``, which
waits for it off the training thread. Two steps' digests at most are held (a few KB).

What it covers, and the transfer's exact agreement check:

* ``covered(objs)``: the tensors of every registered object's state: each module's
  parameters (tied ones once; buffers left out: BatchNorm statistics may differ per rank by
  design, as in ``verify.py``), each optimizer's state, and the tensors in any other
  object's ``state_dict()`` (a user's extra; not a GradScaler's: Python numbers, read with
  two host syncs), or those its ``digest_tensors()`` names (Lightning's loop progress). Sharded (FSDP2): this rank's shards.
* ``digest(covered(objs))``: the cheap heartbeat digest the broker takes the majority
  of, computed at every commit: a strided sample of all of them (the sample is taken on the
  device; a few thousand elements reach the host).
* ``exact(tensors)``: an int64 on the tensors' device, every tensor's bytes summed as int64
  words (plainly and weighted by 1024-word block), weighted by an odd number per tensor
  (exact: equal states give equal values on any rank, one changed word changes it). No copy
  of the state (nor a widened one): one pass over it on its device, one number read back.
  A transfer's sources send it in their header, and a recipient refuses sources that
  disagree (each stripe is checked against its own sender only: sources holding different
  states would otherwise hand it a mix). Once per transfer, not per step.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .hostcopy import HostCopy
from .state import checksum_words, local


class PendingDigest:
    """A ``digest`` begun on the device: the sampled bytes of every (dtype, device) group, one
    small byte tensor per device, on its way to the host (``HostCopy``: no host sync when it is
    begun; a CPU group, such as an optimizer's step counters beside CUDA parameters, is its own
    copy). ``ready()`` asks without waiting; ``result()`` waits for it (a host sync only if the
    device has not got there yet) and hashes the bytes."""

    def __init__(self, chunks: list[tuple[Tensor, list[tuple[torch.dtype, int]]]],
                 total: int) -> None:
        self._total = total
        self._copies = [(HostCopy(data), parts) for data, parts in chunks]
        self._hex: str | None = None

    def ready(self) -> bool:
        return all(c.ready() for c, _ in self._copies)

    def result(self) -> str:
        if self._hex is None:
            h = hashlib.blake2b(digest_size=8)
            for copy, parts in self._copies:
                raw = copy.get().numpy().tobytes()
                at = 0
                for dtype, n in parts:
                    h.update(str(dtype).encode())
                    h.update(raw[at:at + n])
                    at += n
            if self._copies:
                h.update(self._total.to_bytes(8, "little"))
            self._hex = h.hexdigest()
        return self._hex


def digest_begin(model: torch.nn.Module | Sequence[Tensor], samples: int = 4096
                 ) -> PendingDigest:
    """``digest`` begun on the device, read later (``PendingDigest``): views and one
    ``torch.cat`` per (dtype, device) into one small byte tensor per device, no per-tensor
    host copy."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    return _Views([local(p) for p in params], samples).begin()


class _Views:
    """The strided sample of a list of tensors as views (the sample's elements in place), in
    groups of one (dtype, device): beginning a digest is then one ``torch.cat`` per group."""

    def __init__(self, tensors: list[Tensor], samples: int) -> None:
        sizes = [t.numel() for t in tensors]
        self.total = total = sum(sizes)
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        with torch.no_grad():
            for p, n in zip(tensors, sizes):
                if not n or not total:
                    continue
                k = max(1, min(n, samples * n // total))
                step = max(1, n // k)
                # flat[::step][:k] of the tensor's elements in order; a contiguous tensor's
                # are a strided view of its storage (no reshape, no slicing). A non-contiguous
                # one's reshape may be a copy: sampled afresh at every begin (``fresh``)
                view = (p.as_strided((k,), (step,), p.storage_offset()) if p.is_contiguous()
                        else _Strided(p, k, step))
                groups.setdefault((p.dtype, p.device), []).append(view)
        self.groups = groups

    def begin(self) -> PendingDigest:
        if not self.total:
            return PendingDigest([], 0)
        with torch.no_grad():
            # cat makes a fresh contiguous tensor per group; a device's groups, one tensor
            by_dev: dict[torch.device, list[tuple[torch.dtype, Tensor]]] = {}
            for (dtype, dev), vs in self.groups.items():
                vs = [v() if isinstance(v, _Strided) else v for v in vs]
                by_dev.setdefault(dev, []).append((dtype, torch.cat(vs).view(torch.uint8)))
            chunks = [(torch.cat([b for _, b in per]) if len(per) > 1 else per[0][1],
                       [(dt, b.numel()) for dt, b in per]) for per in by_dev.values()]
        return PendingDigest(chunks, self.total)


class _Strided:
    """A non-contiguous tensor's sample, taken at each begin."""

    def __init__(self, t: Tensor, k: int, step: int) -> None:
        self.t, self.k, self.step = t, k, step

    def __call__(self) -> Tensor:
        return self.t.detach().reshape(-1)[::self.step][:self.k]


class Sampler:
    """``digest_begin`` of the covered tensors at every commit, its views kept between
    commits (issue 44: building a view of each of hundreds of tensors was the largest fixed
    cost of a small step). The state is updated in place, so the views see each step's values;
    they are built again when the tensors are not the same objects at the same storage
    (an optimizer's state created or loaded, a parameter's ``.data`` replaced). ``forget``
    drops them, and the storages they keep alive, once the state was loaded anew (a
    restore): never a second copy of the state held."""

    def __init__(self, samples: int = 4096) -> None:
        self.samples = samples
        self._lock = threading.Lock()  # the training thread begins; a restore forgets
        self._key: list[tuple[int, int]] | None = None
        self._views: _Views | None = None

    def begin(self, tensors: Sequence[Tensor]) -> PendingDigest:
        ts = [local(t) for t in tensors]
        # a view keeps its tensor alive (``_base``): an id in the key is never another's
        key = [(id(t), t.data_ptr()) for t in ts]
        with self._lock:
            if self._views is None or key != self._key:
                self._views, self._key = _Views(ts, self.samples), key
            views = self._views
        return views.begin()

    def forget(self) -> None:
        with self._lock:
            self._views = self._key = None


class DigestSlot:
    def __init__(self, begin: Callable[[], PendingDigest | None]) -> None:
        self._begin = begin
        self._lock = threading.Lock()  # the training thread commits; a prejoin thread reads
        self._pending: list[tuple[int, PendingDigest]] = []  # oldest first, at most 2
        self._ready: tuple[int, str] | None = None

    def commit(self, step: int) -> dict[str, Any]:
        """Begin ``step``'s digest; the heartbeat fields of the newest digest already read
        (``digest``, ``digest_step``), or none known yet (``digest=""``). Never waits."""
        p = self._begin()
        with self._lock:
            pend = [x for x in self._pending if x[0] < step]
            pend = (pend + ([(step, p)] if p is not None else []))[-2:]
            for s, d in reversed(pend):  # stream order: a ready digest's elders are too
                if d.ready():
                    self._ready = (s, d.result())
                    pend = [x for x in pend if x[0] > s]
                    break
            self._pending, ready = pend, self._ready
        if ready is None:
            return {"digest": "", "digest_step": None}
        return {"digest": ready[1], "digest_step": ready[0]}

    def note(self, step: int, hexdigest: str) -> str:
        """A digest computed at once (a recovery's report): held as ``step``'s."""
        with self._lock:
            self._ready, self._pending = (step, hexdigest), []
        return hexdigest

    def of(self, step: int) -> str:
        """``step``'s digest, waiting for its copy if it is in flight; "" when it is not held
        (never another step's digest)."""
        with self._lock:
            pending, ready = dict(self._pending), self._ready
        if step in pending:
            return pending[step].result()
        return ready[1] if ready is not None and ready[0] == step else ""


def digest(model: torch.nn.Module | Sequence[Tensor], samples: int = 4096) -> str:
    """Cheap hex digest of a strided sample (about ``samples`` elements in all) of the
    parameters of ``model`` (or of a list of tensors). Equal states give equal digests; it is
    a heartbeat hint, not a proof (use ``checksum`` for that). ``digest_begin`` is the same
    value read later."""
    return digest_begin(model, samples).result()


def covered(objs: Mapping[str, Any]) -> list[Tensor]:
    """The tensors the digests cover, in registration order (see module docstring)."""
    out: list[Tensor] = []
    seen: set[int] = set()

    def add(t: Tensor) -> None:
        t = local(t)
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    for o in objs.values():
        if isinstance(o, torch.nn.Module):
            for p in o.parameters():
                add(p)
        elif isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, Tensor):
                        add(v)
        elif isinstance(o, torch.amp.GradScaler):
            continue  # its state is Python numbers; reading them is two host syncs a commit
        elif hasattr(o, "digest_tensors"):  # an object that names them (no state_dict walk)
            for t in o.digest_tensors():
                add(t)
        elif hasattr(o, "state_dict"):
            for t in tensors_in(o.state_dict()):
                add(t)
    return out


def tensors_in(x: Any) -> Iterable[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from tensors_in(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_in(v)


def exact(tensors: Iterable[Tensor]) -> Tensor:
    """An int64 scalar on the first tensor's device (see module docstring); no host sync.
    Each tensor's bytes are read as int64 words (``state.checksum_words``: their wrapping
    sum ``s1`` and their block-weighted sum ``s2``, at memory speed), ``s1 + 2 s2`` weighted
    by an odd number per tensor (``2 i + 1``): a change ``d`` of one word changes it by ``d``
    times an odd number, never 0 modulo 2**64. Not the elements widened one by one: an
    int32 view summed into int64 widens the whole tensor into a temporary first, about
    1 GB/s on a CPU, the sources' largest cost in a transfer before (issue 43)."""
    acc: Tensor | None = None
    for i, t in enumerate(tensors):
        b = t.detach()
        if acc is None:
            acc = torch.zeros((), dtype=torch.int64, device=b.device)
        if b.numel() == 0:
            continue
        u8 = b.contiguous().reshape(-1).view(torch.uint8)
        if u8.data_ptr() % 8:  # int64 words need an aligned start (a view's, rarely)
            u8 = u8.clone()
        s1, s2 = checksum_words(u8).unbind()
        acc += ((s1 + 2 * s2) * (2 * i + 1)).to(acc.device)  # odd x odd: never 0 mod 2**64
    return acc if acc is not None else torch.zeros((), dtype=torch.int64)
