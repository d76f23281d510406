"""The hosts one deployment spans (``EngineConfig.cluster``), a config of its own beside
``config.py`` as ``eplb_config.py`` is."""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import require


@dataclass(frozen=True)
class ClusterConfig:
    """The hosts one deployment spans, named as torchrun names them (one moeflow process per host).

    Node 0 runs the engine (and the HTTP server), its share of the workers, and hosts the
    rendezvous (a torch.distributed TCPStore on ``master_addr:master_port``) through which every
    other node receives its workers' setups and relays their control messages.
    """

    nnodes: int = 1  # hosts in the deployment (torchrun --nnodes; $WORLD_SIZE with one process per host)
    node_rank: int = 0  # this host: 0 runs the engine, others only workers ($NODE_RANK)
    master_addr: str = "127.0.0.1"  # node 0's address, reachable from every node ($MASTER_ADDR)
    master_port: int = 29500  # the rendezvous's TCP port on node 0 ($MASTER_PORT)
    connect_timeout_s: float = 300.0  # how long a node waits for node 0 (and node 0 for the others)
    heartbeat_timeout_s: float = 5.0  # a node silent this long is taken for dead, and its workers with it
    # torchrun's agent already hosts a TCPStore on master_port ($TORCHELASTIC_USE_AGENT_STORE): node 0
    # uses it as a client instead of hosting the rendezvous itself
    agent_store: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.nnodes, int) and self.nnodes >= 1, f"nnodes must be an int >= 1, got {self.nnodes!r}")
        require(isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes,
                 f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        require(isinstance(self.master_port, int) and 0 < self.master_port < 65536,
                 f"master_port must be a TCP port, got {self.master_port!r}")
        require(bool(self.master_addr), "master_addr must name node 0's address")
        require(self.connect_timeout_s > 0 and self.heartbeat_timeout_s > 0, "cluster timeouts must be > 0")

    @property
    def is_multinode(self) -> bool:
        return self.nnodes > 1
