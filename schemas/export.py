"""The wire contract as JSON Schema (``ceaseless schemas export``): what an outside client
validates against. One schema per published message kind (``BY_KIND``) and per reply of a
request/reply subject (``REPLIES``), and an index naming the subject of each."""

from __future__ import annotations

from typing import Any

from .messages import BY_KIND, REPLIES, PlanRef
from .subjects import Subjects

# Later wires of a kind, on its subject beside it (chosen by ``schema_version``): exported
# under their own name, the subject of the kind they stand for.
VERSIONS: dict[str, tuple[type, str]] = {"plan_ref": (PlanRef, "plan")}


def json_schemas() -> dict[str, dict[str, Any]]:
    """Kind -> JSON Schema: every message kind, then every reply (``actuator_reply``,
    ``service_status``)."""
    out = {kind: model.model_json_schema(by_alias=True) for kind, model in sorted(BY_KIND.items())}
    for name, (model, _kind) in sorted(VERSIONS.items()):
        out[name] = model.model_json_schema(by_alias=True)
    for request, model in sorted(REPLIES.items()):
        out[_reply_kind(request)] = model.model_json_schema(by_alias=True)
    return out


def index() -> dict[str, Any]:
    """``subjects``: the subject of every message kind and of every request (``<job>``,
    ``<pod>``, ``<service>`` to fill in); ``replies``: a request's reply schema;
    ``schemas``: the file of each."""
    s = Subjects.template()
    subjects = {kind: s.of_kind(kind, "<pod>") for kind in sorted(BY_KIND)}
    for name, (_model, kind) in VERSIONS.items():
        subjects[name] = s.of_kind(kind, "<pod>")
    subjects["service_status"] = s.service_status("<service>")  # request: an empty payload
    return {
        "subjects": subjects,
        "replies": {request: _reply_kind(request) for request in sorted(REPLIES)},
        "schemas": {kind: f"{kind}.schema.json" for kind in json_schemas()},
    }


def _reply_kind(request: str) -> str:
    return "actuator_reply" if request == "actuator" else request
