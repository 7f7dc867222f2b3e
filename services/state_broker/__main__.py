"""python -m services.state_broker [--nats URL --creds FILE --job J --run-dir D] [flags]"""

from __future__ import annotations

import asyncio

from services.common.service import common_args, serve

from .broker import MEMBER_WAIT, STATE_WAIT, StateBroker


def parser():
    p = common_args("Ceaseless state broker: committed state per pod -> transfer plans")
    p.add_argument("--member-wait", type=float, default=MEMBER_WAIT,
                   help="seconds to wait for every member's heartbeat of a new generation "
                        "(default %(default)g)")
    p.add_argument("--state-wait", type=float, default=STATE_WAIT,
                   help="seconds to keep waiting for a live member that holds newer committed "
                        "state than every member that reported (default %(default)g)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    asyncio.run(serve(StateBroker, args, member_wait=args.member_wait,
                      state_wait=args.state_wait))


if __name__ == "__main__":
    main()
