"""Peer-to-peer state handoff over a real gloo group: a recipient with a different init and
an unstepped optimizer ends up bitwise equal to the sources, one source or striped over
several; a corrupted chunk is detected and named; a big state arrives intact. The group
matches sends and receives per peer in order, ignoring tags, as NCCL does
(helpers/in_order.py)."""

from __future__ import annotations

import pytest

from helpers.procs import Group, nats_cfg

pytestmark = [pytest.mark.timeout(240)]


def test_state_handoff(nats_server):
    world = 3
    with Group("state", world, dict(nats_cfg(nats_server), mb=32, in_order=True)) as g:
        phases = [g.expect_all("phase", timeout=120) for _ in range(4)]
        timing = g.expect_all("timing", timeout=120)
        g.expect_all("done", timeout=30)
    one, striped, after, corrupt = phases
    recipient = world - 1
    # one source sent its live tensors into the recipient's own (issue 34: no second copy)
    assert one[recipient]["stats"]["in_place_bytes"] > 0, one[recipient]
    assert striped[recipient]["stats"]["in_place_bytes"] == 0, striped[recipient]
    for ph in (one, striped):
        hashes = {m["hash"] for m in ph}
        assert len(hashes) == 1, ph  # recipient == every source, bitwise, incl. optimizer
        st = ph[recipient]["stats"]
        assert st["extra"] == {"step": 2, "loss": 0.25}, st
        assert st["same_ids"], st  # parameters restored in place: optimizer keeps its refs
    # one more identical step from the restored state: still identical everywhere
    assert len({m["hash"] for m in after}) == 1 and len({m["state"] for m in after}) == 1
    bad = corrupt[recipient]["mismatch"]
    assert bad is not None and bad["bad"], corrupt[recipient]
    assert all(m["mismatch"] is None for i, m in enumerate(corrupt) if i != recipient)
    assert all(t["ok"] for t in timing)
    tr = timing[recipient]["timings"]
    for label, t in tr.items():
        assert t["MB"] >= 32, tr
        print(f"\n{label}: {t['MB']:.0f} MB in {t['seconds']:.3f} s "
              f"({t['MB'] / t['seconds']:.0f} MB/s)")
