"""Issue 45: a plan of any job size on the bus. A plan names every member: 2.5 MiB at 65,536,
over nats-server's 1 MiB max payload, so the scaler refused to write it. A large plan is now
stored in KV parts and named by a small ``PlanRef`` (schema_version 2) carrying the change
from the previous generation: an agent holding that plan applies it, any other reads the
parts. Against a real nats-server; no mocks."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from plumbing import logs
from plumbing.bus import DropError, decode
from plumbing.plan_wire import (PLAN_MODELS, PlanUnreadable, apply_change, digest_of, encode,
                                for_wire, part_keys, resolve)
from schemas import MAX_PAYLOAD_BYTES, PLAN_KEY, plan_part_key
from schemas.messages import (INLINE_PLAN_BYTES, MAX_MEMBERS, Member, Plan, PlanRef)
from services.common.plans import PlanFollower, load_plan
from services.scaler.writer import PlanWriter

log = logs.get("test")


def make(gen: int, n: int, pods: dict[int, str] | None = None, fenced: tuple[str, ...] = (),
         spares: tuple[str, ...] = ("s0", "s1")) -> Plan:
    pods = pods or {}
    return Plan(generation=gen, members=[Member(pod=pods.get(i, f"w{i}"), rank=i)
                                         for i in range(n)],
                world_size=n, global_batch_size=n, micro_batch_size=1,
                shares={i: 1 for i in range(n)},
                spares=[s for s in spares if s not in pods.values()], fenced=list(fenced),
                reason=f"generation {gen}", term=1, ts=time.time())


async def _writer(bus) -> PlanWriter:
    plans = PlanFollower(bus, log, poll_interval=0)
    await plans.start(subscribe=False)
    w = PlanWriter(bus, plans, log)
    w.kv = plans.kv
    return w


async def _write(w: PlanWriter, p: Plan) -> None:
    assert await w.write(p, w.plans.revision, [], lambda: None)


async def _part_digests(kv) -> set[str]:
    return {k.split(".")[1] for k in await part_keys(kv)}


async def test_a_65536_member_plan_is_written_published_and_read_by_an_agent(bus):
    """Before: PlanWriter.write raised "plan generation 1 of 65536 members is 2.6 MB, over
    the 1048576 one message may carry". Now the message and KV ``plan`` are a reference of a
    few hundred bytes, and a follower, a fresh reader and an agent's catch-up all get the
    whole plan."""
    from agent.catchup import CatchUp

    n = MAX_MEMBERS
    got: list[PlanRef | Plan] = []

    async def on_msg(m, env):
        got.append(m)

    await bus.subscribe(bus.subjects.plan, PLAN_MODELS, on_msg)
    adopted: list[Plan] = []
    kv = await bus.kv()
    catch = CatchUp(bus, kv, lambda: adopted[-1] if adopted else None,
                    lambda p, ctx: adopted.append(p), None, None)  # type: ignore[arg-type]
    await bus.subscribe(bus.subjects.plan, PLAN_MODELS, catch.on_plan)  # as agent/runtime.py

    w = await _writer(bus)
    p1 = make(1, n)
    assert len(encode(p1)) > MAX_PAYLOAD_BYTES  # what could not be sent
    await _write(w, p1)
    entry = await kv.get(PLAN_KEY)
    assert len(entry.value) < INLINE_PLAN_BYTES
    ref = decode(PLAN_MODELS, entry.value, "kv.plan")
    assert isinstance(ref, PlanRef) and ref.digest == digest_of(p1) and ref.change is None
    fresh, rev, problem = await load_plan(kv)  # a reader that holds nothing
    assert problem == "" and fresh == p1 and rev == entry.revision
    async with asyncio.timeout(30):
        while not (got and adopted):
            await asyncio.sleep(0.05)
    assert isinstance(got[0], PlanRef) and got[0].digest == ref.digest
    assert adopted == [p1]

    # generation 2: a member replaced by a spare: a change of one member, read by nobody's parts
    p2 = make(2, n, pods={7: "s0"}, spares=("s1",), fenced=("w7",))
    await _write(w, p2)
    async with asyncio.timeout(30):
        while len(adopted) < 2:
            await asyncio.sleep(0.05)
    assert adopted[1] == p2 and isinstance(got[1], PlanRef)
    c = got[1].change
    assert c is not None and c.base_digest == digest_of(p1)
    assert c.members == [Member(pod="s0", rank=7)] and c.shares == {}
    assert c.spares == ["s1"] and c.fenced == ["w7"] and set(c.fields) == {"generation",
                                                                              "reason", "ts"}
    assert len(got[1].model_dump_json()) < 2048  # the whole plan was 2.6 MB
    # the plan follower of a service gets it the same way
    assert (await load_plan(kv, p1))[0] == p2


async def test_a_change_is_applied_without_the_parts_and_a_missed_generation_reads_them(bus):
    n = 4096  # over INLINE_PLAN_BYTES: by reference
    kv = await bus.kv()
    w = await _writer(bus)
    p1, p2 = make(1, n), make(2, n, pods={3: "s0"}, fenced=("w3",))
    await _write(w, p1)
    await _write(w, p2)
    ref2 = decode(PLAN_MODELS, (await kv.get(PLAN_KEY)).value)
    assert isinstance(ref2, PlanRef) and ref2.change is not None
    # the parts gone: a holder of generation 1 still gets generation 2, from the change alone
    await bus.js.purge_stream(f"KV_{bus.subjects.kv_bucket}",
                              subject=f"$KV.{bus.subjects.kv_bucket}.{plan_part_key(ref2.digest, 0)}")
    held = Plan.model_validate_json(encode(p1))  # as an agent decoded it
    assert await resolve(kv, ref2, held) == p2
    with pytest.raises(PlanUnreadable, match="part is missing"):
        await resolve(kv, ref2, None)  # a new pod must read the parts
    # generation 3 shrinks the job; an agent that missed generation 2 reads the parts
    p3 = make(3, n - 2, pods={3: "s0"}, fenced=("w3", "w4090", "w4091"))
    await _write(w, p3)
    ref3 = decode(PLAN_MODELS, (await kv.get(PLAN_KEY)).value)
    assert ref3.change is not None and ref3.change.base_generation == 2
    assert apply_change(held, ref3) is None  # not its base
    assert await resolve(kv, ref3, held) == p3
    assert await resolve(kv, ref3, p2) == p3  # from the change
    # only the current plan's parts and its predecessor's are kept (generation 2's were
    # purged above): generation 1's are gone
    assert await _part_digests(kv) == {digest_of(p3)}


async def test_parts_that_do_not_make_the_plan_are_refused_and_the_last_good_plan_stays(bus):
    n = 4096
    kv = await bus.kv()
    w = await _writer(bus)
    p1 = make(1, n)
    await _write(w, p1)
    follower = PlanFollower(bus, log, poll_interval=0)
    await follower.start(subscribe=False)
    assert follower.plan == p1
    p2 = make(2, n, pods={0: "s0"})
    ref, parts = for_wire(p2, None)
    assert isinstance(ref, PlanRef) and len(parts) == 1
    await kv.put(plan_part_key(ref.digest, 0), parts[0].replace(b'"s0"', b'"s9"'))
    await kv.put(PLAN_KEY, ref.model_dump_json().encode())
    plan, _, problem = await load_plan(kv)
    assert plan is None and "digest" in problem
    assert not await follower.refresh() and follower.plan == p1 and "digest" in follower.problem
    # a change that does not produce the digest it names falls back to the parts
    forged = ref.model_copy(update={"change": for_wire(p2, p1)[0].change.model_copy(  # type: ignore[union-attr]
        update={"members": [Member(pod="s7", rank=0)]})})
    assert apply_change(p1, forged) is None


def test_a_small_plan_goes_whole_and_an_older_reader_drops_a_reference_with_the_reason():
    small = make(1, 4)
    wire, parts = for_wire(small, None)
    assert wire is small and parts == []  # the wire of every plan that fits: unchanged
    ref, _ = for_wire(make(2, 4096), make(1, 4096))
    raw = ref.model_dump_json().encode()
    with pytest.raises(DropError, match="schema_version 2 is not 1"):
        decode(Plan, raw, "ceaseless.test.plan")  # what a reader of schema_version 1 does
    assert json.loads(raw)["schema_version"] == 2
    with pytest.raises(DropError, match="is not 1 or 2"):
        decode(PLAN_MODELS, raw.replace(b'"schema_version":2', b'"schema_version":3'))
    with pytest.raises(ValueError, match="parts"):
        PlanRef.model_validate({**json.loads(raw), "parts": ref.parts + 1})


async def test_the_scalers_environment_may_send_every_plan_by_reference(bus, monkeypatch):
    """CEASELESS_PLAN_INLINE_BYTES=0 (what the end-to-end check of references sets for the
    scaler): a plan of two members goes by reference; a value above the default is capped."""
    from plumbing.plan_wire import INLINE_ENV, inline_limit

    monkeypatch.setenv(INLINE_ENV, str(10 * INLINE_PLAN_BYTES))
    assert inline_limit() == INLINE_PLAN_BYTES
    monkeypatch.setenv(INLINE_ENV, "0")
    kv = await bus.kv()
    w = await _writer(bus)
    p1, p2 = make(1, 2), make(2, 2, pods={1: "s0"})
    await _write(w, p1)
    await _write(w, p2)
    ref = decode(PLAN_MODELS, (await kv.get(PLAN_KEY)).value)
    assert isinstance(ref, PlanRef) and ref.change is not None
    assert apply_change(p1, ref) == p2 and (await load_plan(kv))[0] == p2
