"""ProfiledCost: the cost model read off tables ``moeflow profile`` measured on the real engine.

Attention is the profile's fit over (tokens, pairs, sequences) for prompt rows, and over (sequences,
cached keys) for decode rows (one new token after a context: the engine's decode kernel, whose cost
per key is not a prefill pair's); experts interpolate the measured time against routed pairs for the
number of local experts a device holds (the plateau and the linear growth are whatever was measured).

Transport: what lone requests through the real asap and dep deployments spent beyond the sum of
their stages. A decode step moves almost no bytes, so what its inter-token time has beyond its
stages, per message, is the latency; the bandwidth is then what prompts of 128-4096 tokens spent
beyond their stages and those latencies. (A profile without decode samples fits both from the
prompts alone, where a constant per request cannot be told from a constant per message: the first
profiles charged ~8 ms per message, 131 ms per step, which a 160-ms decode step shows is wrong.)
The model's byte sizes are the profile's dtype (``ModelSpec.at_dtype``), and a memory plan counts
the engine's communication buffers (``engine_buffers``).
"""
from __future__ import annotations

import bisect
import json
import statistics

import numpy as np

from moeflow.sim.cost import CostModel
from moeflow.sim.hardware import CPU_HERE_JITTER_CV
from moeflow.sim.expert_load import ExpertLoads
from moeflow.sim.jitter import Jitter
from moeflow.sim.model_spec import ModelSpec
from moeflow.sim.shape import AttnShape


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points; linear beyond the last two; clamped below."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    i = min(bisect.bisect_left(xs, x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def fit_nonneg(rows: list[list[float]], y: list[float], relative: bool = False) -> list[float]:
    """Least squares with every coefficient >= 0 (drop the most negative one and refit).
    ``relative``: on relative errors (each row weighted by 1/y), for samples spanning decades, where
    plain least squares serves only the largest."""
    a, b = np.asarray(rows, float), np.asarray(y, float)
    if relative:
        a, b = a / b[:, None], np.ones_like(b)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))



