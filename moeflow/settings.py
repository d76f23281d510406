"""The one place environment variables are read."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where generated artifacts (the embedded model) are kept: $MOEFLOW_CACHE_DIR or ~/.cache/moeflow."""
    return os.environ.get("MOEFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeflow")


def logging_level() -> str:
    """Level of moeflow's own log lines: $MOEFLOW_LOGGING_LEVEL (DEBUG, INFO, WARNING, ...), default INFO."""
    return os.environ.get("MOEFLOW_LOGGING_LEVEL", "INFO").upper()


def hf_hub_offline() -> bool:
    """$HF_HUB_OFFLINE: resolve hub model names from the local cache only (huggingface_hub's own switch)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache() -> str | None:
    """$HF_HUB_CACHE (huggingface_hub's cache of downloaded repositories), None: its default."""
    return os.environ.get("HF_HUB_CACHE") or None


def extension_dir() -> str:
    """Where C++ extensions are built: $TORCH_EXTENSIONS_DIR (torch's own switch) or ~/.cache/moeflow/ext.

    NOTE: not under $MOEFLOW_CACHE_DIR: tests point that at temporary directories, and every one of
    their processes would rebuild (builds are keyed by source and CPU, so sharing them is safe)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeflow", "ext")


def cxx_compiler() -> str:
    """The C++ compiler torch's extension builder runs: $CXX or c++."""
    return os.environ.get("CXX") or "c++"


def paged_attention_mode() -> str:
    """$MOEFLOW_PAGED_ATTENTION: how decode attention reads the KV cache (``model/paged_attention.py``):
    auto (default), gather (force the per-request gather, for before/after runs) or kernel (require it)."""
    return os.environ.get("MOEFLOW_PAGED_ATTENTION", "auto").strip().lower() or "auto"


def decode_graphs_mode() -> str:
    """$MOEFLOW_DECODE_GRAPHS: ``eager`` runs decode through the CUDA graphs' static buffers and padded
    buckets without capturing (``model/decode_graphs.py``: the CPU rehearsal of that path, for tests
    and benchmarks); unset: graphs as ``EngineConfig.cuda_graph`` says."""
    mode = os.environ.get("MOEFLOW_DECODE_GRAPHS", "").strip().lower()
    if mode not in ("", "eager"):
        raise ValueError(f"MOEFLOW_DECODE_GRAPHS must be eager or unset, got {mode!r}")
    return mode


def kv_copy_mode() -> str:
    """$MOEFLOW_KV_COPY: how the KV handoff's in-place copy runs on the CPU (``model/kv_copy.py``):
    auto (default: the C++ op where it builds) or torch (a torch copy per run; raises on any other)."""
    mode = os.environ.get("MOEFLOW_KV_COPY", "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch"):
        raise ValueError(f"MOEFLOW_KV_COPY must be auto or torch, got {mode!r}")
    return mode


def gloo_socket_ifname() -> str | None:
    """$GLOO_SOCKET_IFNAME (gloo's own switch): the interface gloo binds between hosts; None: moeflow
    picks the one on the route to node 0 (``workers/interface.py``)."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or None


def set_gloo_socket_ifname(name: str) -> None:
    """Make this process's gloo groups bind ``name``: gloo reads only its environment variable."""
    os.environ["GLOO_SOCKET_IFNAME"] = name


def api_key() -> str | None:
    """The server's API key from $MOEFLOW_API_KEY, else $VLLM_API_KEY (vLLM's, for drop-in use): a key
    on the command line is visible to every user in /proc/<pid>/cmdline."""
    return os.environ.get("MOEFLOW_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def kv_secret() -> str | None:
    """$MOEFLOW_KV_SECRET: what a decode server proves it knows to pair with a prefill server's KV port."""
    return os.environ.get("MOEFLOW_KV_SECRET") or None


def launcher_env() -> dict[str, object]:
    """What a torchrun- or SLURM-style launcher says about the hosts, by ``ClusterConfig`` field
    (one moeflow process per host): nnodes from $GROUP_WORLD_SIZE (torchrun's node count) or
    $WORLD_SIZE, node_rank from $NODE_RANK or $GROUP_RANK (torchrun's), $MASTER_ADDR, $MASTER_PORT,
    and agent_store when torchrun's agent already hosts a store there ($TORCHELASTIC_USE_AGENT_STORE)."""
    env = os.environ
    out: dict[str, object] = {}
    for field, names in (("nnodes", ("GROUP_WORLD_SIZE", "WORLD_SIZE")), ("node_rank", ("NODE_RANK", "GROUP_RANK")),
                         ("master_addr", ("MASTER_ADDR",)), ("master_port", ("MASTER_PORT",))):
        value = next((env[n] for n in names if env.get(n)), None)
        if value is not None:
            out[field] = value
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        out["agent_store"] = True
    return out


def pd_fail_prob() -> float:
    """MOEFLOW_PD_FAIL_PROB: the chance that a KV handoff's copy is made to fail (SGLang's failure
    injection for its disaggregation tests); 0 unless set."""
    raw = os.environ.get("MOEFLOW_PD_FAIL_PROB", "").strip()
    try:
        p = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"MOEFLOW_PD_FAIL_PROB must be a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"MOEFLOW_PD_FAIL_PROB must be a number in [0, 1], got {raw!r}")
    return p
