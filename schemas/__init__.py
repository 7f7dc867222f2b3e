"""The wire contract: message models and subject names."""

from .batching import micro_batch_range, num_micro_batches, shares, shares_range
from .messages import *  # noqa: F401,F403
from .messages import BY_KIND, MAX_PAYLOAD_BYTES, SCHEMA_VERSION, Message
from .subjects import LEASE_KEY, PLAN_KEY, PLAN_PARTS_PREFIX, Subjects, check_id, plan_part_key

__all__ = [
    "BY_KIND", "LEASE_KEY", "MAX_PAYLOAD_BYTES", "Message", "PLAN_KEY", "PLAN_PARTS_PREFIX", "SCHEMA_VERSION",
    "Subjects", "check_id", "micro_batch_range", "num_micro_batches", "plan_part_key", "shares", "shares_range",
]
