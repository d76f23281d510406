"""The hardware a plan may use: a default preset, and roles of disaggregated layouts on presets of
their own (``--hardware gb200,attention=h200``: FastAFD §2's heterogeneous deployment), with the
price of each per device-hour (``--price``; sim/prices.py's defaults otherwise)."""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError
from moeflow.experiment.system import HARDWARE_ROLES
from moeflow.sim.hardware import PRESETS, hardware_preset
from moeflow.sim.prices import cost_per_hour, parse_prices, role_devices, unpriced

ROLES = tuple(r for roles in HARDWARE_ROLES.values() for r in roles)


@dataclass(frozen=True)
class HardwareChoice:
    default: str  # every process of a role not listed, and every aggregated layout but afd
    roles: tuple[tuple[str, str], ...] = ()  # role -> preset, where it differs from the default
    prices: tuple[tuple[str, float], ...] = ()  # preset -> USD per device-hour, given by the user

    @classmethod
    def parse(cls, text: str, prices: str | None = None) -> "HardwareChoice":
        """``"gb200"``, ``"gb200,attention=h200"`` or ``"attention=h200,ffn=gb200"`` (no bare preset:
        the first one named is the default)."""
        bare, roles = [], {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            role, eq, name = part.partition("=")
            if not eq:
                bare.append(part)
                continue
            role, name = role.strip(), name.strip()
            if role not in ROLES:
                raise ConfigError(f"--hardware {part!r}: {role!r} is not a role (roles: {', '.join(ROLES)})")
            roles[role] = name
        names = bare + list(roles.values())
        if not names:
            raise ConfigError("--hardware: name a preset (e.g. gb200) and optionally roles on others (attention=h200)")
        if len(bare) > 1:
            raise ConfigError(f"--hardware: one default preset, got {bare}; put the others on roles (ffn=...)")
        for name in names:
            hardware_preset(name)  # an unknown name: its error names the presets; cpu-here: measured, not a preset
        default = names[0]
        given = parse_prices(prices)
        return cls(default, tuple(sorted((r, p) for r, p in roles.items() if p != default)), tuple(sorted(given.items())))

    def roles_for(self, mode: str) -> dict[str, str]:
        """The roles of ``mode`` that run off the default preset."""
        return {r: p for r, p in self.roles if r in HARDWARE_ROLES.get(mode, ())}

    def hbm_bytes(self, preset: str | None) -> float:
        return PRESETS[preset or self.default].hbm_bytes

    def usd_per_hour(self, layout, hardware: dict[str, str]) -> float | None:
        """What ``layout`` with ``hardware`` (role -> preset) costs an hour; None without a price."""
        devices = role_devices(layout, hardware, self.default)
        return None if unpriced(devices, dict(self.prices)) else cost_per_hour(devices, dict(self.prices))

    def unpriced(self) -> list[str]:
        return unpriced({self.default, *(p for _, p in self.roles)}, dict(self.prices))
