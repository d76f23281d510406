"""What a deployment costs to run: a price per device-hour for each hardware preset, and the
devices each role of a deployment holds.

Defaults are one provider's on-demand prices on one day, so that their ratios are comparable
(prices of the same GPU differ by several times across providers and weeks): Spheron's API as its
"GPU spot instance arbitrage" post (spheron.network, 2026-06-03) lists it: H100 SXM5 $5.07/h, H200
SXM5 $5.55/h, B200 SXM6 $8.32/h. The list has no GB200: the ``gb200`` preset (one B200 of an NVL72)
takes the B200's price. Other presets have no default: ``--price PRESET=USD`` gives one, and a
user's own contract is the number to use.
"""
from __future__ import annotations

from moeflow.config import ConfigError
from moeflow.errors import require

DEFAULT_PRICES = {"h100": 5.07, "h200": 5.55, "gb200": 8.32}  # USD per device-hour


def parse_prices(text: str | None) -> dict[str, float]:
    """``"h200=3.2,gb200=5"`` -> {preset: USD per device-hour}."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        require(eq == "=", f"--price: give PRESET=USD per device-hour, got {part!r}")
        try:
            usd = float(value)
        except ValueError:
            usd = -1.0
        require(usd > 0, f"--price {name.strip()}: a price per device-hour must be a number > 0, got {value!r}")
        out[name.strip()] = usd
    return out


def role_devices(layout, hardware: dict[str, str], default: str) -> dict[str, int]:
    """{preset: devices} of ``layout`` with ``hardware`` (role -> preset; the rest on ``default``)."""
    if layout.mode == "afd":
        parts = {"attention": layout.attn_workers, "ffn": layout.ffn_workers}
    elif layout.mode == "pd":
        parts = {"prefill": layout.prefill.num_processes * layout.prefill_instances,
                 "decode": layout.decode.num_processes * layout.decode_instances}
    else:
        parts = {"": layout.num_processes}
    out: dict[str, int] = {}
    for role, n in parts.items():
        preset = hardware.get(role, hardware.get("all", default))
        out[preset] = out.get(preset, 0) + n
    return out


def unpriced(presets, prices: dict[str, float]) -> list[str]:
    """The presets of ``presets`` with no price in ``prices`` nor a default."""
    return sorted(p for p in set(presets) if p not in prices and p not in DEFAULT_PRICES)


def cost_per_hour(devices: dict[str, int], prices: dict[str, float]) -> float:
    """USD per hour of ``devices`` ({preset: count}) at ``prices`` (the defaults where not given)."""
    missing = unpriced(devices, prices)
    if missing:
        raise ConfigError(f"no price per device-hour for {missing}: give --price {missing[0]}=USD "
                          f"(defaults exist for {sorted(DEFAULT_PRICES)})")
    table = {**DEFAULT_PRICES, **prices}
    return sum(n * table[p] for p, n in devices.items())
