"""The autoscaling controller's policy (``--autoscale POLICY.yaml``; a simulated system's
``autoscale:``): what it may do, validated. A config of the shared base, so that the engine, the
experiment files and the simulator read one definition; the controller is ``scheduler/autoscale.py``."""
from __future__ import annotations

from dataclasses import dataclass, fields

from moeflow.errors import ConfigError


DEFAULT_SAMPLE_S = 2.0  # a policy's sampling period where it names none


@dataclass(frozen=True)
class AutoscalePolicy:
    """What the controller may do (``--autoscale POLICY.yaml``)."""

    tpot_slo_s: float  # p90 TPOT the deployment must keep
    ttft_slo_s: float | None = None  # p90 TTFT to keep too (None: TPOT and KV room alone decide)
    # instances one TTFT decision may add: in proportion to how far the prompts' wait is over the SLO
    # (M x (wait / SLO - 1)), at most this many; 1: one at a time, as every other decision
    max_step: int = 1
    min_attention: int = 1
    max_attention: int = 1
    min_ffn: int = 1
    max_ffn: int = 1
    max_processes: int | None = None  # attention + FFN; None: max_attention + max_ffn
    interval_s: float = 10.0  # least time between two changes
    window: int = 3  # samples a decision averages
    band: float = 0.15  # hysteresis: the relative gain a change must predict
    # a membership the controller left because it fell short (over an SLO, out of KV room) is not shrunk
    # back to for this long: its measured shortfall outweighs a prediction that it would now do
    # (Kubernetes' HPA holds scale-downs for a 300 s stabilization window for the same reason)
    hold_s: float = 60.0
    wait_eps: float = 0.02  # a wait share below this is none (the instances are attention-bound)

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"autoscale policy: {what}")
        if not self.tpot_slo_s > 0:
            raise bad(f"tpot_slo_s must be > 0, got {self.tpot_slo_s!r}")
        if not (isinstance(self.max_step, int) and self.max_step >= 1):
            raise bad(f"max_step must be an int >= 1, got {self.max_step!r}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise bad(f"ttft_slo_s must be > 0 or null, got {self.ttft_slo_s!r}")
        for lo, hi in (("min_attention", "max_attention"), ("min_ffn", "max_ffn")):
            a, b = getattr(self, lo), getattr(self, hi)
            if not (isinstance(a, int) and isinstance(b, int) and 1 <= a <= b):
                raise bad(f"need 1 <= {lo} <= {hi}, got {a!r} and {b!r}")
        if self.max_processes is not None and self.max_processes < self.min_attention + self.min_ffn:
            raise bad(f"max_processes {self.max_processes} is below min_attention + min_ffn")
        if not (self.interval_s >= 0 and self.window >= 1 and 0 < self.band < 1 and self.wait_eps >= 0
                and self.hold_s >= 0):
            raise bad("need interval_s >= 0, window >= 1, 0 < band < 1, wait_eps >= 0, hold_s >= 0")

    @property
    def budget(self) -> int:
        return self.max_processes if self.max_processes is not None else self.max_attention + self.max_ffn


@dataclass(frozen=True)
class PdAutoscalePolicy:
    """What the controller of a pd deployment may do: X prefill and Y decode instances
    (``scheduler/autoscale_pd.py``)."""

    tpot_slo_s: float  # p90 TPOT: the decode side's
    ttft_slo_s: float  # p90 TTFT: the prefill side's
    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1
    max_processes: int | None = None  # of both sides' instances; None: the maximums' processes
    # the share of wall time a prefill instance may compute after a change (rate matching's utilization,
    # sim/rate_match.py): above it prompts queue and TTFT grows without bound as it nears 1
    target_utilization: float = 0.7
    max_step: int = 1  # prefill instances one decision may add (rate matching may ask for more)
    interval_s: float = 10.0
    window: int = 3
    band: float = 0.15
    hold_s: float = 60.0
    history: int = 20  # windows whose (decode batch, TPOT) the decode side's step model is fitted on

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"autoscale policy (pd): {what}")
        for k in ("tpot_slo_s", "ttft_slo_s"):
            if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), (int, float)) \
                    or not getattr(self, k) > 0:
                raise bad(f"{k} must be a number > 0, got {getattr(self, k)!r}")
        for lo, hi in (("min_prefill", "max_prefill"), ("min_decode", "max_decode")):
            a, b = getattr(self, lo), getattr(self, hi)
            if not (isinstance(a, int) and isinstance(b, int) and 1 <= a <= b):
                raise bad(f"need 1 <= {lo} <= {hi}, got {a!r} and {b!r}")
        if not 0 < self.target_utilization < 1:
            raise bad(f"target_utilization must be in (0, 1), got {self.target_utilization!r}")
        if not (isinstance(self.max_step, int) and self.max_step >= 1):
            raise bad(f"max_step must be an int >= 1, got {self.max_step!r}")
        if not (isinstance(self.history, int) and self.history >= 2):
            raise bad(f"history must be an int >= 2, got {self.history!r}")
        if not (self.interval_s >= 0 and self.window >= 1 and 0 < self.band < 1 and self.hold_s >= 0):
            raise bad("need interval_s >= 0, window >= 1, 0 < band < 1, hold_s >= 0")


