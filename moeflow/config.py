"""Frozen, self-validating configuration objects.

ModelConfig is the architecture-neutral description every model component reads; the per-family
files in ``moeflow/model/`` translate a Hugging Face ``config.json`` into it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from moeflow.cluster_config import ClusterConfig
from moeflow.eplb_config import EplbConfig, check_engine
from moeflow.errors import ConfigError, require


def opt(default: Any, help: str, flag: str | None = None, cli: bool = True, choices: tuple | None = None) -> Any:
    """A config field with its command-line help (the CLI is generated from the fields): ``flag``
    overrides the generated name (``--<field-with-dashes>``, or ``--no-<field>`` for a boolean that
    defaults to True); ``cli=False`` keeps a field off the command line."""
    meta = {"help": help, "flag": flag, "cli": cli, "choices": choices}
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # Hugging Face class name, e.g. "Qwen3MoeForCausalLM"
    vocab_size: int
    hidden_size: int  # H
    num_layers: int  # L
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int  # E_total (routed experts)
    num_experts_per_tok: int  # K
    moe_intermediate_size: int  # F of one routed expert
    norm_topk_prob: bool  # renormalize the top-k softmax weights to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    # the model's attention and gate kinds (keys of model.attention.ATTENTION_KINDS and model.gate.GATE_KINDS;
    # names, not classes, so this file stays torch-free); the family sets them
    attention_kind: str = "gqa"
    gate_kind: str = "softmax_topk"
    intermediate_size: int = 0  # F of a dense MLP layer (0 when every layer is MoE)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(x @ gate) scales the shared expert
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # config.json "dtype"/"torch_dtype": what the weights are stored in
    # RoPE scaling as config.json's rope_parameters give it (rope_type, factor, ...), sorted (key, value) pairs
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rope_interleave: bool = False  # rotated dims in (even, odd) pairs (DeepSeek) instead of halves
    # multi-head latent attention (DeepSeek), 0 where the model has none; head_dim is the rope dims
    q_lora_rank: int = 0  # 0: q projected straight from the hidden state
    kv_lora_rank: int = 0  # the cached latent c_kv
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False  # MLA: biases on q_a, kv_a and o
    # DeepSeek-V3.2 sparse attention (DSA): the lightning indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0  # keys each query attends to
    # group-limited routing (DeepSeek): experts in n_group groups, tokens route within topk_group of them
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"ModelConfig.{name} must be a positive int, got {v!r}")
        require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        require(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        require(len(self.sparse_layers) == self.num_layers,
                 f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")
        if any(self.sparse_layers):
            require(self.num_experts > 0, "a config with MoE layers needs num_experts > 0")
            require(0 < self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                     f"got {self.num_experts_per_tok}")
            require(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0")
        if not all(self.sparse_layers):
            require(self.intermediate_size > 0, "dense layers need intermediate_size > 0")
        require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        if self.kv_lora_rank:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                require(getattr(self, name) > 0, f"multi-head latent attention needs {name} > 0")
        if self.n_group > 1:
            require(self.num_experts % self.n_group == 0 and 0 < self.topk_group <= self.n_group,
                     f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and "
                     f"topk_group ({self.topk_group}) be in [1, n_group]")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope(self) -> dict:
        """RoPE scaling parameters as a dict (empty: default RoPE)."""
        return dict(self.rope_scaling)


# cuda-ipc: shm with payloads and published weights on the GPU; deferred: its rehearsal on the CPU
TRANSPORTS = ("shm", "dist", "cuda-ipc", "deferred")
ONE_HOST_SHARED = ("shm", "cuda-ipc", "deferred")  # a host's processes map each other's memory
DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_ADMISSIONS = ("on-demand", "reserve")  # scheduler/pool.py  # "auto": resolved once per deployment (hardware/dtype.py)


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings of one deployment (the same object reaches every worker)."""

    model: str = "tiny"  # a local Hugging Face directory, or "tiny" for the embedded model
    dtype: str = "auto"  # the engine replaces "auto" by what this machine computes fast
    max_num_batched_tokens: int = 8192  # S: most tokens in one forward batch
    max_num_seqs: int = 256  # most requests running at once
    kv_block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int = 4096  # blocks in the cache of one attention worker
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int = 1  # torch threads per process
    seed: int = 0
    pin_cpus: bool = False  # pin each worker process to one CPU (round robin)
    transport: str = "shm"  # dispatch/combine between processes: "shm" (one host) or "dist" (torch.distributed)
    trace: bool = False  # workers record spans for a Chrome/Perfetto trace
    # bytes each process may hold (weights, buffers, activations, KV); sets num_kv_blocks (engine/memory.py)
    memory_budget_gib: float | None = None
    activation_reserve_gib: float | None = None  # None: estimated from the model and the batch limits
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the hosts the deployment spans
    # "auto" (CUDA when torch sees one), "cpu", "cuda" (workers spread over the GPUs by rank) or
    # "cuda:N"; the engine replaces "auto" by what it picked (hardware/device.py)
    device: str = "auto"
    # KV blocks per request: "on-demand" (as the sequence grows, preempting by recompute when a
    # group runs out) or "reserve" (prompt + max_tokens at admission, never preempted)
    kv_admission: str = "on-demand"
    # a work item with no answer from its workers this long fails the deployment as a dead worker
    # would (vLLM's engine iteration timeout): a stopped or wedged process is noticed and healed
    stall_timeout_s: float = 60.0
    # this server's side of a prefill/decode split across servers (None: it serves whole requests)
    kv_transfer_config: KvTransferConfig | None = None
    # live expert load balancing: rebalance the expert placement from the routed load while serving
    enable_eplb: bool = False
    eplb_config: EplbConfig = field(default_factory=EplbConfig)  # a mapping (JSON, YAML) or None is parsed in place
    init_expert_location: str = "trivial"  # or a JSON file of recorded load or a placement (scheduler/expert_location)
    router_skew: float = 0.0  # benchmarks only: a Zipf(s) tilt of every MoE gate's choice (model/gate.skewed)
    # each KV-holding process's cache in memory the others map (/dev/shm, or CUDA IPC): set by a
    # deployment whose instances hand KV over on one host (pd), so a handoff copies once
    share_kv_cache: bool = False
    # decode replayed from CUDA graphs (model/decode_graphs.py): None, on where the engine runs on
    # CUDA (vLLM's default); True, required (refused elsewhere); False, eager (vLLM's enforce_eager)
    cuda_graph: bool | None = None

    def __post_init__(self) -> None:
        check_engine(self)
        require(self.cuda_graph is None or isinstance(self.cuda_graph, bool),
                f"EngineConfig.cuda_graph must be true, false or None (auto), got {self.cuda_graph!r}")
        require(isinstance(self.share_kv_cache, bool),
                f"EngineConfig.share_kv_cache must be true or false, got {self.share_kv_cache!r}")
        require(isinstance(self.router_skew, (int, float)) and not isinstance(self.router_skew, bool)
                 and self.router_skew >= 0, f"EngineConfig.router_skew must be a number >= 0, got {self.router_skew!r}")
        if isinstance(self.kv_transfer_config, dict):
            object.__setattr__(self, "kv_transfer_config", KvTransferConfig(**self.kv_transfer_config))
        require(self.kv_transfer_config is None or isinstance(self.kv_transfer_config, KvTransferConfig),
                 f"EngineConfig.kv_transfer_config must be a KvTransferConfig, "
                 f"got {type(self.kv_transfer_config).__name__}")
        if isinstance(self.cluster, dict):  # from a result file or dataclasses.asdict
            object.__setattr__(self, "cluster", ClusterConfig(**self.cluster))
        require(isinstance(self.cluster, ClusterConfig), f"EngineConfig.cluster must be a ClusterConfig, "
                                                          f"got {type(self.cluster).__name__}")
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(isinstance(self.device, str) and re.match(r"^(auto|cpu|cuda(:\d+)?)$", self.device) is not None,
                 f"EngineConfig.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_block_size", "num_kv_blocks",
                     "num_threads"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"EngineConfig.{name} must be a positive int, got {v!r}")
        require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be positive, got {self.max_model_len}")
        require(self.transport in TRANSPORTS, f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        require(self.kv_admission in KV_ADMISSIONS,
                 f"EngineConfig.kv_admission must be one of {KV_ADMISSIONS}, got {self.kv_admission!r}")
        require(isinstance(self.stall_timeout_s, (int, float)) and not isinstance(self.stall_timeout_s, bool)
                 and self.stall_timeout_s > 0, f"EngineConfig.stall_timeout_s must be a number > 0, "
                                               f"got {self.stall_timeout_s!r}")
        for name in ("memory_budget_gib", "activation_reserve_gib"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                   and (v > 0 or name != "memory_budget_gib")),
                     f"EngineConfig.{name} must be None or a number > 0 (>= 0 for the reserve), got {v!r}")


