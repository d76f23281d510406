"""CudaIpcTransport: the shared-memory transport with every mailbox's payload in device memory.

Flags, headers, doorbells and backpressure are the ``shm`` transport's, word for word (the
model-checked protocol); only the payload arena differs (``arena.py``): each receiver allocates
its mailbox's payload on its CUDA device and publishes the IPC handle in the segment, writers
copy into it on a side stream and synchronise before their flag store. One host, one or more
CUDA devices the processes can reach by IPC (two processes may share one GPU). Published weights
(dwdp's residents, the expert mover's buffers) live in device memory too (``cuda_weights.py``).
"""
from __future__ import annotations

import dataclasses

from moeflow.comm.cuda_weights import CudaIpcWeightStore
from moeflow.comm.shm import ShmTransport, combine_layout, dispatch_layout
from moeflow.comm.transport import register
from moeflow.config import ConfigError

ARENA = "cuda_ipc"


@register
class CudaIpcTransport(ShmTransport):
    name = "cuda-ipc"
    weight_store_cls = CudaIpcWeightStore  # dwdp's pulls and the expert mover's: device to device

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, arena=ARENA))  # refused there without a CUDA compute device

    @classmethod
    def mailbox_bytes(cls, config, node: int = 0) -> int:
        s = config.spec  # the segments hold flags, headers and the handle; the payload is device memory
        return 0 if s is None else (s.num_expert_ranks * dispatch_layout(s, ARENA).size_bytes +
                                    s.num_lanes * combine_layout(s, ARENA).size_bytes)


def check_engine(config) -> None:
    """Refuse ``--transport cuda-ipc`` where it cannot run, before any process starts."""
    if config.transport != CudaIpcTransport.name:
        return
    if config.cluster.is_multinode:
        raise ConfigError(f"transport 'cuda-ipc' connects the processes of one host; this deployment spans "
                          f"{config.cluster.nnodes} hosts (transport shm crosses hosts over gloo)")
    if not config.device.startswith("cuda"):
        raise ConfigError(f"transport 'cuda-ipc' keeps payloads in device memory: it needs device cuda, got "
                          f"{config.device!r}")
