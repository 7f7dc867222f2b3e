"""compose.yaml, Dockerfile and deploy/: validated without a Docker engine where possible.

* ``docker-compose config`` (Debian's ``docker-compose`` parses and validates without an
  engine) when it is on PATH;
* deploy/nats.conf is generated from services/common/permissions.py (deploy/nats_conf.py):
  one identity per role with the embedded server's permissions, run by the real nats-server
  binary from the venv (passwords from env, JetStream, permissions enforced);
* deploy/entrypoint.sh turns the password into a 0600 credentials file;
* with a reachable Docker engine only: NATS with JetStream in a container via testcontainers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.natsserver import find_binary, free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
NATS_CONF = ROOT / "deploy" / "nats.conf"
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
NATS_SERVERS = ("nats-1", "nats-2", "nats-3")   # compose's NATS cluster
NATS_URLS = ",".join(f"nats://{n}:4222" for n in NATS_SERVERS)
SERVICES = {*NATS_SERVERS, "jaeger", "health_monitor", "scaler", "state_broker", "trainer", "spare"}
PASSWORD = "pTest_only-0123456789abcdef"
ROUTE_PASSWORD = "pRoute_test-0123456789abcdef"
ROLE_OF = {"health_monitor": "health_monitor", "scaler": "scaler", "state_broker": "state_broker",
           "trainer": "agent", "spare": "agent"}

sys.path.insert(0, str(ROOT / "deploy"))
import nats_conf  # noqa: E402

from services.common.permissions import ROLES, role_permissions  # noqa: E402


def _role_passwords() -> dict[str, str]:
    """A distinct test password per role, by env var name."""
    return {nats_conf.password_var(r): f"{PASSWORD}-{r}" for r in ROLES}


def _compose_passwords() -> dict[str, str]:
    """What compose needs: every role's password and the routes' (its NATS cluster)."""
    return {**_role_passwords(), nats_conf.password_var(nats_conf.ROUTE_USER): ROUTE_PASSWORD}


def _compose_cmd() -> list[str] | None:
    exe = shutil.which("docker-compose")
    return [exe] if exe else None


def _compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    env.update(extra)
    return env


needs_compose = pytest.mark.skipif(
    _compose_cmd() is None,
    reason="docker-compose not on PATH (apt-get install -y docker-compose; it validates "
           "compose files without a Docker engine)")


@needs_compose
def test_compose_config_is_valid_and_has_the_services():
    cmd = _compose_cmd() + ["-f", str(COMPOSE)]
    env = _compose_env(**_compose_passwords())
    r = subprocess.run(cmd + ["config", "-q"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["config", "--services"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == SERVICES

    yaml = pytest.importorskip("yaml")
    r = subprocess.run(cmd + ["config"], env=env, capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)["services"]
    routes = {nats_conf.route_var(k + 1): f"nats-route://{nats_conf.ROUTE_USER}:{ROUTE_PASSWORD}"
              f"@{n}:6222" for k, n in enumerate(NATS_SERVERS)}
    for name in NATS_SERVERS:   # three servers of one cluster, each its own name and store
        nats = cfg[name]
        assert re.match(r"nats:2\.(1\d|[2-9]\d)", nats["image"])       # 2.10+
        cmdline = " ".join(nats["command"])
        assert "-js" in cmdline and "-sd /data" in cmdline and f"--name {name}" in cmdline
        assert "/etc/nats/nats-cluster.conf" in cmdline
        assert any(f"{name}-data" in str(v) and ":/data" in str(v) for v in nats["volumes"])
        assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])
        assert nats["environment"] == {**_compose_passwords(), **routes}, name
    assert cfg["jaeger"]["image"].startswith("jaegertracing/all-in-one")
    assert cfg["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any("16686" in str(p) for p in cfg["jaeger"]["ports"])
    for svc in ("health_monitor", "scaler", "state_broker"):
        c = cfg[svc]
        assert c["command"][:3] == ["python", "-m", f"services.{svc}"]
        line = " ".join(c["command"])
        assert f"--nats {NATS_URLS}" in line and "--job demo" in line
        assert c["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert all(c["depends_on"][n]["condition"] == "service_healthy" for n in NATS_SERVERS)
    for svc, role, n in (("trainer", "worker", 4), ("spare", "spare", 1)):
        c = cfg[svc]
        assert c["command"][:3] == ["python", "-m", "examples.train_gpt"]
        assert c["deploy"]["replicas"] == n
        e = c["environment"]
        assert e["CEASELESS_ROLE"] == role and e["CEASELESS_JOB"] == "demo"
        assert e["CEASELESS_NATS_URL"] == NATS_URLS          # every server: failover
        assert "CEASELESS_POD" not in e                  # the agent falls back to HOSTNAME
        assert all(c["depends_on"][n]["condition"] == "service_healthy" for n in NATS_SERVERS)
    # One identity per role: each Ceaseless container gets its own role's user and password
    # only; nats-server gets every role's password (deploy/nats.conf resolves them).
    for svc, role in ROLE_OF.items():
        e = cfg[svc]["environment"]
        assert e["CEASELESS_NATS_USER"] == role, svc
        assert e["CEASELESS_NATS_PASSWORD"] == f"{PASSWORD}-{role}", svc
        assert not any(k.startswith("CEASELESS_NATS_PASSWORD_") for k in e), svc


@needs_compose
def test_compose_refuses_to_run_without_every_role_password():
    for missing in ROLES:
        env = _compose_env(**{k: v for k, v in _compose_passwords().items()
                              if k != nats_conf.password_var(missing)})
        r = subprocess.run(_compose_cmd() + ["-f", str(COMPOSE), "config", "-q"], env=env,
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode != 0, missing
        assert nats_conf.password_var(missing) in r.stderr, r.stderr


@needs_compose
def test_compose_refuses_to_run_without_a_password():
    r = subprocess.run(_compose_cmd() + ["-f", str(COMPOSE), "config", "-q"],
                       env=_compose_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0
    assert "CEASELESS_NATS_PASSWORD_" in r.stderr


def test_nats_conf_is_generated_from_permissions():
    """deploy/nats.conf's identities and permissions are permissions.py's, for job demo."""
    text = NATS_CONF.read_text()
    assert text == nats_conf.render("demo"), "run: python deploy/nats_conf.py conf"
    users = nats_conf.parse_users(text)
    assert list(users) == list(ROLES)
    for role in ROLES:
        assert users[role]["password"] == nats_conf.password_var(role)
        assert users[role]["permissions"] == role_permissions(role, "demo"), role


def test_nats_conf_env_file(tmp_path):
    path = tmp_path / "compose.env"
    nats_conf.write_env(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    vals = dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line and not line.startswith("#"))
    # a password per role, and the routes' own (compose's cluster)
    assert set(vals) == {nats_conf.password_var(r) for r in (*ROLES, nats_conf.ROUTE_USER)}
    assert len(set(vals.values())) == len(ROLES) + 1
    for v in vals.values():   # a bare nats-server config token: starts with a letter
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{31,}", v), v


def test_no_literal_secrets():
    for f in (COMPOSE, NATS_CONF):
        for line in f.read_text().splitlines():
            code = line.split("#", 1)[0]
            m = re.search(r"password\s*[:=]\s*(\S+)", code, re.I)
            if m:
                assert m[1].startswith(("$", "${")), f"{f.name}: literal password in {line!r}"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nats-server exited {proc.returncode}: "
                                 f"{proc.stderr.read().decode()[-500:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening")


@pytest.fixture
def conf_server(tmp_path):
    """deploy/nats.conf, as compose runs it, on free loopback ports."""
    port, mon = free_port(), free_port()
    env = {**os.environ, **_role_passwords()}
    t = subprocess.run([find_binary(), "-c", str(NATS_CONF), "-t"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert t.returncode == 0, t.stderr + t.stdout
    proc = subprocess.Popen(
        [find_binary(), "-c", str(NATS_CONF), "-js", "-sd", str(tmp_path / "js"),
         "-a", "127.0.0.1", "-p", str(port), "-m", str(mon)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc)
        yield port, mon
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def test_nats_conf_roles_from_env_and_jetstream(conf_server):
    """Every role logs in with its own password from the environment; the server enforces
    the roles: an agent's plan and inject are dropped (permissions violation) and it cannot
    write the plan key; the scaler can; a wrong password is refused."""
    import urllib.request

    import nats

    from schemas.subjects import Subjects

    port, mon = conf_server
    url = f"nats://127.0.0.1:{port}"
    s = Subjects("demo")
    with urllib.request.urlopen(f"http://127.0.0.1:{mon}/healthz?js-enabled-only=true",
                                timeout=5) as resp:       # the compose healthcheck
        assert resp.status == 200
    errors: dict[str, list[str]] = {}

    async def conn(role: str, password: str | None = None):
        async def err(e: Exception) -> None:
            errors.setdefault(role, []).append(str(e))

        return await nats.connect(url, user=role, password=password or f"{PASSWORD}-{role}",
                                  connect_timeout=2, allow_reconnect=False, error_cb=err,
                                  name=role)

    clients = {r: await conn(r) for r in ROLES}
    try:
        op, agent, scaler = clients["operator"], clients["agent"], clients["scaler"]
        kv = await op.jetstream().create_key_value(bucket=s.kv_bucket)
        seen: list[str] = []

        async def on(msg):
            seen.append(msg.subject)

        await op.subscribe(s.all, cb=on)
        await op.flush()
        # One round trip each: publishes batched behind a denied one were sometimes lost
        # (about 1 run in 10, with the server reporting only the first violation).
        # allowed. Seen once in a loaded run: this first publish of a fresh connection never
        # reached the subscriber (the rest did); what is tested here is permissions, so it
        # is sent again (up to 3 times, before anything denied) until it arrives.
        for _ in range(3):
            await agent.publish(s.heartbeat("w0"), b"{}")
            await agent.flush()
            for _ in range(20):
                if s.heartbeat("w0") in seen:
                    break
                await asyncio.sleep(0.05)
            if s.heartbeat("w0") in seen:
                break
        await agent.publish(s.plan, b"{}")
        await agent.flush()
        await agent.publish(s.inject, b"{}")
        await agent.flush()
        akv = await agent.jetstream().key_value(s.kv_bucket)      # reading is allowed
        with pytest.raises(Exception):
            await asyncio.wait_for(akv.put("plan", b'{"generation": 99}'), 2)
        skv = await scaler.jetstream().key_value(s.kv_bucket)
        await skv.put("plan", b"{}")
        await scaler.publish(s.plan, b"{}")                       # allowed for the scaler
        await clients["health_monitor"].publish(s.plan, b"{}")    # denied
        await clients["health_monitor"].publish(s.fault, b"{}")   # allowed
        await clients["state_broker"].publish(s.transfer, b"{}")  # allowed
        for c in clients.values():
            await c.flush()
        # the allowed four arrive (over separate connections, so in any order and, on a
        # loaded machine, late); then a moment for a denied one that would wrongly follow
        for _ in range(100):
            if len(set(seen)) >= 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert (await kv.get("plan")).value == b"{}"
        assert sorted(set(seen)) == sorted([s.heartbeat("w0"), s.plan, s.fault, s.transfer]), seen
        assert seen.count(s.plan) == 1, seen  # the scaler's; the agent's and the monitor's denied
        assert any("permissions violation" in e.lower() for e in errors.get("agent", [])), errors
        assert any("permissions violation" in e.lower()
                   for e in errors.get("health_monitor", [])), errors
    finally:
        for c in clients.values():
            await c.close()

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        bad = await conn("agent", password=f"{PASSWORD}-operator")   # another role's password
        await bad.close()


def test_entrypoint_writes_private_credentials(tmp_path):
    out = tmp_path / "out.json"
    script = ('python -c "import json,os,stat,sys; p=os.environ[\'CEASELESS_CREDS\']; '
              'json.dump({\'creds\': json.load(open(p)), \'mode\': stat.S_IMODE(os.stat(p).st_mode), '
              '\'pw\': os.environ.get(\'CEASELESS_NATS_PASSWORD\'), '
              '\'pod\': os.environ.get(\'CEASELESS_POD\')}, open(sys.argv[1], \'w\'))" ' + str(out))
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TMPDIR": str(tmp_path), "HOSTNAME": "c0ffee123456",
           "CEASELESS_NATS_PASSWORD": PASSWORD, "CEASELESS_POD_SUFFIX": "random"}
    r = subprocess.run(["sh", str(ENTRYPOINT), "sh", "-c", script], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["creds"] == {"user": "ceaseless", "password": PASSWORD}
    assert got["mode"] == 0o600 and got["pw"] is None
    assert re.fullmatch(r"c0ffee123456-[0-9a-f]{6}", got["pod"])
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR


def test_dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    # the CPU build unless the CUDA variant's build argument says otherwise
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r"pip install torch==2\.13\.0 --index-url \$\{TORCH_INDEX\}", text)
    # the project itself, with no extras unless --build-arg EXTRAS='[ray]' says so
    assert re.search(r'^ARG EXTRAS=""$', text, re.M)
    assert re.search(r'^RUN pip install "\.\$\{EXTRAS\}"$', text, re.M)
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    for src in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), f"Dockerfile copies missing {part}"


def _docker_engine() -> str | None:
    """None if an engine answers, else why not (fast: no retries)."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        client.ping()
        client.close()
        return None
    except Exception as e:
        return f"no Docker engine reachable ({type(e).__name__}: {str(e)[:80]})"


