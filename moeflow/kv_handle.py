"""KvHandle: a prefilled request's KV, as a prefill server hands it to a decode server (through the
router) in ``kv_transfer_params``. Torch-free: the HTTP server parses it.

The shape follows vLLM's NIXL connector: the prefill server's answer carries
``{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", ...}`` and the
router passes it, unchanged, to the decode server with the original request. moeflow's handle
also names the staged range, the range's token (drawn by the prefill server for this handoff:
whoever claims, pulls or releases the range must name it), the KV layout and the weights'
fingerprint (a decode server whose model, weights or dtype differ refuses it, naming both) and the
first token (sampled on the prefill side, streamed by the decode side).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RawLogprobs = dict[int, tuple[float, int]]  # token id -> (logprob, rank)
RELEASED, REFUSED, UNKNOWN = "released", "refused", "unknown"  # what a prefill server made of a release


@dataclass(frozen=True)
class KvLayout:
    """What the staged bytes are: one [L, num_tokens, *shape] block per entry, in ``dtype``."""

    architecture: str
    num_layers: int
    dtype: str
    entries: tuple[tuple[str, tuple[int, ...]], ...]  # entry name -> whole per-token shape

    def describe(self) -> str:
        shapes = ", ".join(f"{n}{list(s)}" for n, s in self.entries)
        return f"{self.architecture} ({self.num_layers} layers, {self.dtype}, KV {shapes})"

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "num_layers": self.num_layers, "dtype": self.dtype,
                "entries": [[n, list(s)] for n, s in self.entries]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "kv_layout") -> "KvLayout":
        try:
            return cls(str(d["architecture"]), int(d["num_layers"]), str(d["dtype"]),
                       tuple((str(n), tuple(int(x) for x in s)) for n, s in d["entries"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a KV layout ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class KvHandle:
    server_id: str  # the prefill server's KV link (a restarted server has a new one)
    host: str  # the KV port's address and port (comm/kv_link.py)
    port: int
    host_id: str  # comm.kv_link.host_id(): equal on both sides means one host's shared memory
    arena: str  # the staging arena's shared-memory path
    slot: int
    transfer_id: int
    offset_bytes: int
    nbytes: int
    num_tokens: int  # prompt positions staged
    layout: KvLayout
    first_token_id: int  # sampled by the prefill server
    first_logprobs: RawLogprobs | None = None  # the first token's logprobs, when the request asked
    prompt_logprobs: tuple[RawLogprobs, ...] = ()  # prompt positions 1.., when the request asked
    # False: the prefill server's copy out failed and its policy is recompute: no range is offered,
    # the decode server recomputes the prompt (or fails the request, by its own policy)
    staged: bool = True
    token: int = 0  # the range's token (0: none staged)
    weights: str = ""  # the prefill server's weights fingerprint (``model.checkpoint.weights_fingerprint``)
    # in place (not staged in the arena): the leased blocks of the prefill server's attention group
    # ``group``; a decode server on its host copies them out of its caches, one elsewhere pulls them
    block_ids: tuple[int, ...] = ()
    group: int = 0

    @property
    def in_place(self) -> bool:
        return bool(self.block_ids)

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` of the prefill server's answer (JSON)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.server_id,
                "remote_host": self.host, "remote_port": self.port, "remote_host_id": self.host_id,
                "remote_arena": self.arena, "remote_slot": self.slot, "remote_transfer_id": self.transfer_id,
                "remote_offset_bytes": self.offset_bytes, "remote_nbytes": self.nbytes,
                "remote_num_tokens": self.num_tokens,
                "kv_layout": self.layout.to_dict(),
                "first_token_id": self.first_token_id,
                "first_logprobs": None if self.first_logprobs is None else _lp_out(self.first_logprobs),
                "prompt_logprobs": [_lp_out(x) for x in self.prompt_logprobs], "remote_staged": self.staged,
                "remote_token": f"{self.token:016x}", "weights_fingerprint": self.weights,
                "remote_block_ids": list(self.block_ids), "remote_group": self.group}

    @classmethod
    def from_params(cls, p: dict[str, Any]) -> "KvHandle":
        """The handle in a decode server's ``kv_transfer_params``; ValueError naming the bad field."""
        def get(name: str, kind: type | tuple[type, ...]):
            v = p.get(name)
            if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
                raise ValueError(f"kv_transfer_params.{name}: expected {_kind_name(kind)}, got {v!r}")
            return v

        layout = KvLayout.from_dict(get("kv_layout", dict), "kv_transfer_params.kv_layout")
        first_lp = p.get("first_logprobs")
        blocks = p.get("remote_block_ids") or []
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                   for b in blocks):
            raise ValueError(f"kv_transfer_params.remote_block_ids: expected a list of block ids (ints >= 0), "
                             f"got {blocks!r}")
        group = p.get("remote_group", 0)
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise ValueError(f"kv_transfer_params.remote_group: expected an int >= 0, got {group!r}")
        try:
            return cls(get("remote_engine_id", str), get("remote_host", str), get("remote_port", int),
                       get("remote_host_id", str), get("remote_arena", str), get("remote_slot", int),
                       get("remote_transfer_id", int), get("remote_offset_bytes", int), get("remote_nbytes", int),
                       get("remote_num_tokens", int), layout, get("first_token_id", int),
                       None if first_lp is None else _lp_in(first_lp, "first_logprobs"),
                       tuple(_lp_in(x, "prompt_logprobs") for x in p.get("prompt_logprobs") or ()),
                       p.get("remote_staged", True) is not False, _token(get("remote_token", str)),
                       get("weights_fingerprint", str), tuple(blocks), group)
        except (TypeError, IndexError) as e:
            raise ValueError(f"kv_transfer_params: malformed logprobs ({e})") from None


def _token(text: str) -> int:
    if not 1 <= len(text) <= 16 or any(c not in "0123456789abcdef" for c in text) or int(text, 16) >= 1 << 63:
        raise ValueError(f"kv_transfer_params.remote_token: expected the prefill answer's token (16 hex digits), "
                         f"got {text!r}")
    return int(text, 16)


def _kind_name(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _lp_out(lp: RawLogprobs) -> list[list]:
    return [[t, v, r] for t, (v, r) in lp.items()]


def _lp_in(rows, where: str) -> RawLogprobs:
    if not isinstance(rows, list):
        raise ValueError(f"kv_transfer_params.{where}: expected a list of [token id, logprob, rank], got {rows!r}")
    return {int(t): (float(v), int(r)) for t, v, r in rows}
