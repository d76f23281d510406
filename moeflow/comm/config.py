"""CommConfig: which transport a deployment uses, and how it waits. Every process gets the same one."""
from __future__ import annotations

from dataclasses import dataclass, field

from moeflow.comm.segment import check_deployment_id
from moeflow.layout.comm_spec import CommSpec
from moeflow.comm.wait import WaitPolicy
from moeflow.config import ConfigError


@dataclass(frozen=True)
class CommConfig:
    spec: CommSpec | None  # dispatch/combine buffer geometry (ASAP Table 2); None: weight pulls only (dwdp)
    transport: str = "shm"  # a key of transport.TRANSPORTS: shm | shm-handshake | dist | p2p | links | reference
    deployment_id: str = "default"  # names the /dev/shm segments: moeflow-<id>.*
    wait: WaitPolicy = field(default_factory=WaitPolicy)  # receivers, and senders under backpressure
    attach_timeout_s: float = 60.0  # how long a sender waits for its receivers' buffers to appear
    device: str = "cpu"  # dist/p2p: where staging buffers live ("cuda" with the nccl backend)
    # where receivers' private copies live: the receiving worker's compute device, so a payload
    # arrives where it is computed on (the shared buffers themselves are host memory)
    compute_device: str = "cpu"
    stream_chunk_bytes: int = 1 << 20  # shm: payloads larger than this are written (and read) in
    # chunks of about this size, so the receiver's copy overlaps the sender's; 0: one copy each
    rank_nodes: tuple[int, ...] = ()  # links, pairs: the host of each world rank; (): all on one host
    store: tuple[str, int] | None = None  # pairs: the cluster's store (address, port), where pairs meet
    # shm: where the mailboxes' payload bytes live (comm/arena.py): host (the shared segment),
    # cuda_ipc (device memory on compute_device, shared by CUDA IPC), deferred (its CPU rehearsal)
    arena: str = "host"

    def __post_init__(self) -> None:
        if self.spec is not None and not isinstance(self.spec, CommSpec):
            raise ConfigError(f"CommConfig.spec must be a CommSpec or None, got {type(self.spec).__name__}")
        from moeflow.comm.transport import TRANSPORTS  # registry fills on import of the package

        if self.transport not in TRANSPORTS:
            raise ConfigError(f"CommConfig.transport must be one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        try:
            check_deployment_id(self.deployment_id)
        except ValueError as e:
            raise ConfigError(f"CommConfig.{e}") from None
        if not isinstance(self.stream_chunk_bytes, int) or self.stream_chunk_bytes < 0:
            raise ConfigError(f"CommConfig.stream_chunk_bytes must be an int >= 0, got {self.stream_chunk_bytes!r}")
        if self.rank_nodes and self.spec is not None and len(self.rank_nodes) != self.spec.world_size:
            raise ConfigError(f"CommConfig.rank_nodes names {len(self.rank_nodes)} ranks; the world has "
                              f"{self.spec.world_size}")
        if self.transport == "pairs" and self.store is None:
            raise ConfigError("CommConfig.transport 'pairs' needs CommConfig.store: the (address, port) of the "
                              "store where pairs of processes meet")
        from moeflow.comm.arena import ARENAS

        if self.arena not in ARENAS:
            raise ConfigError(f"CommConfig.arena must be one of {sorted(ARENAS)}, got {self.arena!r}")
        if self.arena != "host" and self.transport not in ("shm", "shm-handshake", "cuda-ipc", "deferred"):
            raise ConfigError(f"CommConfig.arena {self.arena!r} is for the one-host mailboxes (transport shm, "
                              f"shm-handshake, cuda-ipc or deferred); transport {self.transport!r} moves payloads "
                              f"through host memory")
        if self.arena == "cuda_ipc" and not self.compute_device.startswith("cuda"):
            raise ConfigError(f"CommConfig.arena 'cuda_ipc' keeps payloads in device memory: compute_device must "
                              f"be a CUDA device, got {self.compute_device!r}")
        if not self.attach_timeout_s > 0:
            raise ConfigError(f"CommConfig.attach_timeout_s must be > 0, got {self.attach_timeout_s}")
