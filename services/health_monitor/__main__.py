"""python -m services.health_monitor [--nats URL --creds FILE --job J --run-dir D] [flags]"""

from __future__ import annotations

import asyncio

from schemas.timeouts import DEFAULTS as T
from services.common.service import common_args, serve

from services.common.heartbeats import VIEW_INTERVAL

from .monitor import CHECK_INTERVAL, STRAGGLER_FACTOR, STRAGGLER_WINDOW_S, HealthMonitor


def parser():
    p = common_args("Ceaseless health monitor: liveness and progress -> fault events")
    p.add_argument("--fault-timeout", type=float, default=T["fault_timeout"],
                   help="seconds without a heartbeat before a pod is lost (default %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=T["stall_timeout"],
                   help="seconds a training member's step may stand still while others "
                        "advance before it hangs (default %(default)s)")
    p.add_argument("--collective-timeout", type=float, default=T["collective_timeout"],
                   help="the agents' collective timeout (CEASELESS_COLLECTIVE_TIMEOUT): a live "
                        "member out of a collective its peers have waited in this long hangs "
                        "(default %(default)s)")
    p.add_argument("--suspect-timeout", type=float, default=T["suspect_timeout"],
                   help="after a peer_error report, members silent this long are lost at once "
                        "(default %(default)s)")
    p.add_argument("--check-interval", type=float, default=CHECK_INTERVAL,
                   help="seconds between liveness checks (default %(default)s)")
    p.add_argument("--view-interval", type=float, default=VIEW_INTERVAL,
                   help="seconds between full health views for the scaler and the state "
                        "broker (default %(default)s; 0: publish none, they read heartbeats)")
    p.add_argument("--straggler-factor", type=float, default=STRAGGLER_FACTOR,
                   help="a member whose own compute of a step is this many times the other "
                        "members' median (or slowed this many times more than they were, "
                        "against its own steady pace) for most of --straggler-window s is a "
                        "straggler, swapped for a live spare (default %(default)s; 0: off)")
    p.add_argument("--straggler-window", type=float, default=STRAGGLER_WINDOW_S,
                   help="seconds (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    asyncio.run(serve(HealthMonitor, args, fault_timeout=args.fault_timeout,
                      stall_timeout=args.stall_timeout, suspect_timeout=args.suspect_timeout,
                      collective_timeout=args.collective_timeout,
                      check_interval=args.check_interval,
                      view_interval=args.view_interval or None,
                      straggler_factor=args.straggler_factor,
                      straggler_window=args.straggler_window))


if __name__ == "__main__":
    main()