@dataclass(frozen=True)
class EpAutoscalePolicy:
    """What the controller of a deployment of ranks may do: dep's EP size, dwdp's ranks
    (``scheduler/autoscale_ep.py``)."""

    tpot_slo_s: float  # p90 TPOT the deployment must keep
    ttft_slo_s: float | None = None  # p90 TTFT to keep too (None: TPOT and KV room alone decide)
    min_ranks: int = 1  # raised to the fewest ranks that hold every expert (the memory floor)
    max_ranks: int = 1
    max_processes: int | None = None  # ranks x their tensor-parallel size; None: max_ranks'
    max_step: int = 1  # ranks one TTFT decision may add
    interval_s: float = 10.0
    window: int = 3
    band: float = 0.15
    hold_s: float = 60.0
    history: int = 20  # windows whose (hottest device's load, TPOT) the step model is fitted on

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"autoscale policy (ranks): {what}")
        if isinstance(self.tpot_slo_s, bool) or not isinstance(self.tpot_slo_s, (int, float)) or not self.tpot_slo_s > 0:
            raise bad(f"tpot_slo_s must be a number > 0, got {self.tpot_slo_s!r}")
        if self.ttft_slo_s is not None and (isinstance(self.ttft_slo_s, bool) or not isinstance(
                self.ttft_slo_s, (int, float)) or not self.ttft_slo_s > 0):
            raise bad(f"ttft_slo_s must be a number > 0 or null, got {self.ttft_slo_s!r}")
        if not (isinstance(self.min_ranks, int) and isinstance(self.max_ranks, int) and 1 <= self.min_ranks <= self.max_ranks):
            raise bad(f"need 1 <= min_ranks <= max_ranks, got {self.min_ranks!r} and {self.max_ranks!r}")
        if self.max_processes is not None and not (isinstance(self.max_processes, int) and self.max_processes >= 1):
            raise bad(f"max_processes must be an int >= 1 or null, got {self.max_processes!r}")
        for k in ("max_step", "history"):
            if not (isinstance(getattr(self, k), int) and getattr(self, k) >= (1 if k == "max_step" else 2)):
                raise bad(f"{k} must be an int >= {1 if k == 'max_step' else 2}, got {getattr(self, k)!r}")
        if not (self.interval_s >= 0 and self.window >= 1 and 0 < self.band < 1 and self.hold_s >= 0):
            raise bad("need interval_s >= 0, window >= 1, 0 < band < 1, hold_s >= 0")


def policy_from(raw: dict, where: str, cls: type = AutoscalePolicy) -> tuple:
    """(the policy, its sampling period ``sample_s``) of a mapping of their fields (a POLICY.yaml, a
    simulated system's ``autoscale:``), refused naming ``where`` and the key that is wrong. ``cls``:
    ``AutoscalePolicy`` (afd's A:F), ``PdAutoscalePolicy`` (pd's xPyD) or ``EpAutoscalePolicy`` (dep's
    and dwdp's ranks)."""
    d = dict(raw)
    sample_s = d.pop("sample_s", DEFAULT_SAMPLE_S)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known | {'sample_s'})}")
    if isinstance(sample_s, bool) or not isinstance(sample_s, (int, float)) or not sample_s > 0:
        raise ConfigError(f"{where}: sample_s must be a number > 0, got {sample_s!r}")
    try:
        return cls(**d), float(sample_s)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
