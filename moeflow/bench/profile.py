"""``moeflow profile``: measure the real engine here, for the simulator's profiled cost model.

Stage by stage, one torch thread as in the workers: one layer's attention block (attention,
MoE gate, weighted sum and combine) against (tokens, Σ pairs, sequences) for prompts, and against
(sequences, cached keys) for decode batches (the engine's decode kernel); one layer's experts against
routed (token, expert) pairs for each number of local experts a worker can hold; embedding and
logits. Then whole requests through the real asap and dep deployments: what a lone request's decode
step has beyond its stages is the per-message latency, what its TTFT has beyond them the bandwidth,
the transport cost the simulator charges. Writes JSON that ``sim/profiled.py`` reads.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from moeflow.bench.timing import median_s
from moeflow.config import DTYPES
from moeflow.measure.provenance import write_json
from moeflow.sim.profiled import fit_nonneg

ATTN_SHAPES = [  # (query lens, context lens) of one batch
    ([32], [0]), ([128], [0]), ([512], [0]), ([1024], [0]), ([2048], [0]), ([4096], [0]), ([6144], [0]),
    ([128] * 8, [0] * 8), ([512] * 4, [0] * 4), ([512] * 8, [0] * 8), ([1024] * 4, [0] * 4), ([2048] * 2, [0] * 2),
    ([512], [1536]), ([2048], [2048]), ([1024], [4096]), ([256, 1024], [0, 2048]),
    ([8192], [0]),  # the longest prompt a config here uses: beyond the samples, the fit extrapolates
]
# decode: (sequences, cached context) of a batch in which every sequence computes one new token
DECODE_SHAPES = [(1, 512), (1, 2048), (8, 2048), (32, 2048), (1, 8192), (8, 8192)]
# routed pairs spread evenly over the local experts: below the local count, only that many experts
# are read (a lone decode token reaches K of them), which a 16-pair point would overstate
ROUTED = [1, 2, 4, 8, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768]
PROMPTS = [128, 512, 1024, 2048, 4096]
DECODE_CONTEXTS = [512, 2048]  # lone requests decoding after these prompts: the per-step transport
DECODE_TOKENS = 17


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure stage costs here for the simulator (sim cost: profiled)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", required=True, metavar="FILE.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="auto: what this machine computes natively (the engine's own default)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and no engine runs (for tests)")
    p.set_defaults(func=run)


def pairs_of(q_lens: list[int], ctx_lens: list[int]) -> int:
    return sum(q * c + q * (q + 1) // 2 for q, c in zip(q_lens, ctx_lens))


def profile_stages(model_path: str, dtype_name: str, repeats: int, quick: bool) -> dict:
    import torch

    from moeflow.model.kv_cache import AttentionMetadata, KVCache
    from moeflow.model.moe import experts_grouped, plan_pairs, weighted_sum
    from moeflow.model.transformer import MoETransformer
    from moeflow.model.weights import LoadSpec, load_weights

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    cfg, w = load_weights(model_path, dtype)
    model = MoETransformer(cfg, w)
    layer = next(i for i, s in enumerate(cfg.sparse_layers) if s)
    g = torch.Generator().manual_seed(0)
    block = 16
    shapes = ATTN_SHAPES[:8] if quick else ATTN_SHAPES
    decodes = [([1] * b, [c] * b) for b, c in (DECODE_SHAPES[:2] if quick else DECODE_SHAPES)]
    blocks = max(sum(-(-(q + c) // block) for q, c in zip(qs, cs)) for qs, cs in shapes + decodes)
    cache = KVCache.for_model(cfg, blocks, block, dtype)
    attn = []
    for q_lens, ctx_lens in shapes + decodes:
        tables, nxt = [], 0
        for q, c in zip(q_lens, ctx_lens):
            n = -(-(q + c) // block)
            tables.append(tuple(range(nxt, nxt + n)))
            nxt += n
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, block)
        hidden = torch.randn(sum(q_lens), cfg.hidden_size, generator=g).to(dtype)

        def block_fn():
            a = model.attention(layer, hidden, meta, cache)
            ids, wts = model.route(layer, a.moe_input)
            plan = plan_pairs(ids, w.experts)
            routed = weighted_sum(hidden.shape[0], plan, a.moe_input[plan.token_index], wts)
            model.combine(layer, a, routed)

        attn.append({"q_lens": q_lens, "ctx_lens": ctx_lens, "tokens": sum(q_lens), "seqs": len(q_lens),
                     "pairs": pairs_of(q_lens, ctx_lens), "s": median_s(block_fn, repeats)})
    attn, dec = attn[:len(shapes)], attn[len(shapes):]
    # NOTE: relative: the prompts span 4 ms (32 tokens) to seconds (8192); in plain least squares the
    # 8192-token sample alone pulled a 4.7 ms per-sequence term in and priced 32-token prompts at +93%
    fit = fit_nonneg([[1, a["tokens"], a["pairs"], a["seqs"]] for a in attn], [a["s"] for a in attn], relative=True)
    dec_fit = fit_nonneg([[1, a["seqs"], a["pairs"]] for a in dec], [a["s"] for a in dec])

    experts: dict[str, list] = {}
    e = cfg.num_experts
    for local in sorted({e, e // 2, e // 4}, reverse=True):
        _, wl = load_weights(model_path, dtype, LoadSpec(attention=False, experts=tuple(range(local))))
        rows = []
        for n in (ROUTED[:7] if quick else ROUTED):
            counts = torch.full((local,), n // local, dtype=torch.int64)
            counts[: n % local] += 1
            x = torch.randn(n, cfg.hidden_size, generator=g).to(dtype)
            rows.append([n, median_s(lambda: experts_grouped(wl.experts, layer, x, counts), repeats)])
        experts[str(local)] = rows

    head = []
    for t, sampled in ([(128, 1), (2048, 1), (2048, 8), (8192, 16)] if not quick else [(128, 1), (512, 4)]):
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
        hid = torch.randn(sampled, cfg.hidden_size, generator=g).to(dtype)
        head.append({"tokens": t, "sampled": sampled,
                     "s": median_s(lambda: (model.embed(ids), model.logits(hid).argmax(-1)), repeats)})
    head_fit = fit_nonneg([[1, h["tokens"], h["sampled"]] for h in head], [h["s"] for h in head])
    return {"num_layers": cfg.num_layers, "num_experts": e, "top_k": cfg.num_experts_per_tok,
            "hidden_size": cfg.hidden_size,
            "attention": {"samples": attn, "fit": dict(zip(("c0", "per_token", "per_pair", "per_seq"), fit))},
            # a decode row's pairs are its keys: the context and the new token
            "decode": {"samples": dec, "fit": dict(zip(("c0", "per_seq", "per_key"), dec_fit))},
            "experts": experts,
            "head": {"samples": head, "fit": dict(zip(("c0", "per_token", "per_sampled"), head_fit))}}


def profile_engine(model: str, dtype: str, mode: str, kwargs: dict, repeats: int) -> tuple[list[dict], list[dict]]:
    """TTFT of lone requests (nothing else running) through a real deployment, and the median
    inter-token time of lone requests decoding."""
    from moeflow import LLM, SamplingParams

    out, decodes = [], []
    rng = np.random.default_rng(0)
    with LLM(model=model, mode=mode, dtype=dtype, **kwargs) as llm:
        vocab = llm.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([[1] * 16], params)  # warm-up
        for n in PROMPTS:
            ttfts = []
            for _ in range(repeats):
                o = llm.generate([rng.integers(0, vocab, n).tolist()], params)[0]
                ttfts.append(o.metrics.ttft_s)
            out.append({"prompt_len": n, "ttft_s": statistics.median(ttfts)})
        decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        for n in DECODE_CONTEXTS:
            o = llm.generate([rng.integers(0, vocab, n).tolist()], decode)[0]
            t = o.metrics.token_times_s
            decodes.append({"context": n, "tokens": len(t), "tpot_s": statistics.median(np.diff(t).tolist())})
    return out, decodes


ENGINES = {  # the layouts the validation runs; no lone-batch wait or split, so a request runs as is
    "asap": ("asap", {"attn_dp": 1, "moe_workers": 1, "max_batch_wait_s": 0.0, "split_lone_batch": False}),
    "dep": ("dep", {"dp": 2}),
}


def run(args: argparse.Namespace) -> int:
    from moeflow.engine.llm import resolve_model
    from moeflow.hardware import resolve_dtype
    from moeflow.model.weights import load_config

    t0 = time.perf_counter()
    path = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, load_config(path)[0].checkpoint_dtype).dtype
    prof = {"model": args.model, "dtype": dtype, "threads": 1, "machine": platform.processor() or platform.machine()}
    prof.update(profile_stages(path, dtype, args.repeats, args.quick))
    prof["engine"] = {}
    if not args.quick:
        for name, (mode, kw) in ENGINES.items():
            samples, decodes = profile_engine(args.model, dtype, mode, kw, args.repeats)
            prof["engine"][name] = {"layout": kw, "samples": samples, "decode_samples": decodes}
    write_json(args.json, prof)
    a = prof["attention"]["fit"]
    print(f"attention block per layer: {a['c0'] * 1e3:.2f} ms + {a['per_token'] * 1e6:.2f} us/token "
          f"+ {a['per_pair'] * 1e9:.3f} ns/pair + {a['per_seq'] * 1e3:.3f} ms/seq")
    d = prof["decode"]["fit"]
    print(f"decode attention block per layer: {d['c0'] * 1e3:.2f} ms + {d['per_seq'] * 1e6:.1f} us/seq "
          f"+ {d['per_key'] * 1e9:.2f} ns/cached key")
    for local, rows in prof["experts"].items():
        print(f"experts, {local} local: " + ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in rows))
    for name, e in prof["engine"].items():
        print(f"{name} {e['layout']}: TTFT " + ", ".join(f"{s['prompt_len']}: {s['ttft_s'] * 1e3:.0f} ms" for s in e["samples"])
              + "; TPOT " + ", ".join(f"{s['context']}: {s['tpot_s'] * 1e3:.1f} ms" for s in e["decode_samples"]))
    print(f"wrote {args.json} in {time.perf_counter() - t0:.0f} s")
    return 0
