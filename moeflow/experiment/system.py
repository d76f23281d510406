"""One ``systems:`` entry of an experiment file, as the engine and the simulator both read it: a layout
(``moeflow.layout``: ``mode`` and that mode's fields, the scheduler's accepted flat), the engine's
settings (``engine:``) and the simulator's modelling choices (``sim:``). Pure Python.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from moeflow.autoscale_config import AutoscalePolicy, EpAutoscalePolicy, PdAutoscalePolicy, policy_from
from moeflow.config import DTYPES, ConfigError, EngineConfig
from moeflow.layout import Layout, layout_from_dict, layout_to_dict

ENGINE_KEYS_ELSEWHERE = ("model", "dtype")  # set once for the whole experiment
EXPERT_PLACEMENTS = ("contiguous", "eplb")
DSA_ATTENTION = ("mqa", "mha_short_batch", "mha_short_seqs")
ATTENTION_PARALLEL = ("tensor", "sequence")
# the roles a deployment may put on hardware of their own (the simulator's presets): the sides of
# a disaggregation, where no process does both (FastAFD §2: memory-rich devices for attention,
# compute-dense ones for the FFN; prefill and decode likewise); "all" in every mode moves the whole
# deployment (a baseline on other hardware in the same run)
HARDWARE_ROLES = {"afd": ("attention", "ffn"), "pd": ("prefill", "decode")}


@dataclass(frozen=True)
class SimOptions:
    """Modelling choices only the simulator has (the engine always does the real thing). Defaults
    are ASAP's stated setup where the paper states one; docs/simulator.md gives each one's source."""

    super_kernel: bool = True  # layer-oblivious MoE kernel; False pays host_dispatch_s per MoE layer
    # whether the device runs the layout's communication threads/streams concurrently with its
    # compute; False where they share one CPU core with the experts (this machine)
    comm_overlap: bool = True
    # Expert-load skew (sim/expert_load.py). 0: every expert device gets exactly its share of every
    # layer's (token, expert) pairs (ASAP Fig. 3b's "perfect expert load balancing"). > 0: per MoE
    # layer, expert popularity ~ Dirichlet with this coefficient of variation across experts, each
    # batch's pairs ~ Multinomial over the devices; every all-to-all and MoE step is priced by its
    # most loaded receiver.
    expert_load_cv: float | None = None  # None: the model's gate_load_cv (sim/model_spec.py, cited there)
    expert_placement: str = "contiguous"  # or "eplb": DeepSeek-V3 §3.4, one redundant expert per device
    expert_seed: int = 0  # popularity and per-batch draws (the same popularity for every system)
    # DSA's core attention (sim/attention_cost.py): "mqa" absorbed MLA over the selected keys at every
    # length (vllm-ascend SFA, CANN's DeepSeek-V3.2 recipe); "mha_short_batch" masked MHA for a batch
    # whose longest context <= index_topk (SGLang); "mha_short_seqs" the same decided per sequence
    dsa_attention: str = "mqa"
    # under attention TP the MLA down-projections and the DSA indexer run on every TP rank (vLLM,
    # SGLang, vllm-ascend shard DeepSeek so); False: everything split T ways
    tp_replicates: bool = True
    # how an attention group's T devices share a batch (sim/attention_cost.py): "tensor" splits the
    # heads (an all-reduce per layer); "sequence" gives each device S/T of the batch's tokens (ASAP §4.2)
    attention_parallel: str = "tensor"
    # per device and layer, the coefficient of variation of its compute time at equal work (sim/jitter.py);
    # a barrier waits for the slowest device. None: the hardware's (its source in sim/hardware.py)
    compute_jitter_cv: float | None = None
    # dwdp: "memory" holds as many experts per rank as the engine's memory budget allows beside one
    # batch's KV (DWDP §2), fewer to pull; "layout": the layout's experts_per_rank
    resident_experts: str = "layout"
    a2a_bw_GBps: float | None = None  # the baselines' all-to-all (None: the hardware preset's a2a_bw_Bps)
    seed: int = 0  # the simulator's own random draws (dwdp: contention levels of naive pulls)
    # dep: the all-to-all sends a token once per remote device holding any of its experts (DeepEP's
    # layout) instead of once per (token, expert) pair (moeflow's engine)
    dedup_dispatch: bool = False
    # more worker processes than the profiled machine's cores: a compute stage waits for a free core
    # (sim/cores.py); False: every process computes as if it had a core of its own
    core_sharing: bool = True
    # requests arrive with their prompt's KV and first token, as on pd's decode side (the prefill ran
    # elsewhere and is not modelled); each waits, first come first served, for a group with KV room
    # (dep and afd: the step systems)
    decode_side: bool = False
    # an elastic system (``autoscale:``): a member that joins serves this long after it is asked for,
    # beyond copying its weights from its peers over the link. 3 s: vLLM's elastic EP scale-up once its
    # topology is pre-built (55 s up before that; docs/elastic.md cites both): a published input, not ours
    member_start_s: float = 3.0
    # choice -> the paper's text (or the engine's fact) that says this system differs from the others
    # of its run in that choice (sim/symmetry.py): a mapping in a config, kept as sorted pairs
    differs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"sim: {msg}")

        given = self.differs
        pairs = given.items() if isinstance(given, dict) else given
        need(all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs),
             f"differs must map a choice to its reason, got {given!r}")
        object.__setattr__(self, "differs", tuple(sorted((str(k), v) for k, v in pairs)))
        options = {f.name for f in dataclasses.fields(self)} - {"differs", "seed", "expert_seed"}
        for k, v in self.differs:
            need(k in options, f"differs: {k!r} is not a modelling choice (those: {sorted(options)})")
            need(isinstance(v, str) and v.strip() != "", f"differs.{k}: give the text that says why, got {v!r}")

        for f in ("super_kernel", "comm_overlap", "tp_replicates", "dedup_dispatch", "core_sharing", "decode_side"):
            need(isinstance(getattr(self, f), bool), f"{f} must be true or false, got {getattr(self, f)!r}")
        need(self.expert_load_cv is None or (isinstance(self.expert_load_cv, (int, float))
                                             and not isinstance(self.expert_load_cv, bool)
                                             and 0 <= self.expert_load_cv < 8),
             f"expert_load_cv must be in [0, 8) or null (the model's), got {self.expert_load_cv!r}")
        need(self.expert_placement in EXPERT_PLACEMENTS,
             f"expert_placement must be one of {EXPERT_PLACEMENTS}, got {self.expert_placement!r}")
        for f in ("expert_seed", "seed"):
            need(isinstance(getattr(self, f), int), f"{f} must be an integer, got {getattr(self, f)!r}")
        need(self.dsa_attention in DSA_ATTENTION,
             f"dsa_attention must be one of {DSA_ATTENTION}, got {self.dsa_attention!r}")
        need(self.attention_parallel in ATTENTION_PARALLEL,
             f"attention_parallel must be one of {ATTENTION_PARALLEL}, got {self.attention_parallel!r}")
        need(self.compute_jitter_cv is None or (isinstance(self.compute_jitter_cv, (int, float))
                                                and not isinstance(self.compute_jitter_cv, bool)
                                                and 0 <= self.compute_jitter_cv < 1),
             f"compute_jitter_cv must be in [0, 1) or null (the hardware's), got {self.compute_jitter_cv!r}")
        need(self.resident_experts in ("layout", "memory"),
             f"resident_experts must be 'layout' or 'memory', got {self.resident_experts!r}")
        need(isinstance(self.member_start_s, (int, float)) and not isinstance(self.member_start_s, bool)
             and self.member_start_s >= 0, f"member_start_s must be a number >= 0, got {self.member_start_s!r}")
        need(self.a2a_bw_GBps is None or (isinstance(self.a2a_bw_GBps, (int, float)) and self.a2a_bw_GBps > 0),
             f"a2a_bw_GBps must be a number > 0, got {self.a2a_bw_GBps!r}")


@dataclass(frozen=True)
class SystemSpec:
    """One system of an experiment: a layout, the engine's settings and the simulator's options."""

    name: str
    layout: Layout
    engine: EngineConfig  # the engine uses all of it; the simulator its KV-cache and sequence limits
    sim: SimOptions = field(default_factory=SimOptions)
    # role -> hardware preset, for the roles that differ from the experiment's hardware (sorted pairs)
    hardware: tuple[tuple[str, str], ...] = ()
    # afd: the controller's policy (scheduler/autoscale.py; POLICY.yaml's keys, sample_s included),
    # sorted pairs; the deployment starts at the layout's members and follows the controller's decisions
    autoscale: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        given = self.autoscale
        object.__setattr__(self, "autoscale", tuple(sorted((given.items() if isinstance(given, dict) else given))))
        if self.autoscale:
            check_autoscale(self)
        given = self.hardware
        pairs = given.items() if isinstance(given, dict) else given
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p)
                   for p in pairs):
            raise ConfigError(f"systems.{self.name}.hardware must map a role to a hardware preset, got {given!r}")
        object.__setattr__(self, "hardware", tuple(sorted((k, v) for k, v in pairs)))
        roles = ("all", *HARDWARE_ROLES.get(self.layout.mode, ()))  # all: every process of the deployment
        for role, _ in self.hardware:
            if role not in roles:
                raise ConfigError(
                    f"systems.{self.name}.hardware: {role!r} is not a role of mode {self.layout.mode!r} "
                    + (f"(its roles: {list(roles)})" if len(roles) > 1 else
                       f"(only 'all' here: roles of their own in modes {sorted(HARDWARE_ROLES)})"))

    def hardware_of(self, role: str) -> str | None:
        """The preset ``role`` runs on (None: the experiment's)."""
        d = dict(self.hardware)
        return d.get(role, d.get("all"))

    @property
    def kv_tokens_per_group(self) -> int:
        """KV-cache capacity of one attention group (or rank), in tokens."""
        return self.engine.num_kv_blocks * self.engine.kv_block_size


def autoscale_policy(spec: SystemSpec) -> tuple[AutoscalePolicy | PdAutoscalePolicy | EpAutoscalePolicy, float]:
    """(the controller's policy, its sampling period) of an elastic system: pd's xPyD, dep's and dwdp's
    ranks, else afd's A:F."""
    cls = {"pd": PdAutoscalePolicy, "dep": EpAutoscalePolicy, "dwdp": EpAutoscalePolicy}.get(spec.layout.mode,
                                                                                          AutoscalePolicy)
    return policy_from(dict(spec.autoscale), f"systems.{spec.name}.autoscale", cls)


def check_autoscale(spec: SystemSpec) -> None:
    """An elastic system: afd (topology all), pd, dep or dwdp, a valid policy whose range holds the layout's start."""
    where, lay = f"systems.{spec.name}.autoscale", spec.layout
    if lay.mode == "pd":
        policy, _ = autoscale_policy(spec)
        if not (policy.min_prefill <= lay.prefill_instances <= policy.max_prefill
                and policy.min_decode <= lay.decode_instances <= policy.max_decode):
            raise ConfigError(f"{where}: the layout's start ({lay.prefill_instances} prefill, {lay.decode_instances} "
                              f"decode instances) is outside the policy's range")
        return
    if lay.mode in ("dep", "dwdp"):
        policy, _ = autoscale_policy(spec)
        if lay.max_dp is None or not policy.min_ranks <= lay.dp <= policy.max_ranks <= lay.max_dp:
            raise ConfigError(f"{where}: need min_ranks <= dp ({lay.dp}) <= max_ranks <= max_dp ({lay.max_dp}): "
                              f"the ranks join up to the deployment's max_dp")
        return
    if lay.mode != "afd" or getattr(lay, "topology", None) != "all":
        raise ConfigError(f"{where}: the controller resizes afd with topology all (A:F), pd (xPyD) and the ranks "
                          f"of dep and dwdp, not mode {lay.mode!r}")
    policy, _ = autoscale_policy(spec)
    if not (policy.min_attention <= lay.attn_workers <= policy.max_attention
            and policy.min_ffn <= lay.ffn_workers <= policy.max_ffn):
        raise ConfigError(f"{where}: the layout's start ({lay.attn_workers} attention, {lay.ffn_workers} ffn) is "
                          f"outside the policy's range")


def field_names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def pick_keys(d: dict, known: set[str], where: str) -> dict:
    """``d`` itself, once every key of it is among ``known``."""
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"experiment: unknown keys in {where}: {sorted(unknown)} (known: {sorted(known)})")
    return d


