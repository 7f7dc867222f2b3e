"""Actuators start, stop and kill pods and report their exits.

``Actuator`` is the interface the control plane needs; ``LocalActuator`` runs pods as
local processes (``ceaseless up``); ``ray.RayActuator`` (``--actuator ray``, the ``ray`` extra,
imported only when used) runs each pod as a Ray actor. A Kubernetes actuator implements the
same interface.
"""

from .base import Actuator, PodSpec
from .local import FALLBACK_EXIT_CODE, LocalActuator

__all__ = ["Actuator", "FALLBACK_EXIT_CODE", "LocalActuator", "PodSpec"]
