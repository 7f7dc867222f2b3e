"""What every control-plane service shares: CLI arguments, connection, NATS micro
registration with a ``status`` endpoint, and a clean shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
import uuid
from itertools import islice
from typing import Any, Awaitable, Callable, Iterable, Protocol

import nats.micro

from schemas import check_id
from services.common.lease import LEASE_TTL, Lease

from plumbing import logs
from plumbing.aio import cancel_all, wait_event  # noqa: F401  (re-exported)
from plumbing.bus import Bus, Credentials


class Part(Protocol):
    """A piece a service starts and stops with itself (``PlanFollower``, ``HeartbeatFeed``)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# subject, message, handler[, only: the bytes a payload must hold to be decoded (Bus.subscribe)]
Subscription = tuple[Any, ...]
STATUS_ITEMS = 1000  # per-pod entries one status lists at most (Service.listed)


class Service:
    """Base class: subclasses set ``name``, implement ``status`` and describe their start as
    data: ``parts()`` (started in order, stopped in reverse), ``subscriptions()``, then
    ``on_start()`` (spawn loops, log). ``stop`` undoes it all in reverse: subscriptions,
    spawned tasks, the micro service, the parts, then ``on_stop()``.

    Every service holds a lease (services/common/lease.py, issue 42): several instances may
    run, only the holder acts (``acting``) and stamps what it publishes with ``term``; the
    others are standbys that keep their view fresh. ``on_lease_acquired`` /
    ``on_lease_lost`` are the subclass's hooks. A clean stop gives the lease back first."""

    name: str = "service"
    version: str = "0.1.0"
    description: str = ""

    def __init__(self, bus: Bus, *, instance_id: str | None = None,
                 lease_ttl: float | None = None) -> None:
        self.bus = bus
        self.instance_id = instance_id or f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.log = logs.get(self.name).bind(instance=self.instance_id)
        self.lease = Lease(bus, self.name, self.instance_id, lease_ttl or LEASE_TTL, self.log,
                           self.on_lease_acquired, self.on_lease_lost)
        self.started_at = time.time()
        self._micro: Any = None
        self._tasks: list[asyncio.Task] = []
        self._subs: list[Any] = []
        self._started: list[Part] = []
        self.ignored: dict[str, int] = {}  # messages dropped, by the reason's first words

    def _ignore(self, subject: str, reason: str, level: str = "info", **kw: Any) -> None:
        """A message this service drops: counted (``status``'s ``ignored``) and logged with
        its subject and the reason (the first words, before a colon, are the count's key)."""
        key = reason.split(":")[0][:60]
        self.ignored[key] = self.ignored.get(key, 0) + 1
        getattr(self.log, level)("ignored message", subject=subject, reason=reason, **kw)

    def parts(self) -> list[Part]:
        return []

    def subscriptions(self) -> list[Subscription]:
        return []

    async def on_start(self) -> None:
        """After the parts and the subscriptions: spawn loops, say it started."""

    async def on_stop(self) -> None:
        """After everything else stopped."""

    def on_lease_acquired(self, term: int) -> None:
        """This instance became the active one (term ``term``): rebuild what only the
        active one keeps (called on the event loop, must not block)."""

    def on_lease_lost(self, holder: str | None) -> None:
        """This instance is a standby again (``holder`` holds the lease, if known)."""

    @property
    def acting(self) -> bool:
        return self.lease.acting

    @property
    def term(self) -> int | None:
        """The term to stamp on what this instance publishes (None while a standby)."""
        return self.lease.term if self.acting else None

    async def start(self) -> None:
        try:
            await self.bus.ensure_stream()
        except Exception as e:  # another service may create it; the KV still works
            self.log.warning("could not ensure the job stream", error=str(e)[:200])
        for part in self.parts():
            await part.start()
            self._started.append(part)
        for subject, cls, handler, *only in self.subscriptions():
            self._subs.append(await self.bus.subscribe(subject, cls, handler,
                                                       only=only[0] if only else None))
        await self.lease.start()
        await self.on_start()

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def listed(items: Iterable[tuple[Any, Any]], count: int,
               limit: int | None = None) -> dict[Any, Any]:
        """The first ``limit`` (STATUS_ITEMS) of ``count`` per-pod entries of a status: the
        reply is one message (at most MAX_PAYLOAD_BYTES), and a listing of every pod is
        megabytes at 16,384 (docs/benchmarks.md, "Message sizes"). The status gives the
        count beside it (``*_total``)."""
        return dict(islice(items, STATUS_ITEMS if limit is None else limit))

    def base_status(self) -> dict[str, Any]:
        return {
            "service": self.name,
            "job": self.bus.subjects.job,
            "uptime_s": round(time.time() - self.started_at, 3),
            "received": dict(self.bus.received),
            "dropped": {f"{k}:{r}": n for (k, r), n in self.bus.dropped.items()},
            "skipped": dict(self.bus.skipped),  # not decoded: not what it subscribed for
            "handler_errors": self.bus.handler_errors,
            "lease": self.lease.status(),
        }

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        return task

    async def register_micro(self) -> None:
        """Discoverable with `nats micro ls|info|stats`; `status` answers `ceaseless status`."""

        async def _status(req: Any) -> None:
            try:
                body = {**self.base_status(), **self.status()}
            except Exception as e:  # status must answer even if a view is half-built
                body = {"service": self.name, "error": str(e)[:200]}
            await req.respond(json.dumps(body, default=str).encode())

        self._micro = await nats.micro.add_service(
            self.bus.nc, name=f"ceaseless_{self.name}", version=self.version,
            description=self.description or self.name,
            metadata={"job": self.bus.subjects.job},
        )
        await self._micro.add_endpoint(
            name="status", subject=self.bus.subjects.service_status(self.name), handler=_status)
        await self.bus.round_trip(5.0)  # its SUB confirmed: a request right after is answered

    async def stop(self) -> None:
        await self.lease.stop()  # a standby takes over now, not at expiry
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # disconnected: nothing left to undo
                pass
        self._subs.clear()
        await cancel_all(self._tasks)
        if self._micro is not None:
            try:
                await self._micro.stop()
            except Exception:
                pass
        while self._started:
            await self._started.pop().stop()
        await self.on_stop()


