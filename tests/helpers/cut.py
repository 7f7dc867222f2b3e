"""A loopback TCP relay that a test can cut: clients connect to ``url``, bytes go to the
real server and back. ``cut()`` drops every relayed connection and refuses new ones (the
client sees its server vanish and keeps reconnecting), ``restore()`` lets them in again.
What a pod meets when its link to nats-server breaks, without touching the server."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse


class Cut:
    def __init__(self, target_url: str) -> None:
        u = urlparse(target_url)
        self._target = (u.hostname or "127.0.0.1", u.port or 4222)
        self._scheme = u.scheme or "nats"
        self._lock = threading.Lock()
        self._open = True
        self._conns: list[socket.socket] = []
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(16)
        self.port = self._srv.getsockname()[1]
        self.url = f"{self._scheme}://127.0.0.1:{self.port}"
        self.accepted = 0
        self._stopped = False
        threading.Thread(target=self._accept, name="cut-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                ok = self._open
            if not ok:
                c.close()
                continue
            try:
                s = socket.create_connection(self._target, timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self.accepted += 1
                self._conns += [c, s]
            for a, b in ((c, s), (s, c)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._open = False
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)

    def restore(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        self._stopped = True
        self.cut()
        _close(self._srv)

    def __enter__(self) -> "Cut":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        _close(a)
        _close(b)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
