"""AFD's FFN daemon: stateless, experts only. Its loop: receive one (layer, micro-batch) from every
attention instance it serves -> one expert batch over all their tokens -> send each its rows.

It holds no request, KV cache or scheduler and never talks to the engine about work (the control
pipe carries only shutdown and trace requests). Aggregating the instances' tokens into one
grouped GEMM per projection is the point of AFD: the experts see M times the tokens of one
instance's micro-batch. With the router on the daemon (``router="ffn"``) it also holds the gates,
routes the token rows itself and sends back each token's weighted sum over its local experts.

Legend: N rows over all served instances, H hidden, El local experts, K experts per token.
"""
from __future__ import annotations

import time

import torch

from moeflow.membership_messages import InstancesServed, ServeInstances
from moeflow.messages import MoveExperts, WorkerSetup
from moeflow.workers.control import LockedConn, serve_control
from moeflow.model.moe import ExpertWeights, experts_grouped, plan_pairs, weighted_sum
from moeflow.model.gate import GateKind, GateWeights, gate_for
from moeflow.model.weights import TORCH_DTYPES, LoadSpec, load_weights
from moeflow.workers.afd_connector import FfnConnector, FfnInput
from moeflow.workers.dispatch import ExpertRoutes, untag_layer
from moeflow.workers.expert_slots import begin_join, worker_slots
from moeflow.workers.tracer import Tracer

_POLL_S = 0.25  # longest a blocking receive lasts before the control pipe is looked at again


def ffn_pairs(experts: ExpertWeights, layer: int, inp: FfnInput, order: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Router on the attention side: rows arrive grouped by local expert per instance; run them as
    one batch grouped by expert across instances, return each instance's rows in its own order."""
    xs = [inp.payloads[i] for i in order]
    x = torch.cat(xs)  # [N, H]
    el = experts.num_local
    dev = x.device
    # NOTE: the counts came in the headers: known on the host, nothing of the rows is read back
    per = [list(inp.control.tokens_per_expert[i][:el]) for i in order]  # [I][El]
    expert_of_row = torch.repeat_interleave(torch.arange(el, device=dev).repeat(len(order)),
                                            torch.tensor(per, dtype=torch.int64, device=dev).reshape(-1),
                                            output_size=x.shape[0])  # [N]
    perm = torch.argsort(expert_of_row, stable=True)
    counts = torch.tensor([sum(p[e] for p in per) for e in range(el)], dtype=torch.int64, device=dev)  # [El]
    y = experts_grouped(experts, layer, x[perm], counts)
    out = torch.empty_like(y)
    out[perm] = y
    return dict(zip(order, out.split([t.shape[0] for t in xs])))


def ffn_tokens(experts: ExpertWeights, layer: int, kind: GateKind, gate: GateWeights, inp: FfnInput,
               order: tuple[int, ...], routes: ExpertRoutes | None = None, me: int = 0) -> dict[int, torch.Tensor]:
    """Router on the daemon: token rows arrive; route them, run the local experts' pairs, return
    each token's weighted sum over them (a partial sum when the experts are split over daemons).
    ``routes``: the daemons' placement, where a replicated expert's pairs go to one daemon only
    (every daemon concatenates the same instances' rows in the same order, so all choose alike)."""
    xs = [inp.payloads[i] for i in order]
    x = torch.cat(xs)  # [N, H]
    ids, wts = kind(x, gate)  # [N, K]
    plan = plan_pairs(ids, experts) if routes is None else routes.local_plan(ids, me)
    y = experts_grouped(experts, layer, x[plan.token_index], plan.counts)
    out = weighted_sum(x.shape[0], plan, y, wts)  # [N, H]
    return dict(zip(order, out.split([t.shape[0] for t in xs])))


class FfnDaemon:
    kv_region = None  # it holds no KV cache (stateless)

    def __init__(self, setup: WorkerSetup, transport):
        layout, j = setup.layout, setup.index
        self.setup, self.index = setup, j
        self.routes_here = layout.router == "ffn"
        join = setup.join  # joining a serving deployment: its experts come from its peers, not the checkpoint
        cfg, w = load_weights(setup.model_path, TORCH_DTYPES[setup.engine.dtype],
                              LoadSpec(attention=False, experts=None if join else setup.held_by(j),
                                       gates=self.routes_here, routed_experts=join is None),
                              setup.device, setup.engine.router_skew)
        self.gates, self.num_experts = w.gates, cfg.num_experts
        self.gate_kind = gate_for(cfg)
        self.moe_index = {lid: i for i, lid in enumerate(l for l in range(cfg.num_layers) if cfg.sparse_layers[l])}
        self._routes: dict[tuple, ExpertRoutes] = {}  # per placement of a layer (router on the daemon)
        self.connector = FfnConnector(transport, j, layout.served_by(j))
        self.tracer = Tracer("ffn", j, setup.engine.trace)
        self.slots = worker_slots(setup, transport, cfg, w.experts, self.tracer)

    def routes(self, word: int, layer: int) -> ExpertRoutes | None:
        """The daemons' placement of ``layer`` as routed (None with topology "block": each daemon has
        its own instances and every expert, so it computes all their pairs)."""
        if self.setup.layout.topology != "all":
            return None
        layers = getattr(self.slots, "layers", None)
        i = self.moe_index[layer]
        held = self.setup.placement(i) if layers is None else layers[untag_layer(word)[1]][i]
        if held not in self._routes:
            self._routes[held] = ExpertRoutes(held, self.num_experts, device=self.slots.shape().w13.device)
        return self._routes[held]

    @torch.inference_mode()
    def run(self, inp: FfnInput) -> dict[int, torch.Tensor]:
        order, word = self.connector.served, inp.control.layer
        layer, experts = self.slots.for_word(word)
        if self.routes_here:
            return ffn_tokens(experts, layer, self.gate_kind, self.gates[layer], inp, order, self.routes(word, layer),
                              self.index)
        return ffn_pairs(experts, layer, inp, order)

    def turn(self) -> None:
        t0 = time.monotonic()
        inp = self.connector.recv_attn_output(_POLL_S)
        if inp is None:
            return
        t1 = time.monotonic()
        out = self.run(inp)
        t2 = time.monotonic()
        self.connector.send_ffn_output(inp, out)
        t3 = time.monotonic()
        c, layer = inp.control, untag_layer(inp.control.layer)[0]
        self.tracer.add("recv", t0, t1, layer=layer)
        self.tracer.add("experts", t1, t2, layer=layer, tokens=sum(c.rows.values()))
        self.tracer.add("combine-send", t2, t3, layer=layer)

    def serve(self, conn) -> None:
        conn = LockedConn(conn)  # the expert mover reports from its thread

        def on_message(msg) -> None:
            if isinstance(msg, MoveExperts):
                self.slots.begin(msg, conn.send)
            elif isinstance(msg, ServeInstances):  # between steps: the engine waits for the answer
                self.connector.serve(tuple(range(msg.count)))
                conn.send(InstancesServed("ffn", self.index, msg.count))

        begin_join(self.slots, self.setup, conn.send)  # joining: its slots come from its peers

        def turn() -> bool:
            self.slots.check()
            self.turn()
            return True
        serve_control(conn, "ffn", self.index, self.tracer, on_message, turn=turn)

    def memory(self) -> dict[str, int]:
        gates = sum(g.weight.nbytes + (0 if g.bias is None else g.bias.nbytes) for g in self.gates.values())
        return {"routed_experts": self.slots.nbytes(), "gates": gates}

    def close(self) -> None:
        self.connector.close()
        self.slots.close()
