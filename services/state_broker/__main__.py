"""python -m services.state_broker [--nats URL --creds FILE --job J --run-dir D] [flags]"""

from __future__ import annotations

import asyncio

from services.common.service import common_args, serve

from .broker import StateBroker


def parser():
    p = common_args("Ceaseless state broker: committed state per pod -> transfer plans")
    p.add_argument("--member-wait", type=float, default=10.0,
                   help="seconds to wait for every member's heartbeat of a new generation "
                        "(default 10)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    asyncio.run(serve(StateBroker, args, member_wait=args.member_wait))


if __name__ == "__main__":
    main()