KV_ROLES = ("prefill", "decode")
FAILURE_POLICIES = ("fail", "recompute")  # vLLM's kv_load_failure_policy


@dataclass(frozen=True)
class KvTransferConfig:
    """A server's side of a prefill/decode split across servers (vLLM's ``KVTransferConfig``, SGLang's
    ``--disaggregation-mode``). ``prefill``: a request that asks for a remote decode is answered with
    its first token and a handle to its staged KV; ``decode``: a request that carries such a handle
    takes the KV from the prefill server instead of computing the prompt (``docs/pd.md``)."""

    role: str  # "prefill" | "decode"
    host: str = "127.0.0.1"  # prefill: the KV port's address, bound and advertised in every handle
    port: int = 0  # prefill: the KV port (0: any free one; handles name it)
    lease_s: float = 30.0  # prefill: an offered KV range nobody claimed this long is freed
    failure_policy: str = "recompute"  # decode: a handoff that fails: the request fails, or recomputes its prompt
    max_pending: int = 256  # decode: requests waiting for blocks or for their KV; beyond it new ones are refused
    buffer_mib: int | None = None  # the staging arena (default: room for 4 full-context requests, 64 MiB-1 GiB)
    # prefill: offer the KV where it is (the inner engine's cache shared: a decode server on this host
    # copies it once, one elsewhere pulls what this server gathers); False: copy it out into the arena first
    in_place: bool = True
    # what a decode server proves it knows to pair with a prefill server's KV port (None: no proof asked)
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        require(self.role in KV_ROLES, f"kv_transfer_config.role must be one of {KV_ROLES}, got {self.role!r}")
        require(isinstance(self.host, str) and self.host not in ("", "0.0.0.0", "::"),
                 f"kv_transfer_config.host is advertised to decode servers in every handle: give this host's "
                 f"address on the network they share, not {self.host!r}")
        require(isinstance(self.port, int) and 0 <= self.port < 65536,
                 f"kv_transfer_config.port must be a TCP port (0: any free one), got {self.port!r}")
        require(isinstance(self.lease_s, (int, float)) and not isinstance(self.lease_s, bool) and self.lease_s > 0,
                 f"kv_transfer_config.lease_s must be a number > 0, got {self.lease_s!r}")
        require(self.failure_policy in FAILURE_POLICIES,
                 f"kv_transfer_config.failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}")
        require(isinstance(self.max_pending, int) and self.max_pending > 0,
                 f"kv_transfer_config.max_pending must be a positive int, got {self.max_pending!r}")
        require(self.buffer_mib is None or (isinstance(self.buffer_mib, int) and self.buffer_mib > 0),
                 f"kv_transfer_config.buffer_mib must be a positive int, got {self.buffer_mib!r}")
        require(isinstance(self.in_place, bool), f"kv_transfer_config.in_place must be true or false, "
                                                 f"got {self.in_place!r}")
        require(self.secret is None or (isinstance(self.secret, str) and self.secret != ""),
                 "kv_transfer_config.secret must be a non-empty string (leave it unset for none)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy of the disaggregated (asap) scheduler; each optimization can be switched off."""

    min_batch_tokens: int = opt(256, "length-aware batching: form a batch once it holds this many tokens")
    max_batch_tokens: int = opt(16384, "S: never more tokens in one batch")
    max_batch_wait_s: float = opt(0.05, "... or once its oldest request has waited this long")
    long_prompt_tokens: int = opt(16384, "prompts above this run alone (no interleaving partner)")
    length_aware: bool = opt(True, "ablation: a batch of whatever is waiting, at once")
    dual_batch: bool = opt(True, "ablation: one batch per DP group at a time")
    # moeflow's addition to ASAP: a lone batch (no partner, no decode rows) of at least
    # min_split_tokens is cut at its token midpoint into two micro-batches that interleave like a
    # pair; the second attends to the first's KV of the same layer, written just before it.
    split_lone_batch: bool = opt(True, "ablation: never cut a lone batch into two halves", flag="--no-split")
    min_split_tokens: int = opt(512, "a lone batch of at least this many tokens is cut in two")

    def __post_init__(self) -> None:
        require(isinstance(self.min_batch_tokens, int) and self.min_batch_tokens > 0,
                 f"min_batch_tokens must be a positive int, got {self.min_batch_tokens!r}")
        require(isinstance(self.max_batch_tokens, int) and self.max_batch_tokens >= self.min_batch_tokens,
                 f"max_batch_tokens ({self.max_batch_tokens}) must be >= min_batch_tokens ({self.min_batch_tokens})")
        require(self.max_batch_wait_s >= 0, f"max_batch_wait_s must be >= 0, got {self.max_batch_wait_s}")
        require(self.long_prompt_tokens > 0, f"long_prompt_tokens must be > 0, got {self.long_prompt_tokens}")
