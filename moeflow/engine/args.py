"""Command-line flags of a deployment, generated from the layouts' fields and shared by every
command that starts one (generate, serve, bench serve/prefill, profile).

Every flag defaults to "not given", so a layout's own defaults apply; a flag that several modes
share (``--max-batch-tokens``) sets the field of whichever mode runs, and a flag the chosen mode
does not have is refused with the mode's options.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from moeflow.config import DTYPES, KV_ADMISSIONS, TRANSPORTS, ClusterConfig, ConfigError
from moeflow.layout import LAYOUTS, is_layout_field, nested, parse_parts
from moeflow.settings import launcher_env

_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float}
# pd's flags that also set a role server's KvTransferConfig (its field names)
_ROLE_FLAGS = {"kv_lease_s": "lease_s", "kv_load_failure_policy": "failure_policy",
               "max_pending_handoffs": "max_pending", "kv_buffer_mib": "buffer_mib"}


def _flag(f: dataclasses.Field, default) -> str:
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if default is True else f"--{name}"


def _layout_options() -> dict[str, tuple[dataclasses.Field, object, list[str], type]]:
    """flag -> (field, default, modes having it, value type), over every layout and its sub-configs."""
    out: dict[str, tuple[dataclasses.Field, object, list[str], type]] = {}
    for mode, cls in LAYOUTS.items():
        subs = nested(cls)
        for owner in (cls, *subs.values()):
            for f in dataclasses.fields(owner):
                if f.name in subs or not f.metadata.get("cli", False):
                    continue
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                flag = _flag(f, default)
                if flag in out:
                    out[flag][2].append(mode)
                else:
                    kind = bool if isinstance(default, bool) else _TYPES[str(owner.__annotations__[f.name])]
                    out[flag] = (f, default, [mode], kind)
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help='a local Hugging Face directory, a hub name (org/name, through '
                   'the Hugging Face cache), or "tiny" / "tiny-mla" (embedded, random weights)')
    p.add_argument("--revision", default=None, help="hub models: the branch, tag or commit")
    p.add_argument("--mode", default="colocated", choices=sorted(LAYOUTS),
                   help="; ".join(f"{m}: {c.summary}" for m, c in sorted(LAYOUTS.items())))
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="auto: the checkpoint's dtype where this machine computes it natively, else float32")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees one), cpu, cuda (workers spread "
                   "over the GPUs by rank) or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    lim = p.add_argument_group("engine limits (default: LLM's)")
    lim.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    lim.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    lim.add_argument("--kv-admission", default=None, choices=list(KV_ADMISSIONS),
                     help="KV blocks as a sequence grows, preempting by recompute when a group runs out "
                          "(on-demand, the default), or for a request's whole life at admission (reserve)")
    lim.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks per attention group")
    lim.add_argument("--memory-budget-gib", type=float, default=None,
                     help="bytes each process may hold (weights, buffers, activations, KV cache): sets --num-kv-blocks "
                          "from what the mode puts on each process")
    lim.add_argument("--activation-reserve-gib", type=float, default=None,
                     help="activation memory kept out of the budget (default: estimated from the model and batch limits)")
    run = p.add_argument_group("processes")
    run.add_argument("--pin-cpus", action="store_true", help="pin each worker process to one CPU")
    run.add_argument("--transport", default="shm", choices=list(TRANSPORTS), help="dispatch/combine transport")
    run.add_argument("--trace", default=None, metavar="FILE.json", help="write a Chrome/Perfetto trace")
    run.add_argument("--share-kv-cache", action="store_true",
                     help="keep the attention side's KV caches in host shared memory (a leaving attention group's "
                          "requests are then handed over, docs/elastic.md)")
    graphs = run.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graph", dest="cuda_graph", action="store_const", const=True, default=None,
                        help="decode from CUDA graphs (the default on CUDA; refused elsewhere)")
    graphs.add_argument("--enforce-eager", dest="cuda_graph", action="store_const", const=False,
                        help="no CUDA graphs: every decode step launched op by op")
    run.add_argument("--stall-timeout-s", type=float, default=None,
                     help="a work item its workers leave unanswered this long fails the deployment as a dead "
                          "worker would (default 60)")
    eplb = p.add_argument_group("expert load balancing (docs/eplb.md)")
    eplb.add_argument("--enable-eplb", action="store_true", help="rebalance the expert placement from the routed "
                      "load while serving (dep, asap, afd with topology all); --num-redundant-experts adds slots")
    eplb.add_argument("--eplb-config", type=_json, default=None, metavar="JSON",
                      help='{"window_size": work items of load (1000), "step_interval": work items between '
                      'rebalances (3000), "num_groups": expert groups, "policy": auto|hierarchical|global, '
                      '"log_balancedness": false}')
    eplb.add_argument("--init-expert-location", default="trivial", metavar="trivial|FILE.json",
                      help="the placement to start from: trivial (contiguous), or a JSON file with a logical_count "
                      "(recorded load, as GET /expert_distribution writes; placed by the EPLB policy) or a "
                      "physical_to_logical_map (every slot's expert)")
    eplb.add_argument("--router-skew", type=float, default=None, metavar="S",
                      help="benchmarks only: tilt every MoE gate toward a Zipf(S) popularity of experts, a different "
                      "order per layer, so the load is as skewed as a trained model's (changes the outputs)")
    add_cluster_args(p)
    lay = p.add_argument_group("layout (each applies to the modes named)")
    for side in ("prefill", "decode"):
        lay.add_argument(f"--{side}", default=None, metavar="'mode=M,key=value,...'",
                         help=f"pd: the layout of each {side} instance, as a mode and its options (pd)")
    for flag, (f, default, modes, kind) in sorted(_layout_options().items()):
        help = f"{f.metadata['help']} ({', '.join(modes)})"
        dest = f"layout__{f.name}"
        if kind is bool:
            lay.add_argument(flag, dest=dest, action="store_false" if default else "store_true", default=None, help=help)
        else:
            lay.add_argument(flag, dest=dest, type=kind, default=None, choices=f.metadata.get("choices"),
                             help=f"{help} [default: {default}]")


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """torchrun's flags; each defaults to its environment variable, then to one host."""
    g = p.add_argument_group("several hosts (as torchrun; defaults from $WORLD_SIZE, $NODE_RANK, $MASTER_ADDR, "
                             "$MASTER_PORT)")
    g.add_argument("--nnodes", type=int, default=None, help="hosts in the deployment (default 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this host: 0 runs the engine and the server, "
                   "others only workers (default 0)")
    g.add_argument("--master-addr", default=None, help="node 0's address, reachable from every host")
    g.add_argument("--master-port", type=int, default=None, help="the rendezvous's port on node 0 (default 29500)")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The hosts from the flags, else the launcher's environment, else one host."""
    given = {k: v for k, v in launcher_env().items()}
    for name in ("nnodes", "node_rank", "master_addr", "master_port"):
        if getattr(args, name, None) is not None:
            given[name] = getattr(args, name)
    try:
        return ClusterConfig(**{k: v if k in ("master_addr", "agent_store") else int(v) for k, v in given.items()})
    except ValueError as e:
        raise ConfigError(f"several hosts: {e}") from None


