"""The mode table: the one place that imports every mode's engine (the modes never import it).

``create_engine`` builds a deployment from its layout; ``plan_for`` makes a layout's memory plan
without starting anything (``moeflow predict``). Adding a mode: its engine class here, its
scheduler in ``scheduler.BUILDERS``, its layout in ``layout.py`` (``docs/structure.md``).
"""
from __future__ import annotations

import dataclasses

from moeflow.config import ConfigError, EngineConfig
from moeflow.engine.afd import AfdEngine
from moeflow.engine.asap import AsapEngine
from moeflow.engine.base import Engine
from moeflow.engine.colocated import ColocatedEngine
from moeflow.engine.dep import DepEngine
from moeflow.engine.dwdp import DwdpEngine
from moeflow.engine.memory import MemoryPlan, apply_budget
from moeflow.engine.decode_server import DecodeServer
from moeflow.engine.pd import PdEngine
from moeflow.engine.prefill_server import PrefillServer
from moeflow.hardware import resolve_device, resolve_dtype
from moeflow.layout import Layout
from moeflow.layout.pd import DECODE_MODES, PREFILL_MODES
from moeflow.model.checkpoint import weights_fingerprint
from moeflow.model.weights import load_config
from moeflow.scheduler.expert_location import TRIVIAL

MODES: dict[str, type[Engine]] = {e.mode_name: e for e in (ColocatedEngine, DepEngine, AsapEngine, DwdpEngine,
                                                          AfdEngine, PdEngine)}
MULTINODE_MODES = tuple(m for m, e in MODES.items() if e.multinode)  # the modes whose workers may span hosts
# a prefill or decode server (KvTransferConfig.role, `serve --role`): one side of the handoff around its engine
SERVER_SIDES = {"prefill": (PrefillServer, PREFILL_MODES), "decode": (DecodeServer, DECODE_MODES)}


def engine_class(mode: str) -> type[Engine]:
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} has a layout but no engine; engines: {sorted(MODES)}")
    return MODES[mode]


def create_engine(layout: Layout, model_path: str, config: EngineConfig) -> Engine:
    """The deployment ``layout`` describes, running ``config``'s settings on ``model_path``."""
    cls = engine_class(layout.mode)
    cluster = config.cluster
    if cluster.node_rank != 0:
        raise ConfigError(f"node {cluster.node_rank} runs workers only (moeflow worker-node); the engine is node 0's")
    if cluster.is_multinode and not cls.multinode:
        raise ConfigError(f"mode {layout.mode!r} runs on one host; modes across hosts: {list(MULTINODE_MODES)}")
    if layout.mode == "colocated" and (config.enable_eplb or config.init_expert_location != TRIVIAL):
        raise ConfigError("--enable-eplb and --init-expert-location: mode colocated holds every expert in one "
                          "process, so there is no placement to balance")
    model, _ = load_config(model_path)
    # NOTE: resolved here, once, so every worker of the deployment gets the same concrete device and
    # dtype (the dtype for that device: the checkpoint's bf16 on a GPU that has it)
    device = resolve_device(config.device)
    config = dataclasses.replace(config, device=device,
                                 dtype=resolve_dtype(config.dtype, model.checkpoint_dtype, device).dtype)
    kv = config.kv_transfer_config
    if kv is None:
        return cls(model_path, config, layout)
    side, modes = SERVER_SIDES[kv.role]
    if layout.mode not in modes:
        raise ConfigError(f"a {kv.role} server runs one of the modes {modes}, not {layout.mode!r}"
                          + (" (a pd deployment hands KV between its own instances)" if layout.mode == "pd" else ""))
    # a prefill server offering its KV in place shares its cache (decode servers on this host map it)
    share = kv.role == "prefill" and kv.in_place
    inner = cls(model_path, dataclasses.replace(config, share_kv_cache=config.share_kv_cache or share), layout)
    try:
        return side(inner, kv, weights_fingerprint(model_path))
    except BaseException:
        inner.shutdown()
        raise


PdEngine.build_instance = staticmethod(create_engine)  # a pd deployment's instances are engines of the table


def plan_for(layout: Layout, model_path: str, config: EngineConfig) -> MemoryPlan:
    """The memory plan ``layout`` would get under ``config``'s budget (its dtype resolved)."""
    _, plan = apply_budget(config, model_path, layout)
    return plan
