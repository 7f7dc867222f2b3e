"""Issue 41 item 8: the wire as an outside client meets it, through `ceaseless schemas export`.

(a) The exported schemas and the subscribers agree on ``schema_version``: required in both
(the bus drops a payload without it: a version is never assumed). (c) The export covers every
subject (``health`` and ``job_failed`` were missing) and the replies of the request/reply
subjects (the actuator's, a service's status endpoint), and a live service's status validates
against its schema."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from schemas import Subjects
from schemas.messages import BY_KIND, ActuatorReply, JobFailed
from plumbing.bus import DropError, decode
from harness import REPO

from test_bad_input import _valid_samples


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """What `ceaseless schemas export DIR` writes (the real command)."""
    out = tmp_path_factory.mktemp("schemas")
    subprocess.run([sys.executable, "-m", "ops.cli", "schemas", "export", str(out)], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    index = json.loads((out / "index.json").read_text())
    return index, {k: json.loads((out / f).read_text()) for k, f in index["schemas"].items()}


def _samples() -> dict:
    out = _valid_samples("w0")
    out["job_failed"] = JobFailed(kind="script_error", step=3, generation=2, pods=["w0", "w1"],
                                  error="ValueError: x")
    return out


def test_a_payload_without_schema_version_is_refused_by_the_schema_as_by_the_bus(exported):
    """The issue's case: ``{"action":"kill","rank":1}`` validated against the exported schema
    (``schema_version`` optional, default 1) and every subscriber dropped it."""
    _, schemas = exported
    s = Subjects("demo")
    bare = {"action": "kill", "rank": 1}
    with pytest.raises(jsonschema.ValidationError, match="schema_version"):
        jsonschema.validate(bare, schemas["inject"])
    with pytest.raises(DropError, match="schema_version None"):
        decode(BY_KIND["inject"], json.dumps(bare).encode(), s.inject)
    ok = {"schema_version": 1, **bare}
    jsonschema.validate(ok, schemas["inject"])
    assert decode(BY_KIND["inject"], json.dumps(ok).encode(), s.inject).rank == 1


def test_every_message_kind_agrees_with_its_subscribers(exported):
    """For every kind: what our publishers send validates against the exported schema and is
    decoded; without ``schema_version`` both refuse it."""
    _, schemas = exported
    samples = _samples()
    assert set(samples) == set(BY_KIND)
    s = Subjects("demo")
    for kind, msg in samples.items():
        assert schemas[kind]["required"][0] == "schema_version", kind
        payload = json.loads(msg.model_dump_json())
        jsonschema.validate(payload, schemas[kind])
        subject = s.of_kind(kind, "w0")
        decode(BY_KIND[kind], json.dumps(payload).encode(), subject)
        payload.pop("schema_version")
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(payload, schemas[kind])
        with pytest.raises(DropError):
            decode(BY_KIND[kind], json.dumps(payload).encode(), subject)


def test_the_index_names_every_subject_and_every_reply(exported):
    index, schemas = exported
    t = Subjects.template()
    assert index["subjects"]["health"] == "ceaseless.<job>.health"
    assert index["subjects"]["job_failed"] == "ceaseless.<job>.job_failed"
    assert index["subjects"]["heartbeat"] == "ceaseless.<job>.heartbeat.<pod>"
    assert set(BY_KIND) <= set(index["subjects"]) and set(index["schemas"]) == set(schemas)
    # every subject the job uses (the audit stream's, heartbeats, health) is in the index
    used = {*t.audit_subjects(), t.heartbeat(), t.health, t.actuator}
    named = {v.replace("<pod>", "*") for v in index["subjects"].values()}
    assert used <= named, used - named
    assert index["replies"] == {"actuator": "actuator_reply", "service_status": "service_status"}
    assert index["subjects"]["service_status"] == "ceaseless.<job>.svc.<service>.status"
    jsonschema.validate(json.loads(ActuatorReply(ok=True, pods=["s3"]).model_dump_json()),
                        schemas["actuator_reply"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"ok": True}, schemas["actuator_reply"])  # no schema_version


async def test_every_live_services_status_validates_against_the_exported_schema(
        exported, bus, nats_server):
    from plumbing.bus import Bus
    from services.health_monitor import HealthMonitor
    from services.scaler import Scaler
    from services.state_broker import StateBroker

    _, schemas = exported
    for cls in (Scaler, HealthMonitor, StateBroker):
        b = await Bus.connect(nats_server.url, "test", cls.name, nats_server.creds)
        svc = cls(b, workers=1) if cls is Scaler else cls(b)
        await svc.start()
        await svc.register_micro()
        try:
            reply = await bus.nc.request(bus.subjects.service_status(cls.name), b"", timeout=10)
            body = json.loads(reply.data)
            jsonschema.validate(body, schemas["service_status"])
            assert body["service"] == cls.name and body["job"] == "test", body
            assert "error" not in body, body
        finally:
            await svc.stop()
            await b.close()
