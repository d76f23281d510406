"""A server's side of a prefill/decode split across servers: the engine of its own layout (any
mode) inside, a KV link outside (``prefill_role.py``, ``decode_role.py``; ``docs/pd.md``).

The wrapper delegates what it does not change. A failed inner deployment is the server's failure:
the server's restart policy rebuilds the whole role (a new KV link, so decode servers open new
pairs and whatever was staged is recomputed or failed by their policy).
"""
from __future__ import annotations

import os
import uuid

from moeflow.config import EngineConfig, KvTransferConfig
from moeflow.engine.base import Engine, EngineLoad, StepResult
from moeflow.engine.kv_handoff import KvConnector, heap_device
from moeflow.kv_handle import KvLayout
from moeflow.model.attention import attention_for


class RoleEngine(Engine):
    multinode = False
    kv_port: int | None = None  # a prefill server's KV link's port

    def __init__(self, inner: Engine, kv: KvTransferConfig, weights: str = ""):
        """``weights``: the served checkpoint's fingerprint (``model.checkpoint.weights_fingerprint``):
        a handle from a server with other weights is refused."""
        self.inner, self.kv_config, self.weights = inner, kv, weights
        self.config: EngineConfig = inner.config
        self.model_config, self.max_model_len = inner.model_config, inner.max_model_len
        self.memory_plan = inner.memory_plan
        mc = self.model_config
        self.kv_layout = KvLayout(mc.architecture, mc.num_layers, self.config.dtype,
                                  tuple(attention_for(mc).kv_layout().items()))
        # NOTE: <pid>-<hex>, as an engine's: a SIGKILLed owner's arena is reclaimed by the next one
        self.kv = KvConnector.for_model(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", mc, self.max_model_len,
                                        self.config.dtype, kv.buffer_mib, heap_device(self.config))

    @property
    def mode_name(self) -> str:
        return f"{self.inner.mode_name} ({self.kv_config.role})"

    @property
    def failed(self) -> str | None:
        return self.inner.failed

    @failed.setter
    def failed(self, why: str | None) -> None:  # the server marks a deployment it will rebuild
        self.inner.failed = why

    @property
    def stalls(self) -> int:
        return self.inner.stalls

    def load(self) -> EngineLoad:
        return self.inner.load()

    def decode_pools(self) -> list:
        return self.inner.decode_pools()

    def check_workers(self) -> StepResult:
        return self.inner.check_workers()

    def degraded(self) -> str | None:
        return self.inner.degraded()

    def heal(self) -> bool:
        return self.inner.heal()

    def oldest_work_age_s(self) -> tuple[float, int | None]:
        return self.inner.oldest_work_age_s()

    def collect_spans(self) -> list:
        return self.inner.collect_spans()

    def drain(self, timeout_s: float = 120.0) -> None:
        self.inner.drain(timeout_s)

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.kv.shutdown()
