"""Smoke tests of the benchmarks: each runs on a tiny setting and produces its JSON, table and
plot. The benchmarks themselves are not part of the test suite (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.launcher import _ours

REPO = Path(__file__).resolve().parent.parent
# Each smoke test is meant to finish in under 30 s on an idle 2-core machine; on a loaded one,
# CEASELESS_SMOKE_SCALE=3 gives every limit three times the time.
SCALE = float(os.environ.get("CEASELESS_SMOKE_SCALE", "1"))
LIMIT = 30 * SCALE


def _cleanup(proc: subprocess.Popen, work: Path) -> None:
    """By PID only: the bench's own process group, the torchrun sessions it recorded
    (``torchrun.pid``), the processes `ceaseless up` recorded (``pids.txt``) and the
    helper processes the benches record (``*.pids``)."""
    try:  # the bench and whatever it started in its own process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for f in work.rglob("torchrun.pid"):
        try:
            os.killpg(int(f.read_text().split()[0]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    for f in work.rglob("commits/*.txt"):  # torchrun's workers: their own sessions
        for line in f.read_text().splitlines()[:1]:
            if line.startswith("# pid ") and _ours(int(line.split()[2]), str(work)):
                try:
                    os.kill(int(line.split()[2]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    for f in [*work.rglob("pids.txt"), *work.rglob("*.pids")]:
        for line in f.read_text().splitlines():
            parts = line.split()  # pids.txt: "name pid start"; *.pids: "... pid"
            try:
                pid = int(parts[1] if f.name == "pids.txt" else parts[-1])
            except (ValueError, IndexError):
                continue
            start = parts[2] if f.name == "pids.txt" and len(parts) > 2 else None
            if f.suffix == ".pids" or _ours(pid, str(work), None if start == "-" else start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def run_bench(tmp_path: Path, args: list[str], timeout: float) -> dict:
    work = tmp_path / "work"
    work.mkdir()
    out_json = tmp_path / "res.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CEASELESS_BENCH_MARKER": str(work)}
    cmd = [sys.executable, "-m", "ops.cli", "bench", *args, "--work-dir", str(work),
           "--json", str(out_json), "--svg", str(tmp_path / "plot.svg")]
    log = open(tmp_path / "bench.out", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _cleanup(proc, work)
    out = (tmp_path / "bench.out").read_text()
    assert proc.returncode == 0, out[-4000:]
    svg = (tmp_path / "plot.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    res = json.loads(out_json.read_text())
    assert "## " in out  # the markdown table was printed
    return res


@pytest.mark.timeout(60 * SCALE)  # a torchrun restart from a checkpoint: 24 s in a CI run
def test_recovery_checkpoint_restart_baseline(tmp_path):
    res = run_bench(tmp_path, ["recovery", "--systems", "ckpt4", "--scenarios", "kill",
                               "--model", "tiny", "--workers", "2", "--steps", "10",
                               "--repeats", "1", "--corpus-tokens", "50000"], timeout=55 * SCALE)
    (run,) = res["runs"]
    assert run["system"] == "ckpt4" and run["restarts"] >= 1
    assert run["back_at_step_s"] >= run["downtime_s"] > 0
    # restored from the last checkpoint before the kill; the steps after it were redone
    assert run["restored_step"] % 4 == 3 or run["restored_step"] == -1
    assert run["recomputed_steps"] == run["pre_kill_step"] - run["restored_step"]
    assert run["final_step"] == 9


@pytest.mark.timeout(60 * SCALE)
def test_recovery_ceaseless_with_ratio(tmp_path):
    res = run_bench(tmp_path, ["recovery", "--systems", "ceaseless", "--scenarios", "kill",
                               "--model", "tiny", "--workers", "2", "--spares", "1",
                               # the tiny model does up to ~50 steps/s here: a short run
                               # can end before a 0.25 s heartbeat shows the fault step
                               "--steps", "200", "--repeats", "1"], timeout=50 * SCALE)
    (run,) = res["runs"]
    assert run["system"] == "ceaseless" and run["lost_steps"] == 0
    assert res["summary"]["kill"]["downtime_s"]["n"] == 1


@pytest.mark.timeout(LIMIT)
@pytest.mark.parametrize("system", ["torchft1000", "torchft1000pg"])
def test_recovery_torchft_baseline(tmp_path, system):
    """torchft1000: the killed replica is not replaced; torchft1000pg: it is restarted and
    heals over torchft's PGTransport (with a tiny model the survivors may finish before it
    joins: then it is reported as not healed)."""
    pytest.importorskip("torchft", reason="torchft-nightly is optional (pip install .[bench])")
    res = run_bench(tmp_path, ["recovery", "--systems", system, "--scenarios", "kill",
                               "--model", "tiny", "--workers", "2", "--steps", "10",
                               "--repeats", "1", "--corpus-tokens", "50000"], timeout=27 * SCALE)
    (run,) = res["runs"]
    assert run["system"] == system and run["recomputed_steps"] == 0
    assert run["kill_to_step_s"] > 0 and run["final_step"] == 9
    if system.endswith("pg"):
        assert run["replaced"] == "pg" and (run["heal_s"] is None or run["heal_s"] > 0)
        assert res["summary"][system]["runs"] == 1


def test_recovery_system_names():
    import argparse

    from bench import recovery

    ns = argparse.Namespace(scenarios="kill", systems="ceaseless,ckpt20,torchft1000,"
                            "torchft5000http,torchft1000pg")
    systems, _ = recovery.parse_systems(ns)
    assert [recovery.torchft_transport(s) for s in systems[2:]] == [None, "http", "pg"]
    assert recovery.torchft_hb("torchft5000http") == 5000
    assert "PG transport" in recovery.label("torchft1000pg")
    for bad in ("torchft1000tcp", "torchfthttp", "ckpt"):
        with pytest.raises(SystemExit, match="unknown system"):
            recovery.parse_systems(argparse.Namespace(scenarios="kill", systems=bad))


def test_recovery_ratio_and_table_from_runs():
    """The ratio and the table, from made-up runs (no processes)."""
    import argparse

    from bench import recovery

    systems, scenarios = ["ceaseless", "ckpt20"], ["kill"]
    runs = []
    for r, (c, b) in enumerate([(0.3, 6.0), (0.4, 8.0), (0.5, 5.0)]):
        runs.append({"system": "ceaseless", "scenario": "kill", "repeat": r, "downtime_s": c,
                     "kill_to_step_s": c + 0.1, "back_at_step_s": c + 0.1, "lost_steps": 0,
                     "median_step_s": 0.25, "phases": {"detect": 2.0}})
        runs.append({"system": "ckpt20", "scenario": "kill", "repeat": r, "downtime_s": b - 1,
                     "back_at_step_s": b, "gap_s": b - 1.2, "recomputed_steps": 7,
                     "median_step_s": 0.25, "phases_s": {"respawn": 0.5}})
    agg = recovery.aggregate(runs, systems, scenarios)
    ratio = agg["ckpt20"]["ratio_ceaseless_downtime_to_back_at_step"]["kill"]
    assert ratio["of_medians"] == pytest.approx(0.4 / 6.0)
    assert ratio["per_repeat"]["median"] == pytest.approx(0.05)
    p = argparse.ArgumentParser()
    recovery.add_arguments(p)
    cfg = vars(p.parse_args(["--systems", "ceaseless,ckpt20", "--scenarios", "kill"]))
    res = {"config": cfg | {"command": "x"}, "summary": agg,
           "machine": {"date": "d", "cpu": "c", "cores": 2, "platform": "p", "python": "3",
                       "torch": "t"}}
    md = recovery.markdown(res)
    assert "0.067" in md and "torch.save every 20 steps" in md
    assert recovery.plot(res).startswith("<svg")


@pytest.mark.timeout(LIMIT)
def test_control_plane(tmp_path):
    res = run_bench(tmp_path, ["control-plane", "--agents", "24", "--procs", "1", "--rounds",
                               "1", "--silences", "2", "--fault-timeout", "1.0"], timeout=26 * SCALE)
    (run,) = res["runs"]
    assert run["agents"] == 24 and len(run["silences"]) == 2
    assert all(s["kind"] in ("lost", "hang") for s in run["silences"])
    # detected no earlier than the fault timeout after the last heartbeat
    assert 0.9 <= run["detect_p50_s"] < 10
    assert run["plan_delivery"]["n"] >= 1
    assert run["cpu_core_fraction"]["health_monitor"] is not None
    assert run["rss_bytes"]["health_monitor"] > 0 and run["rss_bytes"]["nats-server"] > 0


def test_control_plane_heartbeat_template():
    """The simulated agents' heartbeat, built once and filled in per beat, decodes to what
    the model builds (step, ts, a waiting pod's -1); a template without the stand-ins is
    refused, not sent wrong."""
    from bench.control_plane import _STEP_MARK, _TS_MARK, fill_template
    from plumbing.bus import decode
    from schemas.messages import AgentState, Heartbeat, Role

    for rank, state, step in ((3, AgentState.training, 41), (None, AgentState.waiting, -1)):
        hb = Heartbeat(pod="w3", role=Role.worker, generation=2, rank=rank, step=_STEP_MARK,
                       ts=_TS_MARK, pid=7, state=state)
        t = fill_template(hb.model_dump_json(by_alias=True))
        got = decode(Heartbeat, (t % (step, 1796625955.5240784)).encode(),
                     "ceaseless.j.heartbeat.w3")
        assert got == hb.model_copy(update={"step": step, "ts": 1796625955.5240784})
    with pytest.raises(ValueError, match="step/ts not found"):
        fill_template('{"step":1,"ts":2.0}')


@pytest.mark.timeout(LIMIT)
def test_init(tmp_path):
    res = run_bench(tmp_path, ["init", "--world-sizes", "2", "--repeats", "1",
                               "--generations", "2"], timeout=26 * SCALE)
    assert {(r["world"], r["kind"]) for r in res["runs"]} == {(2, "nats"), (2, "tcp")}
    for r in res["runs"]:
        assert 0 < r["create_s"] < 20 and len(r["rebuild_s"]) == 1
    assert res["summary"]["2"]["ratio_create_nats_tcp"] > 0


@pytest.mark.timeout(60 * SCALE)
def test_goodput_ceaseless(tmp_path):
    t = time.monotonic()
    res = run_bench(tmp_path, ["goodput", "--systems", "ceaseless", "--model", "tiny",
                               "--workers", "2", "--duration", "9", "--fault-every", "4.5",
                               "--corpus-tokens", "50000"], timeout=55 * SCALE)
    (run,) = res["runs"]
    assert run["system"] == "ceaseless" and run["faults"] >= 1
    # goodput is steps x a median step time / wall time: on a shared 2-core machine the
    # median can undershoot a little; a value far above 1 would be a counting bug
    assert 0 < run["goodput"] <= 1.15
    assert run["lost_steps"] == 0 and run["recomputed_steps"] == 0
    assert run["steps_committed"] > 0 and run["median_step_s"] > 0
    assert res["summary"]["ceaseless"]["goodput"]["n"] == 1
    print(f"goodput smoke: {time.monotonic() - t:.1f}s, {run}")


def test_goodput_analysis():
    """Steps committed, recomputed steps and goodput from made-up commit logs."""
    from bench import goodput

    # attempt 0: steps 0..29, 1 s each; a fault at 29.5 s; attempt 1 restored step 19 and
    # commits 20.. from 40 s
    a0 = [(float(s), s, 0) for s in range(30)]
    a1 = [(40.0 + i, 20 + i, 1) for i in range(30)]
    r = goodput.analyse([a0 + a1, a0 + a1], 3.0, 60.0, [29.5])
    assert (r["start_step"], r["final_step"], r["recomputed_steps"]) == (3, 40, 10)
    assert r["median_step_s"] == 1.0 and r["goodput"] == pytest.approx(37 / 57)
    # still restarting at the end: the job holds only its last checkpoint
    r = goodput.analyse([a0], 3.0, 35.0, [29.5], lost_state=lambda s: (s + 1) // 20 * 20 - 1)
    assert r["final_step"] == 19 and r["goodput"] == pytest.approx(16 / 32)
    runs = [{"system": "ceaseless", "repeat": 0, "goodput": 0.9, "faults": 2,
             "steps_committed": 90, "recomputed_steps": 0, "median_step_s": 0.2,
             "lost_steps": 0, "wall_s": 40},
            {"system": "ckpt20", "repeat": 0, "goodput": 0.45, "faults": 2,
             "steps_committed": 45, "recomputed_steps": 12, "median_step_s": 0.2,
             "wall_s": 50}]
    agg = goodput.aggregate(runs, ["ceaseless", "ckpt20"])
    assert agg["ceaseless"]["ratio_to_baseline"]["of_medians"] == pytest.approx(2.0)
    import argparse

    p = argparse.ArgumentParser()
    goodput.add_arguments(p)
    cfg = vars(p.parse_args([]))
    res = {"config": cfg | {"command": "x", "systems_run": "ceaseless,ckpt20",
                            "faults_per_run": 3}, "summary": agg, "skipped": {},
           "machine": {"date": "d", "cpu": "c", "cores": 2, "platform": "p", "python": "3",
                       "torch": "t"}}
    md = goodput.markdown(res)
    assert md.startswith("## Goodput") and "2.00" in md and "torch.save every 20 steps" in md
    assert goodput.plot(res).startswith("<svg")


def test_size_analysis_and_the_link():
    """``bench size``: the ratios per role from made-up runs, and the link measures."""
    from bench import size

    G = 10**9
    plain = {"peak_rss": 2 * G}
    ref = {"param_sha256": "abc", "median_step_s": 0.1}
    join = {"members": ["w0", "w1"], "before": {"w0": 2.2 * G, "w1": 2.1 * G},
            "after": {"w0": 2.31 * G, "w1": 2.1 * G, "w2": 2.0 * G}, "joiner": "w2",
            "recoveries": [{"pod": "w2", "bytes_received": 1.5 * G, "downtime": None,
                            "phases": {"state_sync": 1.0}},
                           {"pod": "w0", "bytes_received": 0, "downtime": 1.2,
                            "phases": {"state_sync": 1.0}}]}
    kill = {"members": ["w0", "w1"], "before": {"w0": 3 * G, "w1": 2 * G, "s0": 2.5 * G},
            "after": {"w1": 2 * G, "s0": 2.6 * G}, "spare": "s0", "param_sha256": "abc",
            "lost_steps": 0, "recoveries": [{"pod": "s0", "downtime": 0.3, "phases": {}}],
            "spare_step_at_kill": 5, "rank0_step_at_kill": 6}
    r = size.analyse("124m", plain, ref, join, kill, {"tcp_gbs": 3.0, "memcpy_gbs": 10.0})
    assert r["member_growth_on_join"] == {"w0": pytest.approx(1.05), "w1": 1.0}
    assert r["joiner_vs_member"] == pytest.approx(2.0 / 2.2)
    assert r["transfer_gbs"] == pytest.approx(1.5) and r["transfer_vs_link"] == pytest.approx(0.5)
    assert r["rank0_with_spare_vs_plain"] == pytest.approx(1.5) and r["kill0_bitwise"]
    assert r["join_pause_s"] == pytest.approx(1.1) and r["kill0_downtime_s"] == pytest.approx(0.2)
    assert not size.analyse("124m", plain, {"param_sha256": "x"}, join, kill,
                            {"tcp_gbs": 3.0, "memcpy_gbs": 10.0})["kill0_bitwise"]
    assert size.tcp_gbs(8 * 2**20, 2) > 0 and size.memcpy_gbs(8 * 2**20, 2) > 0
    assert size.vm_hwm(os.getpid()) > 0
    import argparse

    p = argparse.ArgumentParser()
    size.add_arguments(p)
    m = {"date": "d", "cpu": "c", "cores": 2, "platform": "p", "python": "3", "torch": "t"}
    md = size.markdown({"machine": m, "link": {"tcp_gbs": 3.0, "memcpy_gbs": 10.0},
                        "models": [r]}, p.parse_args([]))
    assert md.startswith(size.HEADING) and "| 124m | 2.00 GB |" in md and "bitwise" in md


def test_size_join_first_step_and_the_mlp_shape():
    """``bench size``: the first step after a join against the median steps of the same run
    (before the join, after its first step), and ``--shape mlp`` runs examples/train_mlp."""
    import argparse

    from bench import size

    commits = {"w0": [[0, 0.0], [1, 1.0], [2, 2.0], [3, 6.0], [4, 7.5], [5, 9.0]],
               "w2": [[3, 6.0], [4, 7.5], [5, 9.0]]}
    join = {"median_step_s": 1.0, "joiner": "w2", "commits": commits,
            "recoveries": [{"pod": "w2", "restore_step": 2, "downtime": None,
                            "phases": {"state_sync": 1.5, "first_step": 3.0}},
                           {"pod": "w0", "restore_step": 2, "downtime": 4.0,
                            "phases": {"state_sync": 1.0, "first_step": 2.5}}]}
    f = size.join_figures(join)
    assert f["join_first_step_vs_median"] == pytest.approx(3.0)
    assert f["join_median_before_s"] == pytest.approx(1.0)
    assert f["join_median_after_s"] == pytest.approx(1.5)
    assert f["join_first_step_vs_after"] == pytest.approx(2.0)
    assert f["join_state_sync_s"] == 1.5 and f["join_members_pause_s"] == pytest.approx(3.0)
    assert "3.00x the median" in size.join_line("mlp6x64", f)
    p = argparse.ArgumentParser()
    size.add_arguments(p)
    cmd = size._script(p.parse_args(["--shape", "mlp", "--width", "64", "--depth", "2"]), "x")
    assert cmd[1:3] == ["-m", "examples.train_mlp"] and "64" in cmd


def test_train_mlp_runs_alone():
    """examples/train_mlp (``bench size --shape mlp``) trains in one process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    out = subprocess.run([sys.executable, "-m", "examples.train_mlp", "--width", "32",
                          "--depth", "2", "--steps", "2"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mlp 2 x 32" in out.stdout and "step     1" in out.stdout
