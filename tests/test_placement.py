"""Where `up --hosts` puts each part (ops/placement.py): a pure function, checked over
every small shape."""

from __future__ import annotations

import itertools

import pytest

from ops.placement import host_for_new_pod, instance_name, place

SERVICES = ["health_monitor", "scaler", "state_broker"]


def test_the_first_host_runs_a_server_every_active_instance_and_rank_0():
    p = place(["h1", "h2", "h3"], 3, SERVICES, 1, 3, 1)
    assert p.servers == ("h1", "h2", "h3")
    assert {p.instances[s] for s in SERVICES} == {"h1"}
    assert {p.instances[f"{s}-s1"] for s in SERVICES} <= {"h2", "h3"}
    assert p.pods == {"w0": "h1", "w1": "h2", "w2": "h3", "s0": "h2"}
    assert p.on("h1") == {"servers": ["s1"], "instances": sorted(SERVICES), "pods": ["w0"]}


def test_every_part_is_placed_once_and_only_the_defaults_are_on_the_first_host():
    for shape in itertools.product(range(1, 5), range(1, 5), range(0, 3), range(1, 5),
                                   range(0, 3)):
        _check(*shape)


def _check(hosts, servers, standbys, workers, spares):
    names = [f"h{i + 1}" for i in range(hosts)]
    p = place(names, servers, SERVICES, standbys, workers, spares)
    assert len(p.servers) == servers and set(p.servers) <= set(names)
    assert set(p.instances) == {instance_name(s, i) for s in SERVICES
                                for i in range(standbys + 1)}
    assert set(p.pods) == {f"w{r}" for r in range(workers)} | {f"s{k}" for k in range(spares)}
    assert set(p.instances.values()) | set(p.pods.values()) <= set(names)
    assert p.servers[0] == p.pods["w0"] == names[0]
    if hosts > 1:
        # nothing else on the first host: losing it loses one of each, no standby, no spare
        assert p.servers.count(names[0]) == 1
        assert p.on(names[0])["instances"] == sorted(SERVICES)
        assert p.on(names[0])["pods"] == ["w0"]
        # a standby is never on its active instance's host
        for s in SERVICES:
            for i in range(1, standbys + 1):
                assert p.instances[instance_name(s, i)] != p.instances[s]
        # each kind spreads: no host has two more of a kind than another (but the first)
        rest = names[1:]
        for kind in (list(p.servers[1:]), [p.pods[f"w{r}"] for r in range(1, workers)],
                     [p.instances[instance_name(s, i)] for s in SERVICES
                      for i in range(1, standbys + 1)]):
            counts = [kind.count(h) for h in rest]
            assert max(counts) - min(counts) <= 1, (kind, rest)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        place([], 1, SERVICES, 0, 1, 0)
    with pytest.raises(ValueError):
        place(["h1"], 0, SERVICES, 0, 1, 0)
    with pytest.raises(ValueError):
        place(["h1"], 1, SERVICES, -1, 1, 0)


def test_a_later_pod_goes_to_the_least_loaded_live_host():
    pods = {"w0": "h1", "w1": "h2", "w2": "h3", "s0": "h2"}
    assert host_for_new_pod(pods, ["h1", "h2", "h3"]) == "h3"  # tie h1/h3: the later one
    assert host_for_new_pod(pods, ["h2", "h3"]) == "h3"
    assert host_for_new_pod(pods, ["h2"]) == "h2"
    assert host_for_new_pod({}, ["h1", "h2"]) == "h2"
    with pytest.raises(ValueError):
        host_for_new_pod(pods, [])


def test_control_hosts_run_the_bus_and_the_services_and_no_pod():
    """`--control-hosts 3` over 5 hosts: h1..h3 each a server and one instance of every
    service (h1's the active ones), the pods over h4 and h5 only, later ones too."""
    names = ["h1", "h2", "h3", "h4", "h5"]
    p = place(names, 3, SERVICES, 2, 3, 1, control=3)
    assert p.servers == ("h1", "h2", "h3")
    assert p.on("h1")["instances"] == sorted(SERVICES)
    assert p.on("h2")["instances"] == sorted(instance_name(s, 1) for s in SERVICES)
    assert p.on("h3")["instances"] == sorted(instance_name(s, 2) for s in SERVICES)
    assert p.pods == {"w0": "h4", "w1": "h5", "w2": "h4", "s0": "h5"}
    assert p.pod_hosts == ("h4", "h5")
    for shape in itertools.product(range(2, 6), range(1, 5), range(0, 3), range(1, 4)):
        hosts, servers, standbys, workers = shape
        for control in range(1, hosts):
            q = place(names[:hosts], servers, SERVICES, standbys, workers, 1, control=control)
            ctl = set(names[:control])
            assert set(q.servers) <= ctl and set(q.instances.values()) <= ctl
            assert set(q.pods.values()) <= set(q.pod_hosts) == set(names[control:hosts])
            assert {q.instances[s] for s in SERVICES} == {"h1"}  # the active ones together
    # the default (0) is the placement of before: pods may go anywhere
    assert place(names, 3, SERVICES, 1, 3, 1).pod_hosts == ()
    for control in (-1, 5, 6):
        with pytest.raises(ValueError):
            place(names, 3, SERVICES, 1, 3, 1, control=control)


def test_a_later_pod_never_goes_to_a_control_host(tmp_path):
    from ops.emulated import HostRun
    from ops.hosts import Hosts

    hosts = Hosts.make(4, namespaces=False)
    run = HostRun(hosts, place(hosts.names(), 3, SERVICES, 0, 1, 0, control=3), tmp_path)
    try:
        assert run.where("w0")[1]["CEASELESS_GLOO_HOSTNAME"] == hosts["h4"].addr
        for k in range(3):  # h4 the only pod host: however loaded, never h1..h3
            assert run.where(f"s{k}")[1]["CEASELESS_GLOO_HOSTNAME"] == hosts["h4"].addr
        from ops.emulated import read_hosts

        assert read_hosts(tmp_path)["pod_hosts"] == ["h4"]
    finally:
        hosts.destroy()


def test_up_refuses_control_hosts_that_leave_no_pod_host(capsys):
    from ops.cli import main

    for argv in (["--control-hosts", "1"], ["--hosts", "3", "--control-hosts", "3"],
                 ["--hosts", "3", "--control-hosts", "-1"]):
        assert main(["up", *argv]) == 2, argv
        assert "--control-hosts" in capsys.readouterr().err
