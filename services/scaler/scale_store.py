"""KV ``scale``: the target replica count and the releases still waiting for their slots
(written by compare-and-set, so two scalers never lose each other's request)."""

from __future__ import annotations

from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from schemas.messages import Plan
from schemas.policy import SCALE_KEY, ScaleState

from .policy import PolicyConfig


class ScaleStore:
    def __init__(self, log: Any) -> None:
        self.log = log
        self.kv: Any = None  # the job's bucket, set when the scaler starts
        self.state: ScaleState | None = None   # cache of KV ``scale``
        self.revision: int | None = None

    def target(self, plan: Plan, cfg: PolicyConfig) -> int:
        if self.state is not None:
            return self.state.target
        return max(plan.replicas, cfg.target_replicas)

    async def load(self) -> None:
        try:
            entry = await self.kv.get(SCALE_KEY)
        except (KeyNotFoundError, NotFoundError):
            self.state, self.revision = None, None
            return
        if entry.value is None:
            self.state, self.revision = None, None
            return
        try:
            self.state = ScaleState.model_validate_json(entry.value)
            self.revision = entry.revision
        except ValueError as e:
            self.log.error("KV scale state does not validate; ignoring it", error=str(e)[:300])
            self.state, self.revision = None, entry.revision

    async def store(self, st: ScaleState) -> bool:
        """False: it changed concurrently (reloaded)."""
        data = st.model_dump_json().encode()
        try:
            if self.revision is None:
                rev = await self.kv.create(SCALE_KEY, data)
            else:
                rev = await self.kv.update(SCALE_KEY, data, last=self.revision)
        except KeyWrongLastSequenceError:
            await self.load()
            return False
        self.state, self.revision = st, rev
        return True
