"""A plan on the bus at any job size (issue 45): whole while it is small, else by reference.

A plan up to ``INLINE_PLAN_BYTES`` goes whole, as it always did (``Plan``, schema_version 1):
the ``plan`` message and KV ``plan`` carry it. A larger one (a plan names every member: 2.5
MiB at 65,536, over nats-server's 1 MiB max payload) is stored in KV parts of
``PLAN_PART_BYTES`` under its SHA-256 digest, and a ``PlanRef`` (schema_version 2, a few
hundred bytes) names it, with the change from the previous generation's plan when that is
small (a member replaced: one rank's pod, the fenced list). A receiver holding that plan
applies the change and checks the digest; any other (a new pod, one that missed a
generation, a change too large to send) reads the parts. ``resolve`` does both.

The encoding a digest is taken of is canonical (``encode``: members and shares in rank order)
so that a plan rebuilt from a change has the same bytes as the scaler's.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from pydantic import ValidationError

from schemas import PLAN_KEY, PLAN_PARTS_PREFIX, plan_part_key
from schemas.messages import (INLINE_PLAN_BYTES, MAX_CHANGE, PLAN_LISTS, PLAN_PART_BYTES,
                              PLAN_SCALARS, Plan, PlanChange, PlanRef)

from .bus import DropError, decode

# What the ``plan`` subject and KV ``plan`` carry: a whole plan, or a reference to one.
PLAN_MODELS = (Plan, PlanRef)
# The writer's (the scaler's) environment may lower the size up to which a plan goes whole,
# never raise it; 0: every plan by reference (how an end-to-end test exercises references
# with a few pods). Readers take either form whatever it is.
INLINE_ENV = "CEASELESS_PLAN_INLINE_BYTES"


def inline_limit() -> int:
    try:
        return max(0, min(INLINE_PLAN_BYTES, int(os.environ.get(INLINE_ENV, INLINE_PLAN_BYTES))))
    except ValueError:
        return INLINE_PLAN_BYTES


class PlanUnreadable(ValueError):
    """A referenced plan whose parts are missing, or do not add up to its digest."""


def encode(plan: Plan) -> bytes:
    """The canonical encoding: members and shares in rank order."""
    if all(m.rank == i for i, m in enumerate(plan.members)) \
            and all(r == i for i, r in enumerate(plan.shares)):
        return plan.model_dump_json().encode()
    return plan.model_copy(update={"members": sorted(plan.members, key=lambda m: m.rank),
                                   "shares": dict(sorted(plan.shares.items()))}
                           ).model_dump_json().encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(plan: Plan) -> str:
    """SHA-256 of ``encode(plan)``, kept on the instance (O(N) once: a follower compares it
    at every poll). Keyed on the instance's id: ``model_copy`` copies ``__dict__``, and a
    copy may differ."""
    got = plan.__dict__.get("_wire_digest")
    if got is None or got[0] != id(plan):
        got = (id(plan), sha256(encode(plan)))
        plan.__dict__["_wire_digest"] = got
    return got[1]


def same(msg: Plan | PlanRef, plan: Plan | None) -> bool:
    """Does ``msg`` (whole or a reference) describe ``plan``?"""
    if plan is None:
        return False
    if isinstance(msg, Plan):
        return msg == plan
    return msg.generation == plan.generation and msg.digest == digest_of(plan)


# ----------------------------------------------------------------------------- writing
def for_wire(plan: Plan, base: Plan | None) -> tuple[Plan | PlanRef, list[bytes]]:
    """What to write to KV ``plan`` and publish for ``plan``, and the parts to store first
    (none for a plan sent whole). ``base``: the plan it replaces (its change is computed
    against it)."""
    data = encode(plan)
    if len(data) <= inline_limit():
        return plan, []
    digest = sha256(data)
    plan.__dict__["_wire_digest"] = (id(plan), digest)
    parts = [data[i:i + PLAN_PART_BYTES] for i in range(0, len(data), PLAN_PART_BYTES)]
    ref = PlanRef(generation=plan.generation, world_size=plan.world_size, term=plan.term,
                  ts=plan.ts, digest=digest, size=len(data), parts=len(parts))
    change = change_from(base, plan)
    if change is not None:
        with_change = ref.model_copy(update={"change": change})
        # a change no larger than a plan sent whole, else the parts are read
        if len(with_change.model_dump_json()) <= INLINE_PLAN_BYTES:
            ref = with_change
    return ref, parts


def change_from(base: Plan | None, new: Plan) -> PlanChange | None:
    """``new`` as a change from ``base`` (None: no base, or a change over ``MAX_CHANGE``)."""
    if base is None or base.generation >= new.generation:
        return None
    fields = new.model_dump(mode="json", include=set(PLAN_SCALARS))
    old = base.model_dump(mode="json", include=set(PLAN_SCALARS))
    members = [m for m in new.members if base.pod_of(m.rank) != m.pod]
    shares = {r: s for r, s in new.shares.items() if base.shares.get(r) != s}
    spares = None if new.spares == base.spares else new.spares
    fenced = None if new.fenced == base.fenced else new.fenced
    if max(len(members), len(shares), len(spares or ()), len(fenced or ())) > MAX_CHANGE:
        return None
    return PlanChange(base_generation=base.generation, base_digest=digest_of(base),
                      fields={k: v for k, v in fields.items() if old.get(k) != v},
                      members=members, shares=shares, spares=spares, fenced=fenced)


async def put_parts(kv: Any, ref: PlanRef, parts: list[bytes]) -> None:
    """Store a referenced plan's parts (before the reference is written)."""
    await asyncio.gather(*(kv.put(plan_part_key(ref.digest, i), p) for i, p in enumerate(parts)))