def common_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nats", default=os.environ.get("CEASELESS_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--creds", default=os.environ.get("CEASELESS_CREDS"),
                   help="JSON file with user and password")
    p.add_argument("--job", default=os.environ.get("CEASELESS_JOB", "demo"))
    p.add_argument("--run-dir", default=os.environ.get("CEASELESS_RUN_DIR"))
    p.add_argument("--log-level", default=os.environ.get("CEASELESS_LOG_LEVEL", "info"))
    p.add_argument("--instance-id", default=None,
                   help="this instance's lease holder id; a restart with the same id takes "
                        "its lease back at once (default: random)")
    p.add_argument("--lease-ttl", type=float, default=LEASE_TTL,
                   help="seconds the service's lease lasts unrenewed: a standby takes over "
                        "within about 4/3 of it (default %(default)g)")
    return p


async def serve(service_cls: type[Service], args: argparse.Namespace, **kwargs: Any) -> None:
    check_id(args.job, "job name")
    logs.configure(service_cls.name, args.log_level)
    try:
        from plumbing import telemetry

        telemetry.init(service_cls.name, run_dir=args.run_dir, job=args.job)
    except Exception as e:  # tracing is an aid, never a reason not to run
        logs.get(service_cls.name).warning("telemetry disabled", error=str(e)[:200])
    if args.lease_ttl <= 0:
        raise SystemExit(f"--lease-ttl must be positive, got {args.lease_ttl}")
    creds = Credentials.load(args.creds) if args.creds else None
    bus = await Bus.connect(args.nats, args.job, service_cls.name, creds)
    kwargs.setdefault("instance_id", args.instance_id)
    kwargs.setdefault("lease_ttl", args.lease_ttl)
    svc = service_cls(bus, **kwargs)
    await svc.start()
    await svc.register_micro()
    svc.log.info("service started", nats=args.nats)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    svc.log.info("service stopping")
    await svc.stop()
    await bus.close()
    try:
        from plumbing import telemetry

        telemetry.shutdown()
    except Exception:
        pass
