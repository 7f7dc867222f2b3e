"""State broker: committed state per pod -> one transfer plan (or state_lost) per generation."""

from .broker import StateBroker, decide_transfer

__all__ = ["StateBroker", "decide_transfer"]
