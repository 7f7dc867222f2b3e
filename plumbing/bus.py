"""The bus layer shared by services and the agent.

* connect with reconnect and backoff;
* typed publish (pydantic -> JSON, W3C trace context in NATS headers, optional
  ``Nats-Msg-Id`` so the job's JetStream stream deduplicates);
* typed subscribe that validates on receive: a malformed, oversized, wrong-version or
  unknown message is logged with its subject and reason, counted, and dropped; a handler
  that raises is logged and the subscription goes on;
* idempotent creation of the job's audit stream and KV buckets, replicated over the bus's
  servers (at most 3) when it has several.

A URL may name several servers, comma-separated (``nats://a:4222,nats://b:4222``): the
client connects to one and fails over to another by itself.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context
from opentelemetry import propagate
from pydantic import ValidationError

from schemas import MAX_PAYLOAD_BYTES, Message, Subjects

from . import logs

M = TypeVar("M", bound=Message)
# A client of a bus of several servers finds a dead one (no answer to FAILOVER_PINGS + 1 pings
# FAILOVER_PING_S apart) and reconnects to another within FAILOVER_S: `up --bus-servers N`
# keeps the fault timeout above it, so a healthy pod's heartbeats that go quiet while it fails
# over are not read as its loss.
FAILOVER_PING_S = 0.5
FAILOVER_PINGS = 2
FAILOVER_CONNECT_S = 0.5
# noticed, one connect to the lost server itself, then the reconnect and its resubscriptions
FAILOVER_S = FAILOVER_PING_S * (FAILOVER_PINGS + 1) + FAILOVER_CONNECT_S + 0.5

log = logs.get("bus")


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    @classmethod
    def load(cls, path: str | Path) -> "Credentials":
        data = json.loads(Path(path).read_text())
        return cls(user=data["user"], password=data["password"])

    def __repr__(self) -> str:  # never log a password
        return f"Credentials(user={self.user!r}, password=***)"


@dataclass
class Envelope:
    """What a handler gets besides the validated model."""

    subject: str
    headers: dict[str, str]
    raw: Msg
    _ctx: otel_context.Context | None = field(default=None, repr=False)

    @property
    def ctx(self) -> otel_context.Context:
        """The W3C trace context of the headers, extracted on first use: most messages
        (heartbeats) never need it, and extraction costs about as much as validation."""
        if self._ctx is None:
            self._ctx = propagate.extract(self.headers)
        return self._ctx

    @property
    def msg_id(self) -> str | None:
        return self.headers.get("Nats-Msg-Id")


class DropError(ValueError):
    """A message that does not satisfy the wire contract."""


def version_of(model: type[Message]) -> int:
    """The ``schema_version`` a model carries (1 for most; a later wire of a kind has its
    own, e.g. ``PlanRef``'s 2)."""
    return model.model_fields["schema_version"].default


def decode(model: type[M] | tuple[type[M], ...], data: bytes, subject: str = "",
           max_bytes: int = MAX_PAYLOAD_BYTES) -> M:
    """Validate one payload or raise DropError with a short reason. ``model``: one model, or
    the models of a subject that carries several versions (chosen by ``schema_version``)."""
    if len(data) > max_bytes:
        raise DropError(f"oversized payload ({len(data)} bytes > {max_bytes})")
    models = model if isinstance(model, tuple) else (model,)
    # Fast path (pydantic's JSON parser, ~4x cheaper: services see every heartbeat). It only
    # accepts; anything it rejects, or a payload that left schema_version to its default,
    # takes the careful path below, which says why it is dropped.
    for m in models:
        try:
            msg = m.model_validate_json(data)
        except (ValidationError, ValueError):
            continue
        if "schema_version" in msg.model_fields_set:
            _check_pod(msg, subject)
            return msg
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DropError(f"not JSON: {e.__class__.__name__}: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise DropError(f"payload is a JSON {type(obj).__name__}, not an object")
    version = obj.get("schema_version")
    chosen = [m for m in models if version_of(m) == version]
    if not chosen:
        want = " or ".join(str(version_of(m)) for m in models)
        raise DropError(f"schema_version {version!r} is not {want}")
    try:
        msg = chosen[0].model_validate(obj)
    except ValidationError as e:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in e.errors()[:3]
        )
        raise DropError(f"invalid {chosen[0].subject_kind}: {errs}"[:400]) from None
    _check_pod(msg, subject)
    return msg


def _check_pod(msg: Message, subject: str) -> None:
    """Per-pod subjects must agree with the payload (no spoofing another pod's heartbeat)."""
    pod = getattr(msg, "pod", None)
    tokens = subject.split(".")
    if pod is not None and len(tokens) == 4 and tokens[2] in ("heartbeat", "report", "lifecycle"):
        if tokens[3] != pod:
            raise DropError(f"subject names pod {tokens[3]!r} but payload says {pod!r}")


MAX_REPLICAS = 3  # JetStream's limit per stream; R3 keeps quorum over one lost server


def split_urls(url: str) -> list[str]:
    """The servers of a bus URL (comma-separated), or ValueError for none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no nats-server URL in {url!r}")
    return servers


_FLUSH_BACKSTOP_S = 120.0  # past nats-py's stale-connection detection (3 pings x 5 s)


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failed background flush is not an unhandled error


async def watch_key(kv: Any, key: str, on_value: Callable[[bytes], None], what: str) -> None:
    """Follow one KV key for as long as the task runs: ``on_value`` gets every non-empty
    value (the current one first). A watch that fails (a reconnect) is stopped and started
    again a second later; cancel the task to end it."""
    while True:
        w = None
        try:
            w = await kv.watch(key)
            async for entry in w:
                if entry is not None and entry.value:
                    on_value(entry.value)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reconnecting: watch again
            log.debug("KV watch failed", key=key, what=what, error=str(e)[:200])
            await asyncio.sleep(1.0)
        finally:
            if w is not None:
                try:
                    await w.stop()
                except Exception:
                    pass


@dataclass
class Bus:
    nc: NATS
    subjects: Subjects
    name: str
    dropped: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)  # not decoded: without ``only``'s bytes
    handler_errors: int = 0
    # set by close(): the disconnect that follows is this client's own, not a warning
    closing: bool = False
    # copies of each stream and bucket this client creates: one per server it was given,
    # at most MAX_REPLICAS (every client is given every server, so all agree)
    replicas: int = 1

    # ------------------------------------------------------------------ connection
    @classmethod
    async def connect(cls, url: str, job: str, name: str,
                      creds: Credentials | None = None, **options: Any) -> "Bus":
        bus: list[Bus] = []  # the instance, once connected (the callbacks come first)

        async def _disconnected() -> None:
            if bus and bus[0].closing:  # our own close: expected, not worth a warning
                log.debug("nats disconnected (closed)", client=name)
            else:
                log.warning("nats disconnected", client=name)

        async def _reconnected() -> None:
            log.info("nats reconnected", client=name)

        async def _error(e: Exception) -> None:
            log.warning("nats error", client=name, error=str(e)[:200])

        opts: dict[str, Any] = dict(
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,      # forever: the control plane may be restarting
            reconnect_time_wait=0.25,
            connect_timeout=2,
            ping_interval=5,
            max_outstanding_pings=3,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            error_cb=_error,
        )
        if creds is not None:
            opts.update(user=creds.user, password=creds.password)
        servers = split_urls(url)
        if len(servers) > 1:
            # A lost host sends no RST: only unanswered pings tell a client that its server
            # is gone. With another server to go to, that is noticed in FAILOVER_S, not ~20 s
            # (the whole job's heartbeats through the lost server stopped: test_hosts_e2e).
            opts.update(ping_interval=FAILOVER_PING_S, max_outstanding_pings=FAILOVER_PINGS)
        if any(u.startswith("tls://") for u in servers) and "tls" not in options:
            from .tlsgen import client_context

            opts["tls"] = client_context()  # verifies against CEASELESS_TLS_CA if set
        opts.update(options)
        nc = await nats.connect(servers=servers, **opts)
        if len(servers) > 1 and "connect_timeout" not in options:
            # reconnects only (the first connect keeps its 2 s on a loaded machine): a try of
            # the lost server itself, which the pool may offer first, gives up as quickly
            nc.options["connect_timeout"] = FAILOVER_CONNECT_S
        bus.append(cls(nc=nc, subjects=Subjects(job), name=name,
                       replicas=min(MAX_REPLICAS, len(servers))))
        return bus[0]

    def reconnects(self) -> int:
        """How many times the connection came back (a watch opened before may be deaf)."""
        try:
            return int(self.nc.stats.get("reconnects", 0))
        except Exception:
            return 0

    async def close(self) -> None:
        self.closing = True
        try:
            await self.nc.drain()
        except Exception:
            try:
                await self.nc.close()
            except Exception:
                pass

    @property
    def js(self):
        return self.nc.jetstream()

    # ------------------------------------------------------------------ publish
    @staticmethod
    def headers_for(msg_id: str | None = None,
                    ctx: otel_context.Context | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        propagate.inject(headers, context=ctx)
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        return headers

    async def publish(self, subject: str, msg: Message, *, msg_id: str | None = None,
                      ctx: otel_context.Context | None = None) -> None:
        data = msg.model_dump_json(by_alias=True).encode()
        await self.nc.publish(subject, data, headers=self.headers_for(msg_id, ctx) or None)

    async def request(self, subject: str, msg: Message, reply_model: type[M],
                      timeout: float = 2.0) -> M:
        data = msg.model_dump_json(by_alias=True).encode()
        resp = await self.nc.request(subject, data, timeout=timeout,
                                     headers=self.headers_for() or None)
        return decode(reply_model, resp.data, resp.subject)

    # ------------------------------------------------------------------ subscribe
    def drop(self, subject: str, reason: str) -> None:
        kind = self.subjects.kind_of(subject) or "unknown"
        self.dropped[(kind, reason.split(":")[0])] += 1
        log.warning("dropped message", subject=subject[:200], reason=reason, client=self.name)

    async def subscribe(self, subject: str, model: type[M] | tuple[type[M], ...],
                        handler: Callable[[M, Envelope], Awaitable[None]],
                        queue: str = "", only: bytes | None = None) -> Any:
        """``only``: a payload without these bytes is not even decoded (counted in
        ``skipped``): a subscriber that wants few of a subject's messages (the scaler, the
        preemption notices among every agent's reports) does not parse the others. A
        superset test: what it lets through is decoded and checked as any."""
        kind = (model[0] if isinstance(model, tuple) else model).subject_kind

        async def _cb(raw: Msg) -> None:
            if only is not None and only not in raw.data:
                self.skipped[kind] += 1
                return
            try:
                msg = decode(model, raw.data, raw.subject)
            except DropError as e:
                self.drop(raw.subject, str(e))
                return
            env = Envelope(subject=raw.subject, headers=dict(raw.headers or {}), raw=raw)
            self.received[kind] += 1
            try:
                await handler(msg, env)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a handler bug must not kill the subscription
                self.handler_errors += 1
                log.exception("handler failed", subject=raw.subject, error=str(e)[:200],
                              client=self.name)

        sub = await self.nc.subscribe(subject, queue=queue, cb=_cb)
        # SUB is asynchronous: without a round trip, a message another connection publishes
        # right after this returns can reach the server before the interest does, and is lost.
        if not await self.round_trip(2.0):  # the client re-subscribes on reconnect
            log.warning("subscribe not confirmed", subject=subject, client=self.name)
        return sub

    async def round_trip(self, timeout: float) -> bool:
        """Did nats-server answer a PING within ``timeout``? nats-py's ``flush(timeout)``
        cancels its PONG future when it times out, and the late PONG then raises
        InvalidStateError in the client's read loop, which stops reading for good while
        ``is_connected`` stays True (nats-py 2.16; seen with a paused server). So the flush
        runs shielded with a long timeout: a late PONG finds its future still pending (a
        reconnect drops the pending ones)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.ping()), timeout)
            return True
        except Exception:
            return False

    def ping(self) -> "asyncio.Future[None]":
        """A PING now; the future completes with its PONG, which nats-server sends after
        everything it sent this client before (a barrier), or fails on a reconnect. Wait on
        it shielded (``round_trip``): it is never cancelled from outside."""
        inner = asyncio.ensure_future(self.nc.flush(timeout=_FLUSH_BACKSTOP_S))
        inner.add_done_callback(_consume)
        return inner

    # ------------------------------------------------------------------ JetStream
    async def ensure_stream(self, storage: StorageType = StorageType.FILE,
                            max_age: float = 7 * 24 * 3600) -> None:
        """The job's audit log: every job subject but heartbeats, replayable."""
        cfg = StreamConfig(
            name=self.subjects.stream,
            subjects=self.subjects.audit_subjects(),
            storage=storage,
            max_age=max_age,
            max_msgs=1_000_000,
            max_msg_size=MAX_PAYLOAD_BYTES,
            duplicate_window=120.0,
            num_replicas=self.replicas,
        )
        try:
            await self.js.add_stream(cfg)
        except BadRequestError:
            # exists with another config: converge, never to fewer copies than it has (a
            # client given one server of several must not shrink the cluster's stream)
            have = (await self.js.stream_info(cfg.name)).config.num_replicas or 1
            cfg.num_replicas = max(self.replicas, have)
            await self.js.update_stream(cfg)

    async def kv(self, storage: StorageType = StorageType.FILE,
                 timeout: float | None = None) -> KeyValue:
        """The job's bucket. ``timeout``: its requests' (nats-py's JetStream default is 5 s;
        a lease check must give up within a tick: a bucket whose stream leader was lost
        answers nothing until its Raft group elects another, ~5 s, and a request sent
        meanwhile is never answered, so a 5 s timeout came on top of the election)."""
        if timeout is not None:
            await self._bucket(self.subjects.kv_bucket, history=16, ttl=None, storage=storage)
            return await self.nc.jetstream(timeout=timeout).key_value(self.subjects.kv_bucket)
        return await self._bucket(self.subjects.kv_bucket, history=16, ttl=None, storage=storage)

    async def store_kv(self, ttl: float = 3600.0) -> KeyValue:
        # Memory storage: c10d keys are hot and short-lived; the TTL stops them piling up.
        return await self._bucket(self.subjects.store_bucket, history=1, ttl=ttl,
                                  storage=StorageType.MEMORY)

    async def _bucket(self, bucket: str, history: int, ttl: float | None,
                      storage: StorageType) -> KeyValue:
        try:
            return await self.js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            pass
        try:
            return await self.js.create_key_value(KeyValueConfig(
                bucket=bucket, history=history, ttl=ttl, storage=storage,
                max_value_size=MAX_PAYLOAD_BYTES, replicas=self.replicas))
        except BadRequestError:
            return await self.js.key_value(bucket)  # lost a creation race

    async def ensure_job_storage(self, timeout: float) -> None:
        """The audit stream and both buckets, retried until ``timeout``: a clustered bus
        answers JetStream requests only once its servers have elected a meta leader."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await self.ensure_stream()
                await self.kv()
                await self.store_kv()
                return
            except Exception as e:  # no meta leader yet: unavailable, a timeout
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                log.debug("JetStream not ready", error=str(e)[:200], client=self.name)
                await asyncio.sleep(0.25)
