"""CudaIpcTransport: the shared-memory transport with every mailbox's payload in device memory.

Flags, headers, doorbells and backpressure are the ``shm`` transport's, word for word (the
model-checked protocol); only the payload arena differs (``arena.py``): each receiver allocates
its mailbox's payload on its CUDA device and publishes the IPC handle in the segment, writers
copy into it on a side stream and synchronise before their flag store. One host, one or more
CUDA devices the processes can reach by IPC (two processes may share one GPU). Published weights
(dwdp's residents, the expert mover's buffers) live in device memory too (``cuda_weights.py``).

``DeferredTransport`` (``--transport deferred``) is its CPU rehearsal, for tests and for trying a
GPU run's logic on a CPU: the same handles, ownership and same-process rule over host memory
(``ipc_memory.py``), and payload copies that land only when synchronised (``arena.DeferredArena``).
"""
from __future__ import annotations

import dataclasses

from moeflow.comm.cuda_weights import CudaIpcWeightStore
from moeflow.comm.shm import ShmTransport, combine_layout, dispatch_layout
from moeflow.comm.transport import register
from moeflow.config import ConfigError

@register
class CudaIpcTransport(ShmTransport):
    name = "cuda-ipc"
    arena = "cuda_ipc"
    weight_store_cls = CudaIpcWeightStore  # dwdp's pulls and the expert mover's: device to device

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, arena=self.arena))  # refused there without a CUDA compute device

    @classmethod
    def mailbox_bytes(cls, config, node: int = 0) -> int:
        s = config.spec  # the segments hold flags, headers and the handle; the payload is outside them
        return 0 if s is None else (s.num_expert_ranks * dispatch_layout(s, cls.arena).size_bytes +
                                    s.num_lanes * combine_layout(s, cls.arena).size_bytes)


@register
class DeferredTransport(CudaIpcTransport):
    name = "deferred"
    arena = "deferred"


BY_HANDLE = (CudaIpcTransport.name, DeferredTransport.name)  # transports whose memory others map by handle


def check_engine(config) -> None:
    """Refuse ``--transport cuda-ipc`` (and its rehearsal) where it cannot run, before any process starts."""
    if config.transport not in BY_HANDLE:
        return
    if config.cluster.is_multinode:
        raise ConfigError(f"transport {config.transport!r} connects the processes of one host; this deployment "
                          f"spans {config.cluster.nnodes} hosts (transport shm crosses hosts over gloo)")
    if config.transport == CudaIpcTransport.name and not config.device.startswith("cuda"):
        raise ConfigError(f"transport 'cuda-ipc' keeps payloads in device memory: it needs device cuda, got "
                          f"{config.device!r} (transport deferred rehearses it on the CPU)")
    if config.transport == DeferredTransport.name and config.device != "cpu":
        raise ConfigError(f"transport 'deferred' is cuda-ipc's rehearsal on the CPU: it needs device cpu, got "
                          f"{config.device!r}")
