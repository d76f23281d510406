"""Expert-parallel load balancing (DeepSeek-V3 §3.4's redundant experts, the EPLB algorithm as
DeepSeek describes it): from each layer's per-expert load, choose which experts get extra replicas
and pack all replicas onto the expert devices so that the most loaded device carries as little as
possible. Pure Python, no torch: the engine and the simulator place experts with this one function.

Two policies:

- ``hierarchical`` (the number of nodes divides the number of expert groups): pack the expert
  groups onto nodes, balancing the nodes' loads; replicate the hottest experts inside each node;
  pack each node's replicas onto its devices. A token's experts stay within the nodes of its
  groups (DeepSeek-V3's group-limited routing), so replicas never add inter-node traffic.
- ``global``: one group, one node: replicate over all slots, pack over all devices.

Replication is greedy: the next replica goes to the expert with the highest load per replica.
Packing is greedy too: items heaviest first, each onto the least loaded device that has a free
slot (ties: the lowest index), preferring a device that does not hold the expert yet.
"""
from __future__ import annotations

from moeflow.config import ConfigError
from moeflow.layout.expert_map import ExpertMap, slot_counts

POLICIES = ("auto", "hierarchical", "global")


def pack(weights: list[float], capacities: list[int], labels: list[int] | None = None) -> list[tuple[int, int]]:
    """Each item's (pack, rank in pack): heaviest first onto the least loaded pack with room.
    ``labels``: items with equal labels avoid sharing a pack while another pack has room."""
    if sum(capacities) != len(weights):
        raise ConfigError(f"packing {len(weights)} items into packs of {capacities} slots")
    load, used = [0.0] * len(capacities), [0] * len(capacities)
    holds: list[set[int]] = [set() for _ in capacities]
    out: list[tuple[int, int]] = [(-1, -1)] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):  # stable: equal loads keep their order
        room = [p for p in range(len(capacities)) if used[p] < capacities[p]]
        if labels is not None:
            room = [p for p in room if labels[i] not in holds[p]] or room
        p = min(room, key=load.__getitem__)
        out[i] = (p, used[p])
        load[p] += weights[i]
        used[p] += 1
        if labels is not None:
            holds[p].add(labels[i])
    return out


def replicate(weights: list[float], num_slots: int) -> list[int]:
    """Logical expert of each of ``num_slots`` replicas: one each in order, then each extra replica
    to the expert with the highest load per replica (ties: the lowest id)."""
    if num_slots < len(weights):
        raise ConfigError(f"{num_slots} slots cannot hold {len(weights)} experts once each")
    count = [1] * len(weights)
    out = list(range(len(weights)))
    for _ in range(num_slots - len(weights)):
        e = max(range(len(weights)), key=lambda i: weights[i] / count[i])
        out.append(e)
        count[e] += 1
    return out


