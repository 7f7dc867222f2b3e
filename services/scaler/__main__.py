"""python -m services.scaler [--nats URL --creds FILE --job J --run-dir D] [flags]"""

from __future__ import annotations

import asyncio

from services.common.service import common_args, serve

from .policy import PolicyConfig
from .scaler import Scaler


def parser():
    p = common_args("Ceaseless scaler: the single writer of membership plans")
    p.add_argument("--workers", type=int, default=2,
                   help="desired initial replicas (default 2)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--lease-ttl", type=float, default=3.0, help="scaler lease TTL in seconds")
    p.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds to wait for --workers workers before starting with "
                        ">= --min-replicas (default 30)")
    p.add_argument("--fault-timeout", type=float, default=1.5,
                   help="a pod is alive if it heartbeated within this many seconds")
    p.add_argument("--fence-timeout", type=float, default=0.5,
                   help="timeout of the actuator kill request (best effort)")
    p.add_argument("--scaler-id", default=None, help="lease holder id (default: random)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    try:
        PolicyConfig(workers=args.workers, min_replicas=args.min_replicas,
                     max_replicas=args.max_replicas, global_batch_size=args.global_batch_size,
                     micro_batch_size=args.micro_batch_size)
        if args.lease_ttl <= 0 or args.fault_timeout <= 0:
            raise ValueError("--lease-ttl and --fault-timeout must be positive")
    except ValueError as e:
        p.error(str(e))
    asyncio.run(serve(Scaler, args, workers=args.workers, min_replicas=args.min_replicas,
                      max_replicas=args.max_replicas, global_batch_size=args.global_batch_size,
                      micro_batch_size=args.micro_batch_size, lease_ttl=args.lease_ttl,
                      start_timeout=args.start_timeout, fault_timeout=args.fault_timeout,
                      fence_timeout=args.fence_timeout, scaler_id=args.scaler_id))


if __name__ == "__main__":
    main()
