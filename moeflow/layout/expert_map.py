"""Where every physical expert slot is: per MoE layer, per expert-holding device, the logical
expert each of its slots holds. Pure Python (the simulator prices the very same map).

A device has the same number of slots in every layer (its weight buffers are sized once); what a
slot holds may differ by layer and change at a rebalance. A logical expert held by several slots
is *replicated*: a token routed to it goes to one replica (``workers/dispatch.ExpertRoutes``), so the replicas share its
load. Physical slot ids number the slots device by device: device 0's first, then device 1's.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError

Layer = tuple[tuple[int, ...], ...]  # [device] -> logical expert of each of its slots


def slot_counts(num_slots: int, num_devices: int) -> tuple[int, ...]:
    """Slots per device for ``num_slots`` physical experts: contiguous shares, so E + R need not
    divide by the number of devices (the later devices take one more)."""
    if num_devices > num_slots:
        raise ConfigError(f"{num_devices} expert devices for {num_slots} expert slots: some would hold none")
    return tuple((d + 1) * num_slots // num_devices - d * num_slots // num_devices for d in range(num_devices))


@dataclass(frozen=True)
class ExpertMap:
    layers: tuple[Layer, ...]  # [moe layer][device] -> logical ids of its slots
    num_experts: int

    def __post_init__(self) -> None:
        layers = tuple(tuple(tuple(int(e) for e in ids) for ids in layer) for layer in self.layers)
        object.__setattr__(self, "layers", layers)  # lists from JSON or numpy, frozen as tuples of ints
        if not layers or not layers[0]:
            raise ConfigError("an expert map needs at least one layer and one device")
        counts = tuple(len(ids) for ids in layers[0])
        for i, layer in enumerate(layers):
            if tuple(len(ids) for ids in layer) != counts:
                raise ConfigError(f"expert map: layer {i} has slots per device {[len(x) for x in layer]}, "
                                  f"layer 0 has {list(counts)}: a device holds as many slots in every layer")
            held = {e for ids in layer for e in ids}
            bad = sorted(e for e in held if not 0 <= e < self.num_experts)
            if bad:
                raise ConfigError(f"expert map: layer {i} names experts {bad} outside [0, {self.num_experts})")
            missing = sorted(set(range(self.num_experts)) - held)
            if missing:
                raise ConfigError(f"expert map: layer {i} leaves experts {missing} in no slot")

    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int, num_layers: int, num_redundant: int = 0) -> "ExpertMap":
        """Device d holds the d-th contiguous share of every layer's slots; slot p holds expert
        p mod E, so the R redundant slots (the last ones) replicate experts 0..R-1: the placement
        before any load is known."""
        if num_redundant < 0:
            raise ConfigError(f"num_redundant_experts must be >= 0, got {num_redundant}")
        counts, start, layer = slot_counts(num_experts + num_redundant, num_devices), 0, []
        for c in counts:
            layer.append(tuple(p % num_experts for p in range(start, start + c)))
            start += c
        return cls((tuple(layer),) * num_layers, num_experts)

    @classmethod
    def from_physical(cls, phy2log: list[list[int]], counts: tuple[int, ...], num_experts: int) -> "ExpertMap":
        """From each layer's physical-to-logical list (device-major) and the slots per device."""
        layers = []
        for row in phy2log:
            out, s = [], 0
            for c in counts:
                out.append(tuple(row[s:s + c]))
                s += c
            layers.append(tuple(out))
        return cls(tuple(layers), num_experts)

    # --- shape ---------------------------------------------------------------------------------

    num_layers = property(lambda self: len(self.layers))
    num_devices = property(lambda self: len(self.layers[0]))
    slots_per_device = property(lambda self: tuple(len(ids) for ids in self.layers[0]))
    num_slots = property(lambda self: sum(self.slots_per_device))
    num_redundant = property(lambda self: self.num_slots - self.num_experts)

    def __len__(self) -> int:
        return self.num_devices

    def physical(self, layer: int) -> list[int]:
        """Layer ``layer``'s physical-to-logical list (device-major)."""
        return [e for ids in self.layers[layer] for e in ids]

    def replicas(self, layer: int) -> list[list[int]]:
        """[logical expert] -> its physical slot ids in ``layer``, in slot order."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.physical(layer)):
            out[e].append(p)
        return out

    def device_of_slot(self) -> list[int]:
        return [d for d, c in enumerate(self.slots_per_device) for _ in range(c)]

    # --- load ----------------------------------------------------------------------------------

    def device_load(self, load: list[list[float]]) -> list[list[float]]:
        """[layer][device] expected load when each logical expert's ``load[layer][e]`` is split
        evenly over its replicas (what ``ExpertRoutes`` does, to within one per copy)."""
        dev = self.device_of_slot()
        out = []
        for l in range(self.num_layers):
            reps = self.replicas(l)
            row = [0.0] * self.num_devices
            for e, ps in enumerate(reps):
                for p in ps:
                    row[dev[p]] += load[l][e] / len(ps)
            out.append(row)
        return out

    def balancedness(self, load: list[list[float]]) -> list[float]:
        """Per layer: mean / max load across devices (1.0: perfectly balanced; vLLM's metric)."""
        return [balancedness(row) for row in self.device_load(load)]

    def moves(self, new: "ExpertMap") -> list[tuple[int, int, int, int]]:
        """What changes from this map to ``new``: (layer, device, slot, new logical expert) for every
        slot whose expert differs (the weights a rebalance must bring in)."""
        if new.slots_per_device != self.slots_per_device or new.num_layers != self.num_layers:
            raise ConfigError(f"expert maps differ in shape: slots per device {self.slots_per_device} x "
                              f"{self.num_layers} layers vs {new.slots_per_device} x {new.num_layers}")
        return [(l, d, s, e) for l in range(self.num_layers) for d in range(self.num_devices)
                for s, e in enumerate(new.layers[l][d]) if self.layers[l][d][s] != e]


def balancedness(device_loads: list[float]) -> float:
    """mean / max of per-device loads; 1.0 for an idle layer."""
    top = max(device_loads, default=0.0)
    return sum(device_loads) / len(device_loads) / top if top > 0 else 1.0

