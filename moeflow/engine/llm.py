"""``LLM``: the vLLM-shaped front object over any mode."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Sequence

from moeflow.config import ClusterConfig, ConfigError, EngineConfig, KvTransferConfig
from moeflow.core import Request, RequestError, RequestOutput, SamplingParams
from moeflow.engine.base import clock
from moeflow.engine.modes import create_engine
from moeflow.engine.output import OutputTracker, merge_samples
from moeflow.engine.stop import StopStrings
from moeflow.engine.restart import RestartCount, RestartPolicy
from moeflow.engine.tokenizer import load_tokenizer
from moeflow.layout import Layout, make_layout
from moeflow.model.tiny import EMBEDDED, tiny_path
from moeflow.settings import cache_dir, hf_hub_cache, hf_hub_offline
from moeflow.workers.launch import WorkerDied

logger = logging.getLogger("moeflow.engine")

Prompt = str | list[int] | dict


# what a checkpoint directory needs; a hub download fetches nothing else
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def resolve_model(model: str, revision: str | None = None) -> str:
    """The checkpoint directory of ``model``: an embedded model ("tiny", "tiny-mla": written on first
    use), a local Hugging Face directory, or a hub name ("org/name") resolved through
    huggingface_hub's cache (downloading unless HF_HUB_OFFLINE is set), as vLLM resolves them."""
    if model in EMBEDDED:
        return tiny_path(cache_dir(), model)
    if os.path.isdir(model) or model.startswith((".", "/", "~")) or model.count("/") > 1:
        return model  # a local path: the loader says what is wrong with it
    if model.count("/") != 1:
        raise ConfigError(f"model {model!r}: not a directory, an embedded model {sorted(EMBEDDED)}, "
                          f"or a Hugging Face hub name (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = hf_hub_offline()
    try:
        return snapshot_download(model, revision=revision, cache_dir=hf_hub_cache(), local_files_only=offline,
                                 allow_patterns=_CHECKPOINT_FILES)
    except LocalEntryNotFoundError as e:
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the hub or the local cache"
        raise ConfigError(f"model {model!r}{f' at revision {revision!r}' if revision else ''} is not in {where}: "
                          f"{e}") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"model {model!r}: the hub refused it ({e})") from None


