"""Building process groups of one generation, and keeping the abandoned ones alive.

``make_group(store, rank, world_size, timeout_s, backend)`` builds the backend object
directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never ``init_process_group``: several
generations can coexist in one process, e.g. a new group is built while a collective of the
old one is still stuck on a stopped peer. ``make_group_abortable`` builds it in a helper
thread and gives up when the caller's abort event is set. ``choose_backend`` picks gloo or
NCCL from where the tensors live. A group (or work) that may still be pending on a stuck
peer is not destroyed on the spot (its destructor would block): it is parked in the
graveyard (``graveyard.py``: ``_park``, ``abandoned``; ``reap`` frees it once it cannot
block). The collectives over a group: ``collectives.py``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .graveyard import abandoned, park, reap  # noqa: F401  (re-exported)
from .vocab import Aborted

DEFAULT_SLICE_S = 0.05

# ---------------------------------------------------------------------------- group creation
_GROUP_META: dict[int, dict[str, Any]] = {}   # id(pg) -> store/timeout, picked up by the wrapper


_CUDA_DEVICE: list[torch.device] = []          # the job's CUDA device (bind_device)


def bind_device(dev: torch.device) -> None:
    """The CUDA device this pod's groups use, from any thread. ``torch.cuda.current_device()``
    is per thread: a helper thread that builds a group (``make_group_abortable``) would read
    cuda:0 there, not the model's device (issue 30)."""
    dev = torch.device(dev)
    if dev.index is None:  # "cuda": the current device of the binding (training) thread
        dev = torch.device("cuda", torch.cuda.current_device())
    _CUDA_DEVICE[:] = [dev]


def cuda_device() -> torch.device:
    """The bound device, else this thread's current one."""
    return _CUDA_DEVICE[0] if _CUDA_DEVICE else torch.device("cuda", torch.cuda.current_device())


def _default_backend() -> str:
    """Without knowing where the tensors are: gloo (it carries CPU tensors on any machine,
    and CUDA tensors staged through host memory). ``choose_backend`` knows better."""
    return "gloo"