async def sweep_parts(kv: Any, js: Any, bucket: str, keep: set[str]) -> set[str]:
    """Remove the parts of every plan but those with a digest in ``keep`` (the current plan
    and the one before it: a reader may still be reading that). Purged from the bucket's
    stream by subject, not deleted: a delete marker would stay per old part. Returns the
    digests whose parts are left."""
    present = {k.split(".")[1] for k in await part_keys(kv) if k.count(".") == 2}
    for digest in present - keep:
        await js.purge_stream(f"KV_{bucket}",
                              subject=f"$KV.{bucket}.{PLAN_PARTS_PREFIX}.{digest}.>")
    return present & keep


async def part_keys(kv: Any) -> list[str]:
    """The stored parts' keys, filtered by the server (nats-py's ``keys(filters=)`` reads
    every key of the bucket and matches substrings)."""
    w = await kv.watch(f"{PLAN_PARTS_PREFIX}.>", ignore_deletes=True, meta_only=True)
    keys = []
    try:
        async for entry in w:
            if entry is None:  # the end of what is stored
                break
            keys.append(entry.key)
    finally:
        await w.stop()
    return keys


# ----------------------------------------------------------------------------- reading
def apply_change(base: Plan | None, ref: PlanRef) -> Plan | None:
    """The plan ``ref`` names, built from ``base`` and the ref's change; None when there is
    no change, ``base`` is not its base, or the result does not validate or has another
    digest (then the parts are read)."""
    c = ref.change
    if c is None or base is None or base.generation != c.base_generation \
            or digest_of(base) != c.base_digest:
        return None
    ws = int(c.fields.get("world_size", base.world_size))  # type: ignore[arg-type]
    # the base's Member objects are reused (validated once): only the change's are new
    members: list[Any] = [None] * ws
    shares: list[int | None] = [None] * ws
    for m in base.members:
        if m.rank < ws:
            members[m.rank] = m
    for r, s in base.shares.items():
        if r < ws:
            shares[r] = s
    try:
        for m in c.members:
            members[m.rank] = m
        for r, s in c.shares.items():
            shares[r] = s
    except IndexError:  # a rank past the new world size
        return None
    obj = base.model_dump(mode="json", exclude=set(PLAN_LISTS))
    obj.update(c.fields)
    obj["members"] = members
    obj["shares"] = dict(enumerate(shares))
    obj["spares"] = base.spares if c.spares is None else c.spares
    obj["fenced"] = base.fenced if c.fenced is None else c.fenced
    try:
        plan = Plan.model_validate(obj)
    except (ValidationError, ValueError):  # a rank left unnamed, or an inconsistent result
        return None
    # built in rank order: canonical as it is
    plan.__dict__["_wire_digest"] = (id(plan), sha256(plan.model_dump_json().encode()))
    return plan if digest_of(plan) == ref.digest else None


READ_TRIES = 3  # a replica answering a direct get may not have the newest parts yet


async def fetch(kv: Any, ref: PlanRef) -> Plan:
    """Read a referenced plan's parts; PlanUnreadable when one is missing or they do not
    make the plan the reference names."""
    for attempt in range(READ_TRIES):
        try:
            entries = await asyncio.gather(*(kv.get(plan_part_key(ref.digest, i))
                                             for i in range(ref.parts)))
            break
        except Exception as e:  # a part purged (a newer plan came) or not replicated yet
            if attempt + 1 == READ_TRIES:
                raise PlanUnreadable(f"plan generation {ref.generation}: a part is missing "
                                     f"({e.__class__.__name__})") from None
            await asyncio.sleep(0.1 * (attempt + 1))
    data = b"".join(e.value or b"" for e in entries)
    if len(data) != ref.size or sha256(data) != ref.digest:
        raise PlanUnreadable(f"plan generation {ref.generation}: its parts are {len(data)} "
                             f"bytes with another digest than the reference's")
    try:
        plan = decode(Plan, data, "kv.plan_parts", max_bytes=ref.size)
    except DropError as e:
        raise PlanUnreadable(f"plan generation {ref.generation}: {e}") from None
    if plan.generation != ref.generation:
        raise PlanUnreadable(f"parts of generation {plan.generation}, not {ref.generation}")
    plan.__dict__["_wire_digest"] = (id(plan), ref.digest)
    return plan


async def resolve(kv: Any, msg: Plan | PlanRef, held: Plan | None) -> Plan:
    """The plan ``msg`` carries or names: ``held`` itself when it is that plan, else built
    from ``held`` by the change, else read from the parts (PlanUnreadable)."""
    if isinstance(msg, Plan):
        return msg
    if same(msg, held):
        return held  # type: ignore[return-value]
    plan = apply_change(held, msg)
    return plan if plan is not None else await fetch(kv, msg)


async def read_value(kv: Any, raw: bytes, held: Plan | None, what: str = "kv.plan") -> Plan:
    """The plan a KV ``plan`` value stands for (DropError / PlanUnreadable: bad input)."""
    return await resolve(kv, decode(PLAN_MODELS, raw, what), held)


__all__ = ["PLAN_KEY", "PLAN_MODELS", "PlanUnreadable", "apply_change", "change_from",
           "digest_of", "encode", "fetch", "for_wire", "part_keys", "put_parts", "read_value",
           "resolve",
           "same", "sweep_parts"]
