"""Start a pod's command inside the network namespace its pod id is given (test_netns.py).

    python netns_pod.py SPEC -- CMD...

``SPEC`` is JSON: ``{"ns": [[name, root_addr, addr], ...], "pods": {"w0": 0, ...}}``; a pod
missing from ``pods`` goes to namespace (the number in its id) mod the namespace count.
The pod id is ``CEASELESS_POD`` (set by the actuator). The command gets the environment
as it is, except:

* ``CEASELESS_NATS_URL``: its host replaced by ``root_addr`` (the bus as the namespace
  reaches it: the root side of its veth);
* ``CEASELESS_GLOO_HOSTNAME`` = ``addr``: gloo binds and advertises the namespace's address.

It then ``exec``s ``ip netns exec NAME CMD``, and ``ip`` execs CMD in turn (no fork), so
the pid the actuator started, records and SIGKILLs is the training process itself.
"""

from __future__ import annotations

import json
import os
import re
import sys
from urllib.parse import urlsplit, urlunsplit


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: netns_pod.py SPEC -- CMD...")
    spec, cmd = json.loads(argv[0]), argv[2:]
    pod = os.environ["CEASELESS_POD"]
    i = spec.get("pods", {}).get(pod)
    if i is None:
        m = re.search(r"\d+", pod)
        i = int(m.group()) if m else 0
    name, root_addr, addr = spec["ns"][i % len(spec["ns"])]
    env = dict(os.environ)
    url = urlsplit(env["CEASELESS_NATS_URL"])
    env["CEASELESS_NATS_URL"] = urlunsplit(url._replace(netloc=f"{root_addr}:{url.port}"))
    env["CEASELESS_GLOO_HOSTNAME"] = addr
    env.pop("GLOO_SOCKET_IFNAME", None)  # an interface would win over the hostname
    os.execvpe("ip", ["ip", "netns", "exec", name, *cmd], env)


if __name__ == "__main__":
    main(sys.argv[1:])