# PyTorch's NCCL watchdog must never kill a survivor: on a timeout or an abort it would tear
# the process down by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3 in torch 2.11-2.13), and its
# heartbeat monitor kills a process whose watchdog looks stuck. Recovery is in-process here.
# Required (set over the user's value, with one warning naming it; nvidia-resiliency-ext's
# in-process restart requires the same): only abort the communicator (2), never rethrow a
# CUDA error from the watchdog (that ends the process), no NVLink SHARP (its communicators do
# not abort cleanly; CEASELESS_NCCL_NVLS=1 keeps the user's value).
NCCL_ENV_REQUIRED = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                     "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                     "NCCL_NVLS_ENABLE": "0"}
# Defaults (a user's own setting wins): no heartbeat monitor, no dumps.
NCCL_ENV = {"TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def nccl_env_defaults(environ: Any = None) -> list[str]:
    """Apply our NCCL environment to ``environ`` (``os.environ``) before a communicator is
    built. Returns one line per user value replaced (also logged as a warning)."""
    env = os.environ if environ is None else environ
    replaced = []
    for k, v in NCCL_ENV_REQUIRED.items():
        if k == "NCCL_NVLS_ENABLE" and env.get("CEASELESS_NCCL_NVLS") == "1":
            continue
        old = env.get(k)
        if old is not None and old != v:
            replaced.append(f"{k}={old} replaced by {v}: with {old} a peer's failure could end "
                            "this process or block its abort (in-process recovery needs " + v + ")")
        env[k] = v
    for k, v in NCCL_ENV.items():
        env.setdefault(k, v)
    if replaced:
        from plumbing import logs

        for line in replaced:
            logs.get("agent").warning("NCCL setting replaced", detail=line)
    return replaced


def choose_backend(tensor_device: torch.device | str | None, override: str | None = None,
                   shared_gpu: bool | None = None) -> str:
    """The backend for a job whose tensors live on ``tensor_device`` (issue 19): the
    backend follows the tensors, not whether CUDA exists. CPU tensors: gloo (a CPU model on
    a GPU machine must not end up on NCCL). CUDA tensors: NCCL when each pod has a GPU of
    its own; gloo (staged through host memory) when pods share a GPU, which NCCL refuses
    ("Duplicate GPU detected"). ``shared_gpu`` None reads ``CEASELESS_GPU_SHARED`` (set by
    ``ceaseless up`` when it puts several pods on one GPU). ``override``
    (``CEASELESS_BACKEND``) wins."""
    if override:
        b = override.lower()
        if b not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {override!r} (gloo or nccl)")
        return b
    dev = torch.device(tensor_device) if tensor_device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return "gloo"
    if shared_gpu is None:
        shared_gpu = os.environ.get("CEASELESS_GPU_SHARED", "").strip().lower() in (
            "1", "true", "yes", "on")
    if shared_gpu or not dist.is_nccl_available():
        return "gloo"
    return "nccl"


def gloo_address(hostname: str | None = None, interface: str | None = None) -> tuple[str, str]:
    """Where gloo binds: ``("interface", name)`` from ``interface`` (or env
    ``GLOO_SOCKET_IFNAME``) if given, else ``("hostname", host)`` from ``hostname`` (default
    env ``CEASELESS_GLOO_HOSTNAME`` or ``127.0.0.1``, loopback)."""
    interface = interface or os.environ.get("GLOO_SOCKET_IFNAME") or None
    if interface:
        return "interface", interface.split(",")[0]
    return "hostname", hostname or os.environ.get("CEASELESS_GLOO_HOSTNAME") or "127.0.0.1"


def gloo_device(hostname: str | None = None, interface: str | None = None) -> Any:
    """A gloo transport device bound where ``gloo_address`` says."""
    kind, where = gloo_address(hostname, interface)
    return dist.ProcessGroupGloo.create_device(**{kind: where})


def make_group(store: dist.Store, rank: int, world_size: int, timeout_s: float = 30.0,
               backend: str | None = None, *, hostname: str | None = None,
               interface: str | None = None, device: torch.device | None = None) -> Any:
    """Build a process group backend over ``store`` (no global state, no default group).

    Blocks until all ``world_size`` ranks have connected (or ``timeout_s``). ``backend`` is
    ``"gloo"``, ``"nccl"`` or None (NCCL when CUDA is available, else gloo). Gloo uses one
    TCP device on ``hostname``/``interface`` (default loopback). NCCL binds ``device``
    (default: the current CUDA device; set it per local rank first) and connects eagerly.
    Use a fresh store prefix per generation: keys of an old group must not be reused.
    """
    if not (0 <= rank < world_size):
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    backend = (backend or _default_backend()).lower()
    td = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = td
        opts._devices = [gloo_device(hostname, interface)]
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
    elif backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError("backend 'nccl' needs CUDA and a torch build with NCCL")
        nccl_env_defaults()
        opts = dist.ProcessGroupNCCL.Options()
        # Our own sliced waits give up at ``timeout_s`` and abort the group; PyTorch's
        # watchdog gets twice that, so it is never the one that decides (and with the
        # settings above it would only abort the communicator, never the process).
        opts._timeout = timedelta(seconds=2 * timeout_s)
        dev = device or cuda_device()
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        try:  # eager communicator init, so that rendezvous happens here and not at step 1
            pg.eager_connect_single_device(dev)
        except (AttributeError, RuntimeError):
            pass
    else:
        raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")
    # The store is a Python object used through C++: keep it alive with the group.
    _GROUP_META[id(pg)] = {"store": store, "timeout_s": timeout_s, "backend": backend}
    return pg


class _Background:
    """``fn()`` on a daemon thread (blocking C++ calls there release the GIL); the caller
    polls ``done`` in slices, so it can give up without waiting for ``fn`` to return."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self._fn = fn
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            self.error = e
        finally:
            self.done.set()
            if self.abandoned:
                _park(self.result)

    def abandon(self) -> None:
        """Nobody will use the result: park it (now, or when ``fn`` returns)."""
        self.abandoned = True
        if self.done.is_set():
            _park(self.result)


def make_group_abortable(store: dist.Store, rank: int, world_size: int, abort: threading.Event,
                         timeout_s: float = 30.0, backend: str | None = None,
                         slice_s: float = DEFAULT_SLICE_S,
                         meanwhile: Callable[[], None] | None = None, **kw: Any) -> Any:
    """``make_group`` that gives up as soon as ``abort`` is set -> ``Aborted``.

    Building a gloo group blocks in C++ (it releases the GIL) until every peer has connected:
    a peer that dies after publishing its address makes it retry the connection until
    ``timeout_s``. A newer plan must not wait for that, so the group is built in a helper
    thread and the caller waits in slices; an abandoned build finishes (or fails) on its own
    and its group, if any, is parked, never used. ``meanwhile`` (optional) runs on the
    calling thread while the group is being built (e.g. snapshotting the state to send)."""

    job = _Background(lambda: make_group(store, rank, world_size, timeout_s, backend, **kw),
                      f"make-group-r{rank}")
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            job.abandon()
            raise
    while not job.done.wait(slice_s):
        if abort.is_set():
            job.abandon()
            raise Aborted(f"rendezvous of rank {rank}/{world_size} abandoned: abort requested")
    if job.error is not None:
        raise job.error
    return job.result


def _park(pg: Any, works: Any = (), *, nccl: bool | None = None, keep: Any = None) -> None:
    """Park a group built by ``make_group`` (and its pending ``works``) in the graveyard
    (``graveyard.py``) instead of destroying it; what it needs while it lives (its store,
    ``keep``) is held until it is freed. ``nccl`` None: from the group's metadata."""
    meta = _GROUP_META.pop(id(pg), None) or {}
    if nccl is None:
        nccl = meta.get("backend") == "nccl"
    held = (meta, keep)
    park(pg, list(works), gloo=not nccl, on_free=lambda: held)