def system_from_dict(name: str, d: dict, model: str = "tiny", dtype: str = "auto") -> SystemSpec:
    """One ``systems:`` entry, as both the engine and the simulator read it."""
    if not isinstance(d, dict):
        raise ConfigError(f"experiment: systems.{name} must be a mapping, got {d!r}")
    d = dict(d)
    engine = pick_keys(dict(d.pop("engine", None) or {}), field_names(EngineConfig) - set(ENGINE_KEYS_ELSEWHERE),
                       f"systems.{name}.engine")
    sim = pick_keys(dict(d.pop("sim", None) or {}), field_names(SimOptions), f"systems.{name}.sim")
    hardware = d.pop("hardware", None) or {}
    if not isinstance(hardware, dict):
        raise ConfigError(f"systems.{name}.hardware must map a role to a hardware preset, got {hardware!r}")
    autoscale = d.pop("autoscale", None) or {}
    if not isinstance(autoscale, dict):
        raise ConfigError(f"systems.{name}.autoscale must be the controller's policy (a mapping), got {autoscale!r}")
    return SystemSpec(name, layout_from_dict(d, f"systems.{name}"), EngineConfig(model=model, dtype=dtype, **engine),
                      SimOptions(**sim), tuple(hardware.items()), tuple(autoscale.items()))


def check_systems(where: str, dtype: str, systems: dict[str, SystemSpec], compare: tuple[tuple[str, str], ...]) -> None:
    """What every experiment file asks of its systems: a known dtype, at least one system, and pairs
    to compare that name two of them."""
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype must be one of {DTYPES}, got {dtype!r}")
    if not systems:
        raise ConfigError(f"{where}: systems: give at least one")
    for a, b in compare:
        if a not in systems or b not in systems:
            raise ConfigError(f"{where}: compare: {a!r} vs {b!r}: both must be systems")


def system_to_dict(spec: SystemSpec) -> dict:
    """The entry's settings as a result file records them."""
    engine = {k: v for k, v in dataclasses.asdict(spec.engine).items() if k not in ENGINE_KEYS_ELSEWHERE}
    return {**layout_to_dict(spec.layout), "engine": engine, "sim": dataclasses.asdict(spec.sim),
            **({"autoscale": dict(spec.autoscale)} if spec.autoscale else {})}
