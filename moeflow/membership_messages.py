"""Engine <-> worker messages of a membership that changes while serving (``engine/elastic.py``,
``engine/elastic_attention.py``): a worker that joins, and the regions the expert side serves."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class JoinExperts:
    """What an expert-holding worker that joins an elastic deployment while it serves starts from
    (``WorkerSetup.join``): placement ``epoch`` (``layers``, its own row included) is the one it
    fills, from the peers' live buffers of placement ``epoch - 1`` (``live_layers``, without it), and
    reports ``ExpertsMoved`` for once it is done."""

    epoch: int
    layers: tuple  # [moe layer][expert device] -> logical expert of each slot, after it joins
    live_layers: tuple  # the same, serving now


@dataclass
class JoinReplica:
    """A dwdp rank that joins while the deployment serves (``WorkerSetup.join``): its resident experts
    are a copy of rank ``like``'s, read out of that rank's published segment, and it pulls the rest
    as ``like`` does; it publishes nothing, so no peer depends on it and it may leave at any time."""

    like: int


@dataclass
class ForgetRegion:
    """Engine -> every expert holder: attention group ``region`` left (every reply to it was sent);
    one that joins at its index later writes and reads new buffers from seq 1."""

    region: int


@dataclass
class ServeInstances:
    """Engine -> every afd FFN daemon, between steps: aggregate instances 0..count-1 from the next step
    on (an instance that left is forgotten, its buffers let go); answered with ``InstancesServed``."""

    count: int


@dataclass
class InstancesServed:
    role: str
    index: int
    count: int