def layout_kwargs(args: argparse.Namespace) -> dict:
    """The layout fields given on the command line (flat: sub-config fields included)."""
    return {k.removeprefix("layout__"): v for k, v in vars(args).items()
            if k.startswith("layout__") and v is not None}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``LLM`` for the parsed flags; refuses flags the chosen mode lacks."""
    kw = dict(model=args.model, revision=args.revision, mode=args.mode, dtype=args.dtype, device=args.device,
              seed=args.seed,
              num_threads=args.threads,
              pin_cpus=args.pin_cpus, transport=args.transport, trace=args.trace is not None,
              cluster=cluster_config(args), enable_eplb=getattr(args, "enable_eplb", False),
              eplb_config=getattr(args, "eplb_config", None),
              init_expert_location=getattr(args, "init_expert_location", "trivial"),
              share_kv_cache=getattr(args, "share_kv_cache", False))
    for name in ("max_model_len", "max_num_seqs", "num_kv_blocks", "memory_budget_gib", "activation_reserve_gib",
                 "stall_timeout_s", "kv_admission", "router_skew", "cuda_graph"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    given = layout_kwargs(args)
    if getattr(args, "role", None) is not None:  # serve --role: pd's handoff flags set this server's side
        kv = {"role": args.role, "host": args.kv_host, "port": args.kv_port,
              "in_place": not getattr(args, "kv_staged", False)}
        for flag, key in _ROLE_FLAGS.items():
            if flag in given:
                kv[key] = given.pop(flag)
        kw["kv_transfer_config"] = kv
    for side in ("prefill", "decode"):
        if getattr(args, side, None) is not None:
            if args.mode != "pd":
                raise ConfigError(f"--{side}: not an option of mode {args.mode!r} (it is pd's)")
            given[side] = parse_parts(getattr(args, side), f"--{side}")
    options = _layout_options()
    foreign = sorted(flag for flag, (f, _, modes, _) in options.items() if f.name in given and args.mode not in modes)
    if foreign:
        raise ConfigError(f"{', '.join(foreign)}: not an option of mode {args.mode!r}")
    return {**kw, **given}


def layout_flags(layout) -> list[str]:
    """The flags that start a deployment with ``layout`` (``moeflow serve --mode M ...``): each field that
    differs from its default (a sub-config's flat; pd's sides as ``--prefill``/``--decode`` strings of
    ``key=value`` items), so that parsing them gives ``layout`` back."""
    out = ["--mode", layout.mode]
    for f, default, value in _changed(layout):
        if is_layout_field(f):
            out += [f"--{f.name}", ",".join([f"mode={value.mode}"] + [f"{g.name}={v}" for g, _, v in _changed(value)])]
        else:
            flag = _flag(f, default)
            out += [flag] if isinstance(default, bool) else [flag, str(value)]
    return out


def _changed(layout):
    """(field, default, value) of each field of ``layout`` (and its sub-configs) that differs from its default."""
    subs = nested(type(layout))
    for owner in [layout] + [getattr(layout, name) for name in subs]:
        for f in dataclasses.fields(owner):
            if f.name in subs or not (f.metadata.get("cli", False) or is_layout_field(f)):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            value = getattr(owner, f.name)
            if value != default:
                yield f, default, value
