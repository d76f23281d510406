"""A server's side of a prefill/decode split across servers: the engine of its own layout (any
mode) inside, a KV link outside (``prefill_server.py``, ``decode_server.py``; ``docs/pd.md``).

What the wrapper does not define is the inner deployment's (``__getattr__``): it is an ``Engine``
by what it answers, not by inheriting the interface's defaults. A failed inner deployment is the
server's failure: the server's restart policy rebuilds the whole side (a new KV link, so decode
servers open new pairs and whatever was staged is recomputed or failed by their policy).
"""
from __future__ import annotations

import os
import uuid

from moeflow.config import EngineConfig, KvTransferConfig
from moeflow.engine.base import Engine
from moeflow.engine.kv_handoff import KvConnector, heap_device
from moeflow.kv_handle import KvLayout
from moeflow.model.attention import attention_for


class ServerSide:
    multinode = False
    kv_port: int | None = None  # a prefill server's KV link's port

    def __init__(self, inner: Engine, kv: KvTransferConfig, weights: str = ""):
        """``weights``: the served checkpoint's fingerprint (``model.checkpoint.weights_fingerprint``):
        a handle from a server with other weights is refused."""
        self.inner, self.kv_config, self.weights = inner, kv, weights
        self.config: EngineConfig = inner.config
        mc = inner.model_config
        self.kv_layout = KvLayout(mc.architecture, mc.num_layers, self.config.dtype,
                                  tuple(attention_for(mc).kv_layout().items()))
        # NOTE: <pid>-<hex>, as an engine's: a SIGKILLed owner's arena is reclaimed by the next one
        self.kv = KvConnector.for_model(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", mc, inner.max_model_len,
                                        self.config.dtype, kv.buffer_mib, heap_device(self.config))

    def __getattr__(self, name: str):
        # NOTE: only names not found on the side: the inner deployment's state (failed, stalls, the
        # memory plan) and the calls the side leaves alone (heal, drain, collect_spans, ...). A name
        # the server sets (failed, before a rebuild) is then the side's, which the rebuild replaces.
        if name == "inner":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def mode_name(self) -> str:
        return f"{self.inner.mode_name} ({self.kv_config.role})"

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.kv.shutdown()
