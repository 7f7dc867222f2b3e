"""python -m services.scaler [--nats URL --creds FILE --job J --run-dir D] [flags]"""

from __future__ import annotations

import asyncio

from services.common.service import common_args, serve

from schemas.policy import ScalingPolicy, load_policy
from schemas.timeouts import DEFAULTS

from .policy import PolicyConfig
from .scaler import FENCE_TIMEOUT, START_TIMEOUT, Scaler

POLICY_FLAGS = ("min_replicas", "max_replicas", "replica_increment_step", "scale_up_snooze_s",
                "scaling_timeout_s", "graceful_shutdown_timeout_s", "transition_lead_s",
                "lr_warmup_steps")


def policy_from_args(args):
    over = {k: getattr(args, k) for k in POLICY_FLAGS}
    if args.replica_discrete_values:
        try:
            over["replica_discrete_values"] = [
                int(v) for v in args.replica_discrete_values.split(",") if v.strip()]
        except ValueError:
            raise ValueError("--replica-discrete-values takes integers, e.g. 2,4,8") from None
    return load_policy(args.policy, **over)


def _policy_default(name: str) -> str:
    """The scaling policy's default of ``name``, for a flag's help (one source: ScalingPolicy)."""
    return f"(default {ScalingPolicy.model_fields[name].default:g})"


def parser():
    p = common_args("Ceaseless scaler: the single writer of membership plans")
    p.add_argument("--workers", type=int, default=2,
                   help="desired initial ranks: replicas x --shard-size (default 2)")
    p.add_argument("--shard-size", type=int, default=1,
                   help="ranks per replica of a sharded model (FSDP inside a replica); "
                        "replica counts (policy, requests) count replicas of this many ranks "
                        "(default 1: unsharded)")
    g = p.add_argument_group("scaling policy (flags override --policy / $CEASELESS_POLICY)")
    g.add_argument("--policy", help="TOML (or YAML) policy file, see schemas/policy.py")
    g.add_argument("--min-replicas", type=int, help=_policy_default("min_replicas"))
    g.add_argument("--max-replicas", type=int, help=_policy_default("max_replicas"))
    g.add_argument("--replica-increment-step", type=int,
                   help=_policy_default("replica_increment_step"))
    g.add_argument("--replica-discrete-values", help="allowed replica counts, e.g. 2,4,8")
    g.add_argument("--scale-up-snooze", type=float, dest="scale_up_snooze_s",
                   help="no scale-up within this many seconds of the last change "
                        + _policy_default("scale_up_snooze_s"))
    g.add_argument("--scaling-timeout", type=float, dest="scaling_timeout_s",
                   help="a joiner not training by then is dropped "
                        + _policy_default("scaling_timeout_s"))
    g.add_argument("--graceful-shutdown-timeout", type=float,
                   dest="graceful_shutdown_timeout_s",
                   help="a leaving replica still running by then is stopped "
                        + _policy_default("graceful_shutdown_timeout_s"))
    g.add_argument("--transition-lead", type=float, dest="transition_lead_s",
                   help="schedule planned changes this far ahead of the members "
                        + _policy_default("transition_lead_s"))
    g.add_argument("--lr-warmup-steps", type=int,
                   help="lr_factor ramp length " + _policy_default("lr_warmup_steps"))
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--batch-from-script", action="store_true",
                   help="the batch above only sizes the plans made before the training "
                        "script's own is known (KV `script`, written by rank 0 at its first "
                        "step); later plans take the script's (`ceaseless up` without "
                        "--global-batch-size / --micro-batch-size)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT,
                   help="seconds to wait for --workers workers before starting with "
                        ">= --min-replicas (default %(default)g)")
    p.add_argument("--fault-timeout", type=float, default=DEFAULTS["fault_timeout"],
                   help="a pod is alive if it heartbeated within this many seconds")
    p.add_argument("--fence-timeout", type=float, default=FENCE_TIMEOUT,
                   help="timeout of the actuator kill request (best effort)")
    p.add_argument("--scaler-id", dest="instance_id", default=None,
                   help="the same as --instance-id (its older name)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    try:
        pol = policy_from_args(args)
        PolicyConfig.from_policy(pol, workers=args.workers,
                                 global_batch_size=args.global_batch_size,
                                 micro_batch_size=args.micro_batch_size,
                                 shard_size=args.shard_size)
        if args.lease_ttl <= 0 or args.fault_timeout <= 0:
            raise ValueError("--lease-ttl and --fault-timeout must be positive")
    except ValueError as e:
        p.error(str(e))
    asyncio.run(serve(Scaler, args, workers=args.workers, policy=pol,
                      global_batch_size=args.global_batch_size,
                      micro_batch_size=args.micro_batch_size, lease_ttl=args.lease_ttl,
                      start_timeout=args.start_timeout, fault_timeout=args.fault_timeout,
                      fence_timeout=args.fence_timeout, scaler_id=args.instance_id,
                      shard_size=args.shard_size, batch_from_script=args.batch_from_script))


if __name__ == "__main__":
    main()
