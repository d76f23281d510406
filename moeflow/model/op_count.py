"""What one step asks of the device: the aten ops it dispatches and the host syncs among them.

A decode step that waits on the host (a value read back to pick a shape, a ``.tolist()`` to build
metadata) cannot be captured in a CUDA graph and leaves the GPU idle while Python runs; one whose op
count grows with the batch is launch-bound. ``OpCount`` measures both on any device, the CPU
included (so a test can hold the GPU's path to it): every aten op through a ``TorchDispatchMode``,
and as syncs the ops whose result the host must see (``_local_scalar_dense``: ``item()``,
``int(t)``, ``bool(t)``), the ops whose output shape depends on the data (``nonzero``, ``unique``,
``masked_select``, ...) and ``Tensor.tolist()``, which on the CPU reads memory without dispatching.
"""
from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result (or the shape of it) the host must wait for
SYNC_OPS = frozenset({aten._local_scalar_dense, aten.item, aten.nonzero, aten.nonzero_static, aten.unique_consecutive,
                      aten._unique2, aten.unique_dim, aten.masked_select, aten.is_nonzero, aten.equal,
                      aten.bincount, aten.argwhere})


class OpCount(TorchDispatchMode):
    """``with OpCount() as c: step()`` -> ``c.ops`` (aten ops), ``c.syncs`` (host syncs) and, for
    each sync, where it came from (``c.sync_sites``: the innermost moeflow frame)."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()
        self.sync_sites: collections.Counter = collections.Counter()
        self._tolist = None

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_sites.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[func.overloadpacket] += 1
        if func.overloadpacket in SYNC_OPS or (func.overloadpacket is aten.repeat_interleave
                                               and (kwargs or {}).get("output_size") is None):
            self._sync(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def _sync(self, what: str) -> None:
        site = next((f"{f.filename.rpartition('moeflow/')[2]}:{f.lineno}" for f in reversed(traceback.extract_stack())
                     if "/moeflow/" in f.filename and not f.filename.endswith("op_count.py")), "?")
        self.sync_sites[f"{what} at {site}"] += 1

    def __enter__(self):
        original, counter = torch.Tensor.tolist, self

        def tolist(t, *a, **kw):
            counter._sync("tolist")
            return original(t, *a, **kw)
        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
