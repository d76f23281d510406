"""The prefill/decode-disaggregated deployment: prefill instances of one layout hand each request's
KV cache to decode instances of another (xPyD). A layout of layouts; pure Python (the simulator
builds it too)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moeflow.config import FAILURE_POLICIES, ConfigError, opt
from moeflow.layout.base import Layout, positive, require

PREFILL_MODES = ("colocated", "asap", "dep", "dwdp")  # the modes that prefill (dep with or without chunks)
DECODE_MODES = ("colocated", "dep", "afd", "asap", "dwdp")


def part(help: str) -> Any:
    """A field holding a whole layout (``layout: True``: given as a mapping with a ``mode`` key)."""
    f = opt(None, help, cli=False)
    f.metadata = {**f.metadata, "layout": True}
    return f


@dataclass(frozen=True)
class PdLayout(Layout):
    mode = "pd"
    summary = ("prefill/decode disaggregation: X prefill instances (any mode that prefills) sample each request's "
               "first token and hand its KV cache to Y decode instances (any mode that decodes)")

    prefill: Layout | None = part("the layout of each prefill instance")
    decode: Layout | None = part("the layout of each decode instance")
    prefill_instances: int = opt(1, "X: prefill instances")
    decode_instances: int = opt(1, "Y: decode instances")
    max_prefill_instances: int | None = opt(None, "the most prefill instances POST /scale may ask for while serving "
                                                  "(default: the start's, fixed)")
    max_decode_instances: int | None = opt(None, "the most decode instances POST /scale may ask for while serving "
                                                 "(default: the start's, fixed)")
    # how long the prefill side keeps a finished prompt's blocks for the decode side to take them
    kv_lease_s: float = opt(30.0, "seconds a prefill instance keeps a request's KV blocks for its decode instance")
    kv_load_failure_policy: str = opt("recompute", "a handoff that fails or whose lease expires: the request fails, "
                                      "or the decode instance recomputes its prompt", choices=FAILURE_POLICIES)
    max_pending_handoffs: int = opt(256, "prefilled requests waiting for room on a decode instance; beyond this "
                                         "new requests are refused (overloaded)")
    kv_buffer_mib: int | None = opt(None, "the handoff staging buffer, where KV is staged: a prefill server's "
                                          "with --kv-staged, a decode server's pulls from another host, a deployment "
                                          "whose instances cannot share their caches (default: room for 4 "
                                          "full-context requests, 64 MiB to 1 GiB); a pd deployment's instances "
                                          "share theirs and stage nothing")

    def __post_init__(self) -> None:
        for side, modes in (("prefill", PREFILL_MODES), ("decode", DECODE_MODES)):
            lay = getattr(self, side)
            require(isinstance(lay, Layout), f"pd layout: {side} must be a layout (a mapping with a 'mode' key), "
                                             f"got {lay!r}")
            require(lay.mode in modes, f"pd layout: {side} mode must be one of {modes}, got {lay.mode!r}")
        positive(self, "prefill_instances", "decode_instances", "max_pending_handoffs")
        for side in ("prefill", "decode"):
            most, start = getattr(self, f"max_{side}_instances"), getattr(self, f"{side}_instances")
            require(most is None or (isinstance(most, int) and most >= start),
                    f"pd layout: max_{side}_instances must be an int >= {side}_instances ({start}), got {most!r}")
        require(isinstance(self.kv_lease_s, (int, float)) and not isinstance(self.kv_lease_s, bool)
                and self.kv_lease_s > 0, f"pd layout: kv_lease_s must be a number > 0, got {self.kv_lease_s!r}")
        require(self.kv_load_failure_policy in FAILURE_POLICIES,
                f"pd layout: kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}")
        require(self.kv_buffer_mib is None or (isinstance(self.kv_buffer_mib, int) and self.kv_buffer_mib > 0),
                f"pd layout: kv_buffer_mib must be a positive int, got {self.kv_buffer_mib!r}")

    @property
    def num_processes(self) -> int:
        return (self.prefill.num_processes * self.prefill_instances +
                self.decode.num_processes * self.decode_instances)

    @property
    def num_groups(self) -> int:
        return self.prefill.num_groups * self.prefill_instances + self.decode.num_groups * self.decode_instances

    def describe(self) -> str:
        return (f"pd({self.prefill_instances}x {self.prefill.describe()} -> "
                f"{self.decode_instances}x {self.decode.describe()})")


def is_layout_field(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("layout"))


def parse_parts(text: str, where: str) -> dict:
    """``'mode=asap,attn_dp=1,moe_workers=1'`` (the command line's ``--prefill``) as a mapping;
    values are ints, floats, true/false or strings."""
    out: dict[str, Any] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{where}: expected key=value items separated by commas, got {item!r} in {text!r}")
        out[key.strip().replace("-", "_")] = _value(value.strip())
    if "mode" not in out:
        raise ConfigError(f"{where}: name the mode (mode=...), got {text!r}")
    return out


def _value(s: str) -> Any:
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    if s.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(s)
        except ValueError:
            pass
    return s