def _layer(weights: list[float], num_groups: int, num_nodes: int, dev_counts: tuple[int, ...]) -> list[int]:
    """One layer's physical-to-logical list (device-major) under the hierarchical policy."""
    e = len(weights)
    gsize, nd = e // num_groups, len(dev_counts) // num_nodes
    groups = [sum(weights[g * gsize:(g + 1) * gsize]) for g in range(num_groups)]
    node_of = pack(groups, [num_groups // num_nodes] * num_nodes)
    out: list[int] = []
    for node in range(num_nodes):
        mine = sorted((g for g in range(num_groups) if node_of[g][0] == node), key=lambda g: node_of[g][1])
        experts = [g * gsize + i for g in mine for i in range(gsize)]  # the node's experts, in pack order
        devs = dev_counts[node * nd:(node + 1) * nd]
        reps = replicate([weights[x] for x in experts], sum(devs))
        copies = [reps.count(i) for i in range(len(experts))]
        per_replica = [weights[experts[i]] / copies[i] for i in reps]
        slots: list[list[int]] = [[] for _ in devs]
        placed = pack(per_replica, list(devs), labels=reps)
        for r in sorted(range(len(reps)), key=lambda r: placed[r]):
            slots[placed[r][0]].append(experts[reps[r]])
        out += [x for s in slots for x in s]
    return out


def rebalance(load: list[list[float]], num_devices: int, num_redundant: int = 0, num_groups: int = 1,
              num_nodes: int = 1, policy: str = "auto", current: ExpertMap | None = None) -> ExpertMap:
    """The placement of E + ``num_redundant`` slots per layer over ``num_devices`` expert devices
    (on ``num_nodes`` hosts) for ``load`` [layer][expert] (tokens, or any non-negative weight).

    ``auto`` is hierarchical where the nodes divide the groups and each node's devices hold whole
    groups, else global (DeepSeek's rule). With ``current`` (the placement serving now), a layer
    whose most loaded device would not get lighter keeps its placement, and a layer that changes
    is laid over the current one so that as few slots as possible change expert (fewer weights
    to move)."""
    if not load or not load[0]:
        raise ConfigError("rebalance needs a load for at least one layer and one expert")
    e = len(load[0])
    if num_redundant < 0:
        raise ConfigError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if policy not in POLICIES:
        raise ConfigError(f"eplb policy must be one of {POLICIES}, got {policy!r}")
    if any(len(row) != e or any(x < 0 for x in row) for row in load):
        raise ConfigError(f"rebalance: every layer needs {e} non-negative loads")
    counts = slot_counts(e + num_redundant, num_devices)
    fits = (num_groups > 0 and e % num_groups == 0 and num_groups % num_nodes == 0 and num_devices % num_nodes == 0
            and len({sum(counts[n * (num_devices // num_nodes):(n + 1) * (num_devices // num_nodes)])
                     for n in range(num_nodes)}) == 1)
    if policy == "hierarchical" and not fits:
        raise ConfigError(f"hierarchical placement needs the {num_nodes} nodes to divide the {num_groups} expert "
                          f"groups (of {e} experts) and the {num_devices} devices, with equal slots per node")
    if policy == "global" or not fits:
        num_groups = num_nodes = 1
    per_node = (e + num_redundant) // num_nodes
    if per_node < e // num_nodes:
        raise ConfigError(f"{e + num_redundant} slots on {num_nodes} nodes cannot hold each node's experts once")
    phy = [_layer([float(x) for x in row], num_groups, num_nodes, counts) for row in load]
    new = ExpertMap.from_physical(phy, counts, e)
    if current is None:
        return new
    if (current.slots_per_device, current.num_layers, current.num_experts) != (counts, len(load), e):
        raise ConfigError(f"rebalance: the current placement has {current.slots_per_device} slots per device over "
                          f"{current.num_layers} layers of {current.num_experts} experts; the new one "
                          f"{counts} over {len(load)} layers of {e}")
    now, then = current.device_load(load), new.device_load(load)
    layers = tuple(current.layers[l] if max(then[l]) >= max(now[l]) * (1 - 1e-9)
                   else _align(new.layers[l], current.layers[l], num_devices // num_nodes) for l in range(len(load)))
    return ExpertMap(layers, e)


def _align(new: tuple[tuple[int, ...], ...], old: tuple[tuple[int, ...], ...], node_size: int) -> tuple:
    """``new``'s device sets given to the devices (of the same node, with as many slots) that hold
    most of them already, each kept expert in its old slot."""
    out: list[tuple[int, ...]] = [()] * len(old)
    for n0 in range(0, len(old), node_size):
        devs = range(n0, n0 + node_size)
        pairs = sorted(((len(set(new[a]) & set(old[b])), a, b) for a in devs for b in devs
                        if len(new[a]) == len(old[b])), key=lambda t: (-t[0], t[1], t[2]))
        free_new, free_old = set(devs), set(devs)
        for _, a, b in pairs:
            if a in free_new and b in free_old:
                out[b] = _keep_slots(new[a], old[b])
                free_new.discard(a)
                free_old.discard(b)
    return tuple(out)


def _keep_slots(new: tuple[int, ...], old: tuple[int, ...]) -> tuple[int, ...]:
    """``new``'s experts in ``old``'s slots: an expert already in a slot stays there."""
    rest = list(new)
    slots: list[int | None] = []
    for e in old:
        if e in rest:
            rest.remove(e)
            slots.append(e)
        else:
            slots.append(None)
    return tuple(rest.pop(0) if x is None else x for x in slots)



def resize(current: ExpertMap, num_devices: int, load: list[list[float]] | None = None) -> ExpertMap:
    """The placement after the expert devices change from ``current.num_devices`` to ``num_devices``
    (an elastic deployment's daemons or expert ranks joining or leaving), moving as few weights as
    the change needs: devices keep their index and their slot count (buffers are sized once);
    devices that join take the last device's count and fill it with replicas, the expert with the
    most ``load`` per copy first (uniform without a load); the last devices leave, and each expert
    only they held takes, on a survivor, the slot of the expert with the least load per copy that
    has copies to spare. Surviving slots otherwise keep their experts; a rebalance may refine later."""
    old = current.slots_per_device
    if num_devices < 1:
        raise ConfigError(f"resize: at least one expert device, got {num_devices}")
    counts = resized_counts(old, num_devices)
    e = current.num_experts
    if sum(counts) < e:
        raise ConfigError(f"resize: {num_devices} expert devices of {list(counts)} slots hold {sum(counts)} experts, "
                          f"fewer than the model's {e}")
    if slot_counts(sum(counts), num_devices) != counts:
        raise ConfigError(f"resize: devices of {list(old)} slots cannot become {num_devices} devices of equal shares")
    load = load if load and any(any(row) for row in load) else [[1.0] * e for _ in range(current.num_layers)]
    return ExpertMap(tuple(_resized(list(map(list, layer[:num_devices])), counts, [float(x) for x in w])
                           for layer, w in zip(current.layers, load)), e)


def resized_counts(slots: tuple[int, ...], num_devices: int) -> tuple[int, ...]:
    """Slots per device after ``num_devices``: devices keep theirs, joiners take the last one's."""
    return slots[:num_devices] + (slots[-1],) * max(0, num_devices - len(slots))


def _resized(devices: list[list[int]], counts: tuple[int, ...], load: list[float]) -> tuple:
    copies = [0] * len(load)
    for ids in devices:
        for x in ids:
            copies[x] += 1
    for x in sorted((x for x in range(len(load)) if not copies[x]), key=lambda x: -load[x]):  # held by leavers only
        d, slot = min(((d, k) for d, ids in enumerate(devices) for k, y in enumerate(ids) if copies[y] > 1),
                      key=lambda dk: load[devices[dk[0]][dk[1]]] / copies[devices[dk[0]][dk[1]]])
        copies[devices[d][slot]] -= 1
        devices[d][slot], copies[x] = x, 1
    for c in counts[len(devices):]:  # joiners: replicas, hottest per copy first, one copy per device where it can
        ids: list[int] = []
        for _ in range(c):
            x = max(range(len(load)), key=lambda x: (x not in ids, load[x] / (copies[x] + 1), -x))
            ids.append(x)
            copies[x] += 1
        devices.append(ids)
    return tuple(tuple(ids) for ids in devices)
