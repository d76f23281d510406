"""Expert load where tokens are routed: tokens per (MoE layer, logical expert), counted on the
device as each layer routes a batch and handed to the engine with the work item's results.

The MoE gate's top-k ids are exactly what the expert-holding workers compute: each dispatch header
carries these counts per slot, and a replicated expert's pairs split over its copies to within one
(``ExpertRoutes``), so the engine derives every device's load from these and the placement. One
``bincount`` per MoE layer on the device, one host copy per work item: cheap enough to stay on.
"""
from __future__ import annotations

import numpy as np
import torch


class ExpertLoadRecorder:
    def __init__(self, sparse_layers: list[bool], num_experts: int, device: torch.device):
        self.moe_index = {lid: i for i, lid in enumerate(l for l, s in enumerate(sparse_layers) if s)}
        self.num_experts = num_experts
        self.counts = torch.zeros(len(self.moe_index), num_experts, dtype=torch.int64, device=device)  # [Lm, E]
        self._any = False

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        """One batch's routing of model layer ``layer``: topk_ids [n, K]."""
        self.counts[self.moe_index[layer]] += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        self._any = True

    def take(self) -> np.ndarray | None:
        """The counts since the last take, [Lm, E] int32 (None if nothing was routed), and start over."""
        if not self._any:
            return None
        out = self.counts.to("cpu", torch.int32).numpy()
        self.counts.zero_()
        self._any = False
        return out