class ProfiledCost(CostModel):
    engine_buffers = True  # the real engine's memory plan: its communication buffers count

    def __init__(self, model: ModelSpec, profile: dict):
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"profile of {profile.get('model')!r}: {msg}")

        for key in ("num_layers", "num_experts", "top_k", "hidden_size"):
            need(profile.get(key) == getattr(model, key),
                 f"{key} {profile.get(key)} does not match model preset {model.name!r} ({getattr(model, key)})")
        self.model = model.at_dtype(profile["dtype"]) if profile.get("dtype") else model
        self.attn = profile["attention"]["fit"]
        # the stage costs are one process on one core of the profiled machine, whose cores all share
        self.shared_cores = (profile.get("provenance") or {}).get("cores")
        need(self.shared_cores is None or (isinstance(self.shared_cores, int) and self.shared_cores >= 1),
             f"provenance cores must be an int >= 1, got {self.shared_cores!r}")
        self.decode = (profile.get("decode") or {}).get("fit")  # None: decode rows priced as prompt rows
        self.head = profile["head"]["fit"]
        self._jitter_cv = float(profile.get("compute_jitter_cv", CPU_HERE_JITTER_CV))
        self.experts_table = {int(k): sorted((float(n), float(s)) for n, s in v) for k, v in profile["experts"].items()}
        self.transport = {name: self._transport(e["samples"], name, e["layout"], e.get("decode_samples", []))
                          for name, e in profile.get("engine", {}).items()}
        need("asap" in self.transport and "dep" in self.transport,
             "no engine samples (was it written with --quick?): transport costs are unknown")

    @property
    def compute_jitter_cv(self) -> float:
        return self._jitter_cv

    @classmethod
    def load(cls, model: ModelSpec, path: str) -> "ProfiledCost":
        with open(path) as f:
            return cls(model, json.load(f))

    # -- stages -------------------------------------------------------------------------------

    def attention_s(self, shape, tp, dense_layer):
        if shape.num_tokens == 0:
            return 0.0
        a, d = self.attn, self.decode
        dseqs, dkeys = (shape.num_decode_seqs, shape.num_decode_keys) if d else (0, 0)
        if dseqs == shape.num_seqs:  # a pure decode batch
            return d["c0"] + (d["per_seq"] * dseqs + d["per_key"] * dkeys) / tp
        # decode rows' pairs are their keys (one query each)
        prompt = (a["per_token"] * (shape.num_tokens - dseqs) + a["per_pair"] * (shape.num_pairs - dkeys)
                  + a["per_seq"] * (shape.num_seqs - dseqs))
        decode = d["per_seq"] * dseqs + d["per_key"] * dkeys if dseqs else 0.0
        return a["c0"] + (prompt + decode) / tp

    def experts_s(self, num_routed, num_local_experts):
        if num_routed <= 0:
            return 0.0
        if num_local_experts not in self.experts_table:
            raise ValueError(f"the profile measured experts for {sorted(self.experts_table)} local experts, "
                             f"not {num_local_experts}")
        return interpolate(self.experts_table[num_local_experts], num_routed)

    def head_s(self, shape, tp):
        h = self.head
        return h["c0"] + h["per_token"] * shape.num_tokens + h["per_sampled"] * shape.num_sampled

    # -- transport ----------------------------------------------------------------------------

    def _stages_s(self, start: int, n: int, local: int, tokens_share: float, slowest: float = 1.0) -> float:
        """The sum of the stages of a lone request's step computing ``n`` tokens after ``start`` cached
        ones (the experts see ``tokens_share`` of them; the layer waits for the slowest of the expert
        devices, ``slowest`` times their mean under the simulator's jitter)."""
        m = self.model
        shape = AttnShape.of([(start, n, True)])
        experts = self.experts_s(max(1, round(n * m.top_k * tokens_share)), local)
        layer = self.attention_s(shape, 1, False) + slowest * experts
        return self.head_s(shape, 1) + m.num_layers * layer

    def _transport(self, samples: list[dict], name: str, layout: dict,
                   decode_samples: list[dict]) -> tuple[float, float]:
        """(latency per message, bytes per second) from lone requests: per layer, a step pays two
        messages (dispatch, combine) and their bytes beyond what its stages took."""
        m = self.model
        if name == "asap":
            workers = layout.get("moe_workers", 1)
            local, share, moved = m.num_experts // workers, 1 / workers, 1.0
        else:
            dp = layout.get("dp", 1)
            local, share, moved = m.num_experts // dp, 1 / dp, (dp - 1) / dp

        def step_bytes(n: int) -> float:
            return m.num_layers * (self.dispatch_bytes(n) + self.combine_bytes(n)) * moved

        messages = 2 * m.num_layers
        # what the simulator adds at the expert devices' barrier is not transport: the most loaded
        # device's share (sim/expert_load.py, the model's gate skew) and the slowest one's jitter
        n = round(1 / share)
        skew = ExpertLoads(m.num_experts, m.num_moe_layers, n, m.gate_load_cv).share_imbalance
        slowest = skew * Jitter(self._jitter_cv, 0).expected_max(n)
        extra = [(s["ttft_s"] - self._stages_s(0, s["prompt_len"], local, share, slowest), step_bytes(s["prompt_len"]))
                 for s in samples]
        if not decode_samples:
            latency, s_per_byte = fit_nonneg([[messages, b] for _, b in extra], [e for e, _ in extra])
            return latency, (1 / s_per_byte if s_per_byte > 0 else float("inf"))
        decode = [d["tpot_s"] - self._stages_s(d["context"], 1, local, share, slowest) for d in decode_samples]
        s_per_byte = 0.0
        for _ in range(4):  # a decode step's few bytes at the prompts' rate; converges at once
            latency = max(0.0, statistics.median((e - step_bytes(1) * s_per_byte) / messages for e in decode))
            (s_per_byte,) = fit_nonneg([[b] for _, b in extra], [e - messages * latency for e, _ in extra])
        return latency, (1 / s_per_byte if s_per_byte > 0 else float("inf"))

    def transfer_s(self, nbytes):
        latency, bw = self.transport["asap"]
        return latency + nbytes / bw

    def all_to_all_s(self, nbytes):
        latency, bw = self.transport["dep"]
        return latency + nbytes / bw

    def all_to_all_s_many(self, nbytes):
        latency, bw = self.transport["dep"]
        return latency + np.asarray(nbytes, dtype=float) / bw

    def device_copy_s(self, nbytes):
        return self.transfer_s(nbytes)  # a shared-memory transfer here is a memcpy too

    def kv_handoff_s(self, nbytes):
        # the engine's pd deployment reads the prefill side's blocks in place: one copy, into the decode side
        return 0.0, self.device_copy_s(nbytes)

    @property
    def link_bw_Bps(self):
        return self.transport["asap"][1]

    @property
    def host_dispatch_s(self):
        return 0.0