def test_nats_jetstream_in_a_container():
    why = _docker_engine()
    if why:
        pytest.skip(why)
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    import nats

    with DockerContainer("nats:2.10-alpine").with_command("-js").with_exposed_ports(4222) as c:
        wait_for_logs(c, "Server is ready", timeout=60)
        url = f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"

        async def check() -> None:
            nc = await nats.connect(url, connect_timeout=5)
            try:
                kv = await nc.jetstream().create_key_value(bucket="ceaseless_demo")
                await kv.put("plan", b"1")
                assert (await kv.get("plan")).value == b"1"
            finally:
                await nc.close()

        asyncio.run(check())



@pytest.fixture
def cluster_conf_servers(tmp_path):
    """deploy/nats-cluster.conf, as compose runs its three servers (each --name nats-K, the
    routes from $CEASELESS_NATS_ROUTE_<K>), on free loopback ports."""
    n = nats_conf.CLUSTER_SERVERS
    ports, routes = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
    env = {**os.environ, **_role_passwords(),
           nats_conf.password_var(nats_conf.ROUTE_USER): ROUTE_PASSWORD,
           **{nats_conf.route_var(k + 1):
              f"nats-route://{nats_conf.ROUTE_USER}:{ROUTE_PASSWORD}@127.0.0.1:{routes[k]}"
              for k in range(n)}}
    conf = str(nats_conf.CLUSTER_CONF)
    t = subprocess.run([find_binary(), "-c", conf, "-t"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert t.returncode == 0, t.stderr + t.stdout
    procs = []
    try:
        for k in range(n):
            procs.append(subprocess.Popen(
                [find_binary(), "-c", conf, "-js", "-sd", str(tmp_path / f"js{k}"),
                 "-a", "127.0.0.1", "-p", str(ports[k]), "-m", str(free_port()),
                 "--name", f"nats-{k + 1}",
                 "--cluster", f"nats://127.0.0.1:{routes[k]}"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for k in range(n):
            _wait_port(ports[k], procs[k])
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_nats_cluster_conf_is_generated():
    text = nats_conf.CLUSTER_CONF.read_text()
    assert text == nats_conf.render_cluster(), "run: python deploy/nats_conf.py conf"
    assert "include ./nats.conf" in text


async def test_nats_cluster_conf_replicates_over_authenticated_routes(cluster_conf_servers):
    """The three compose servers form one cluster over routes that log in with the route
    password: a client given every URL creates the job's stream and buckets with 3 replicas,
    as the scaler's role keeps its permissions on every server."""
    from plumbing.bus import Bus, Credentials

    url = ",".join(f"nats://127.0.0.1:{p}" for p in cluster_conf_servers)
    op = await Bus.connect(url, "demo", "op", Credentials("operator", f"{PASSWORD}-operator"))
    try:
        assert op.replicas == 3
        await op.ensure_job_storage(30.0)
        for stream in (op.subjects.stream, f"KV_{op.subjects.kv_bucket}"):
            info = await op.js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert len(info.cluster.replicas or []) == 2, info.cluster   # the other two
    finally:
        await op.close()


def test_raycluster_runs_the_control_plane_on_three_nodes():
    """deploy/raycluster.yaml (issue 42, the Ray path): besides the head and the GPU workers,
    a `control-plane` group of 3 Ray nodes with no CPU for Ray, one per Kubernetes node,
    each with a nats-server of one cluster (deploy/nats-cluster.conf's routes all set) and
    the credentials `up --bus` is given; the Services the clients and the routes use select
    those pods. Parsed only (no Kubernetes here)."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "raycluster.yaml").read_text()))
    rc = docs[0]
    assert rc["kind"] == "RayCluster" and rc["apiVersion"] == "ray.io/v1"
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    cp = groups["control-plane"]
    assert cp["replicas"] == cp["minReplicas"] == cp["maxReplicas"] == 3
    assert cp["rayStartParams"]["num-cpus"] == "0"
    labels = cp["template"]["metadata"]["labels"]
    spec = cp["template"]["spec"]
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"].items() <= labels.items()
    containers = {c["name"]: c for c in spec["containers"]}
    assert {"ray-worker", "nats"} <= containers.keys()
    nats = containers["nats"]
    cmd = " ".join(nats["command"])
    assert "nats-cluster.conf" in cmd and "-js" in cmd and "--name" in cmd
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    routes = set(re.findall(r"\$(CEASELESS_NATS_ROUTE_\d+)", conf))
    assert routes and routes <= {e["name"] for e in nats["env"]}
    volumes = {v["name"] for v in spec["volumes"]}
    for c in containers.values():
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, c["name"]
    services = {d["metadata"]["name"]: d for d in docs[1:] if d["kind"] == "Service"}
    assert services["ceaseless-nats-routes"]["spec"]["clusterIP"] == "None"
    for svc in services.values():
        sel = svc["spec"]["selector"]
        assert sel["ceaseless/role"] == labels["ceaseless/role"], svc["metadata"]["name"]
    assert {p["port"] for p in services["ceaseless-nats"]["spec"]["ports"]} == {4222}
