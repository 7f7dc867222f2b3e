"""The plumbing both sides use: the bus (NATS, JetStream KV, credentials), structured logs,
OpenTelemetry set-up, small asyncio helpers and bounded collections. The training library
(``agent/``) and the control plane (``services/``) both import it; it imports neither.
"""