class LLM:
    """``LLM(model, mode=..., <EngineConfig fields>, <the mode's layout fields>)``, or
    ``LLM(model, layout=AsapLayout(...), ...)``; ``LLM.from_system(spec)`` for an experiment entry."""

    def __init__(self, model: str = "tiny", mode: str = "colocated", dtype: str = "auto", device: str = "auto",
                 seed: int = 0,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, num_kv_blocks: int = 4096,
                 kv_block_size: int = 16, max_model_len: int | None = None, num_threads: int = 1,
                 pin_cpus: bool = False, transport: str = "shm", trace: bool = False, revision: str | None = None,
                 memory_budget_gib: float | None = None, activation_reserve_gib: float | None = None,
                 max_restarts: int = 0, restart_backoff_s: float = 1.0, stall_timeout_s: float = 60.0,
                 kv_admission: str = "on-demand", enable_eplb: bool = False, eplb_config=None, router_skew: float = 0.0,
                 init_expert_location: str = "trivial", share_kv_cache: bool = False,
                 cuda_graph: bool | None = None, enforce_eager: bool = False,
                 cluster: ClusterConfig | None = None, kv_transfer_config: KvTransferConfig | dict | None = None,
                 layout: Layout | None = None, **layout_kwargs):
        """``max_restarts``: when a worker dies, its requests end with errors and, before the next
        ``generate``, the deployment is rebuilt up to this many times in a row (back-off from
        ``restart_backoff_s``, doubling); 0 (the default): a failed deployment raises (a degraded one,
        dwdp with a lost rank, is healed in place only when restarts are on). ``stall_timeout_s``: a
        work item its workers leave unanswered this long fails the deployment. ``cluster``:
        the hosts the deployment spans (this is node 0; the others run ``moeflow worker-node``).
        ``kv_transfer_config``: this deployment's side of a prefill/decode split across servers
        (``KvTransferConfig``: role prefill or decode; ``docs/pd.md``)."""
        if enforce_eager and cuda_graph:
            raise ConfigError("cuda_graph=True asks for CUDA graphs and enforce_eager=True for none: give one, not both")
        if enforce_eager:
            cuda_graph = False
        if layout is None:
            layout = make_layout(mode, **layout_kwargs)
        elif layout_kwargs or mode not in ("colocated", layout.mode):
            raise ConfigError(f"give the deployment either as layout=... or as mode= and its options, not both "
                              f"(mode={mode!r}, options {sorted(layout_kwargs)})")
        if cuda_graph and layout.mode != "colocated":
            raise ConfigError(f"cuda_graph: decode is captured in mode colocated only; mode {layout.mode!r} crosses "
                              f"processes between a step's layers through host-driven transfers, which a graph "
                              f"cannot hold (leave it unset: such modes run eagerly)")
        config = EngineConfig(model=model, dtype=dtype, device=device, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, kv_block_size=kv_block_size,
                              num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                              num_threads=num_threads, seed=seed, pin_cpus=pin_cpus, transport=transport, trace=trace,
                              memory_budget_gib=memory_budget_gib, activation_reserve_gib=activation_reserve_gib,
                              stall_timeout_s=stall_timeout_s, kv_admission=kv_admission,
                              cluster=cluster or ClusterConfig(), kv_transfer_config=kv_transfer_config,
                              enable_eplb=enable_eplb, eplb_config=eplb_config, router_skew=router_skew,
                              init_expert_location=init_expert_location, share_kv_cache=share_kv_cache,
                              cuda_graph=cuda_graph)
        self.restart_policy = RestartPolicy(max_restarts, restart_backoff_s)
        self.model_path = resolve_model(model, revision)
        self.layout, self.mode = layout, layout.mode
        self._requested = config
        self.engine = create_engine(layout, self.model_path, config)
        self._restarts = RestartCount(self.restart_policy, up_since_s=clock())
        self.config = self.engine.config  # with "auto" resolved
        mc = self.engine.model_config
        self.tokenizer = load_tokenizer(self.model_path, mc.vocab_size)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self._eos = mc.eos_token_ids or (() if tok_eos is None else (tok_eos,))
        self._ids = itertools.count()

    @classmethod
    def from_system(cls, spec) -> "LLM":
        """The deployment of one ``systems:`` entry of an experiment file (``moeflow.experiment``)."""
        if spec.autoscale:  # it would run fixed: say so rather than measure the wrong thing
            raise ConfigError(f"systems.{spec.name}.autoscale: the controller runs in `moeflow serve --autoscale` "
                              f"and in the simulator, not in an in-process deployment")
        return cls(layout=spec.layout, **dataclasses.asdict(spec.engine))

    def get_tokenizer(self):
        return self.tokenizer

    def restart(self, sleep=time.sleep) -> None:
        """Rebuild the failed deployment under the restart policy: back off, then build the same
        layout and config again; raises WorkerDied, naming the failure and the last build error,
        once ``max_restarts`` attempts in a row have failed to bring it up. Requests of the old
        deployment are not carried over (they ended with errors when it failed)."""
        count, reason = self._restarts, self.engine.failed
        count.failed(clock())
        self.engine.shutdown()
        last = None
        while not count.exhausted:
            sleep(count.delay_s())
            try:
                self.engine = create_engine(self.layout, self.model_path, self._requested)
            except Exception as e:  # noqa: BLE001  (any build error is one failed attempt)
                count.attempt_failed()
                last = f"{type(e).__name__}: {e}"
                logger.warning("restart attempt %d failed: %s", count.failed_attempts, last)
                continue
            count.came_up(clock())
            logger.warning("the %s deployment is back after restart %d", self.mode, count.restarts)
            return
        raise WorkerDied(f"the {self.mode} deployment failed ({reason}) and {count.failed_attempts} restart "
                         f"attempt(s) in a row failed to bring it back (the last: {last})")

    @property
    def restarts(self) -> int:
        """Deployments rebuilt after a failure so far."""
        return self._restarts.restarts

    def _heal(self) -> None:
        """Before new work, if the policy allows: a failed deployment is rebuilt, a degraded one
        healed in place (rebuilt when it cannot be)."""
        if not self.restart_policy.enabled:
            return
        why = self.engine.load().degraded
        if why is not None and not self.engine.heal():
            self.engine.failed = f"{why}; rebuilding the whole deployment"
        if self.engine.failed is not None:
            self.restart()

    def _to_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, [int(t) for t in prompt["prompt_token_ids"]]
            return self._to_ids(prompt["prompt"])
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """The one request of ``prompt`` (``params.n`` must be 1: see ``make_requests``)."""
        if params.n != 1:
            raise RequestError(f"n={params.n}: a request with several samples is several requests (make_requests)")
        return self.make_requests(prompt, params, request_id)[0]

    def make_requests(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> list[Request]:
        """The ``params.n`` requests of ``prompt`` (ids ``{i}_{request_id}`` when n > 1, as vLLM's):
        sample i has seed ``seed + i`` when seeded, prompt logprobs only for sample 0, and samples
        1.. share sample 0's full prompt KV blocks (``scheduler/pool.py``)."""
        text, ids = self._to_ids(prompt)
        rid = request_id if request_id is not None else str(next(self._ids))
        now, n = clock(), params.n
        if n == 1:
            return [self._request(rid, ids, params, now, text)]
        out = []
        for i in range(n):
            p = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            r = self._request(f"{i}_{rid}", ids, p, now, text)
            r.prefix_of = out[0].request_id if out else None
            out.append(r)
        return out

    def _request(self, rid: str, ids: list[int], params: SamplingParams, now: float, text: str | None) -> Request:
        r = Request(rid, ids, params, arrival_s=now, prompt=text, eos_token_ids=self._eos)
        if params.stop:
            r.stop_strings = StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return r

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [str(next(self._ids)) for _ in prompts]
        families = [self.make_requests(p, sp, rid) for p, sp, rid in zip(prompts, params, ids)]
        self._heal()
        trackers = {}
        try:
            for r in (r for family in families for r in family):
                self.engine.add_request(r)
                trackers[r.request_id] = OutputTracker(r, self.tokenizer)
        except Exception:
            for rid in trackers:  # nothing half-accepted stays queued
                self.engine.abort(rid)
            raise
        pending = set(trackers)
        try:
            while pending:
                result = self.engine.step()
                for rid, out in result.outputs.items():
                    if rid in trackers:
                        trackers[rid].on_step(out)
                pending -= {r.request_id for r in result.finished}
                if not result.outputs and not result.finished and not self.engine.has_unfinished():
                    raise RuntimeError("the engine went idle with requests still pending")
        except BaseException:  # an error or Ctrl-C: leave no request of this call queued
            for rid in pending:
                self.engine.abort(rid)
            raise
        return [merge_samples(rid, [trackers[r.request_id].output() for r in family])
                for rid, family in zip(ids, families)]

    def expert_distribution(self) -> dict:
        """The routed load since the deployment started (tokens per MoE layer and expert), as a
        JSON-ready mapping that ``init_expert_location`` takes from a file: record a workload, then
        start the next deployment from a placement balanced for it. A mode without expert devices
        (colocated, pd) raises."""
        window = getattr(self.engine, "expert_load", None)
        if window is None:
            raise ConfigError(f"mode {self.mode!r} records no expert load (dep, asap, afd and dwdp do)")
        return window.distribution()

    def scale(self, ffn: int | None = None, moe: int | None = None, attention: int | None = None,
              ep_size: int | None = None, drain: bool | None = None, wait: bool = True,
              timeout_s: float = 300.0, prefill: int | None = None, decode: int | None = None) -> dict:
        """Change the deployment's membership while it serves (afd: ``ffn`` FFN daemons, in a
        deployment started with ``max_ffn_workers``; asap: ``moe`` MoE workers, with
        ``max_moe_workers``; ``ep_size``: either, or dep's and dwdp's ranks, with ``max_dp``;
        ``attention`` groups, with ``max_attn_dp`` or ``max_attn_workers``, ``drain``: a leaver's requests finish there rather than being handed
        over); with ``wait``, return once the new membership
        serves and the old members have left (pd: ``prefill`` or ``decode`` instances, with
        ``max_prefill_instances`` / ``max_decode_instances``). The status, as ``GET /scale`` gives it; a
        target the deployment cannot take raises ``ConfigError`` saying why."""
        scale = getattr(self.engine, "scale", None)
        if scale is None:
            raise ConfigError(f"mode {self.mode!r}: its membership is fixed while serving (afd, asap, dep, dwdp and "
                              f"pd deployments started with room to grow scale)")
        sides = {k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None}
        if sides and self.mode != "pd":
            raise ConfigError(f"scale {sorted(sides)[0]}: mode {self.mode!r} has no prefill or decode instances (pd has)")
        status = scale(ffn=ffn, moe=moe, attention=attention, ep_size=ep_size, drain=drain, **sides)
        deadline = time.monotonic() + timeout_s
        while wait and status["in_progress"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"scale: still in progress after {timeout_s:g} s: {status}")
            self.engine.step()  # drives the change (an idle step turns it too)
            status = self.engine.scale_status()
        return status

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
