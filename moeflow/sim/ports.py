"""The links between afd's M attention instances and N FFN daemons, one FIFO port each way per
device, as the simulator's other systems price theirs (asap's MoE workers and groups: a port per
direction, FIFO; dep's all-to-all: as long as its busiest endpoint).

A message from a to b holds a's out port and b's in port for its bytes' seconds, starting once it
is ready and both are free; it arrives a latency later. Messages are served in the order they are
ready (ties: the sender's index, then its list of receivers), so a daemon that M instances feed
takes M messages through its one link, and an instance that N daemons answer takes N.
"""
from __future__ import annotations


class Ports:
    def __init__(self, instances: int, daemons: int, now: float):
        self.inst_out = [now] * instances
        self.inst_in = [now] * instances
        self.daemon_in = [now] * daemons
        self.daemon_out = [now] * daemons

    def state(self) -> list[float]:
        return [*self.inst_out, *self.inst_in, *self.daemon_in, *self.daemon_out]

    def dispatch(self, ready: list[float], to: list[list[int]], secs: list[float], latency: float) -> list[float]:
        """Instance i's rows, ready at ``ready[i]``, one message of ``secs[i]`` to each daemon of
        ``to[i]``: when each daemon has every message it was sent (``-inf``: none)."""
        return _exchange(ready, to, lambda i, j: secs[i], self.inst_out, self.daemon_in, latency)

    def combine(self, done: list[float], to: list[list[int]], secs: list[float], latency: float) -> list[float]:
        """Daemon j, done at ``done[j]``, answers each instance of ``to[j]`` with a message of that
        instance's ``secs[i]``: when each instance has all its answers (``-inf``: none)."""
        return _exchange(done, to, lambda j, i: secs[i], self.daemon_out, self.inst_in, latency)


def _exchange(ready, to, secs, out, inn, latency) -> list[float]:
    """Sender a's messages (ready at ``ready[a]``, to each b of ``to[a]``, ``secs(a, b)`` each) through
    the senders' ``out`` and the receivers' ``inn`` ports, in the order they are ready: when each
    receiver has its last one."""
    got = [float("-inf")] * len(inn)
    for a in sorted(range(len(ready)), key=ready.__getitem__):
        for b in to[a]:
            end = max(ready[a], out[a], inn[b]) + secs(a, b)
            out[a] = inn[b] = end
            if end + latency > got[b]:
                got[b] = end + latency
    return got
