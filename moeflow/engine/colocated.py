"""Mode ``colocated``: the whole model in this process; the reference every other mode must match."""
from __future__ import annotations

import os
import uuid

import torch

from moeflow.comm.segment import segment_path
from moeflow.config import EngineConfig
from moeflow.core import Request
from moeflow.engine.base import Engine, StepResult, clock, context_len, validate_request
from moeflow.engine.memory import apply_budget
from moeflow.hardware.device import worker_device
from moeflow.layout import ColocatedLayout
from moeflow.messages import BatchTiming
from moeflow.model import decode_graphs
from moeflow.model.kv_cache import KVCache
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import TORCH_DTYPES, load_weights
from moeflow.scheduler import make_scheduler
from moeflow.workers.kv_transfer import KvTransfers, shared_cache
from moeflow.workers.runner import ModelRunner


class ColocatedEngine(Engine):
    mode_name = "colocated"

    def __init__(self, model_path: str, config: EngineConfig, layout: ColocatedLayout):
        config, self.memory_plan = apply_budget(config, model_path, layout)
        self.config, self.layout = config, layout
        torch.set_num_threads(config.num_threads)
        dtype = TORCH_DTYPES[config.dtype]
        device = worker_device(config.device, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.model_config, weights = load_weights(model_path, dtype, device=device, router_skew=config.router_skew)
        mc = self.model_config
        self.max_model_len = context_len(config, mc)
        self._region = self._kv_memory = None
        if config.share_kv_cache:  # NOTE: <pid>-<hex>, as an engine's: the reaper unlinks it if we are killed
            kv, self._region, self._kv_memory = shared_cache(
                mc, config.num_kv_blocks, config.kv_block_size, dtype, device,
                segment_path(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", "kv-cache"), 0)
        else:
            kv = KVCache.for_model(mc, config.num_kv_blocks, config.kv_block_size, dtype, device)
        self.runner = ModelRunner(MoETransformer(mc, weights), kv, seed=config.seed)
        self.runner.graphs = decode_graphs.for_engine(config.cuda_graph, self.runner.model, kv, config.max_num_seqs,
                                                      self.max_model_len)
        self.scheduler = make_scheduler(layout, config, self.max_model_len)
        self._kv = KvTransfers(kv, 0)

    def add_request(self, request: Request) -> None:
        validate_request(request, self.model_config)
        self.scheduler.add(request)
        self.runner.add_request(request.request_id, request.prompt_token_ids, request.params,
                                request.eos_token_ids, tuple(request.output_token_ids))

    def _kv_arrived(self, request: Request) -> None:
        self.runner.add_request(request.request_id, request.prompt_token_ids, request.params,
                                request.eos_token_ids, tuple(request.output_token_ids))

    def _send_kv(self, group: int, message) -> None:
        with torch.inference_mode():
            self._kv.handle(message)

    def _kv_regions(self, group: int) -> tuple | None:
        return None if self._region is None else (self._region,)

    def shutdown(self) -> None:
        self._kv.close()
        if self._kv_memory is not None:
            self._kv_memory.close()
            self._kv_memory = None

    def step(self) -> StepResult:
        works = self.scheduler.schedule(clock())
        if not works:
            return StepResult({}, [])
        (work,) = works
        (batch,) = work.batches
        t0 = clock()
        try:
            outputs = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001  (one batch's failure is its requests', not the engine's)
            return StepResult({}, self._fail_batch(batch, f"{type(e).__name__}: {e}"))
        t1 = clock()
        timing = BatchTiming(batch.batch_id, t0, t1, t1 - t0, 0.0)
        for o in outputs.values():
            o.timing = timing
        sampled = {rid: o.token_id for rid, o in outputs.items() if o.token_id is not None}
        finished = self.scheduler.update(0, batch, sampled)
        for r in finished:
            self.runner.remove_request(r.request_id)
        return StepResult(outputs, finished, {"colocated": t1 - t0})

    def _fail_batch(self, batch, error: str) -> list[Request]:
        failed = []
        for s in batch.seqs:
            r = self.scheduler.abort(s.request_id, "error")
            if r is not None:
                r.error = f"batch {batch.batch_id} failed: {error}"
                self.runner.remove_request(r.request_id)
                failed.append(r)
        return failed

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id, "abort")
        self.runner.remove_request(request_id)
