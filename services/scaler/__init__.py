"""Scaler: the only writer of membership plans (faults, capacity, priority)."""

from .policy import PolicyConfig, Wait, initial_plan, on_fault
from .scaler import Scaler

__all__ = ["PolicyConfig", "Scaler", "Wait", "initial_plan", "on_fault"]
