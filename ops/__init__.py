"""The operator's tools: the ``ceaseless`` command (``up``, ``status``, ``inject``, ``trace``,
``data``, ``chaos``), the local cluster runner behind ``up``, the trace readers, and the
launcher that runs ``ceaseless up`` as a child for chaos runs, benchmarks and tests. Built on
the control plane (``services/``) and the plumbing; nothing in ``services/`` or ``agent/``
imports it.
"""
