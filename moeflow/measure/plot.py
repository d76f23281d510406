"""Mean TTFT vs request rate of ``bench serve`` results (measured or simulated), with the SLO line.

matplotlib is imported when a plot is drawn, not before (the simulator imports this module).
"""
from __future__ import annotations


def expand(data: dict) -> list[dict]:
    """A ``bench serve`` result, or ``moeflow simulate``'s ``{"systems": {name: result}}``."""
    return list(data["systems"].values()) if "systems" in data else [data]


def label(result: dict) -> str:
    """Mode and process layout, e.g. "asap D=2 T=1 E=2", "dep dp=4 chunk=512", plus ablations;
    a simulated result is named by its system, e.g. "sim: asap"."""
    c = result.get("config", {})
    if result.get("simulated"):
        return f"sim: {c.get('name', result.get('mode', '?'))}"
    parts = [result.get("mode", "?")]
    if "attn_dp" in c:
        parts.append(f"D={c['attn_dp']} T={c.get('attn_tp', 1)} E={c.get('moe_workers', 1)}")
    if "dp" in c:
        parts.append(f"dp={c['dp']}")
    if c.get("chunked_prefill_size"):
        parts.append(f"chunk={c['chunked_prefill_size']}")
    if "prefill" in c:  # pd: its two sides (a layout's dict in a result file, a short name in the demo)
        side = (lambda x: x.get("mode", "?") if isinstance(x, dict) else x)
        parts.append(f"{side(c['prefill'])} -> {side(c['decode'])}")
    for flag, name in (("dual_batch", "no-dual-batch"), ("length_aware", "no-length-aware"),
                       ("comm_threads", "no-comm-threads"), ("recv_thread", "no-comm-threads")):
        if c.get(flag) is False:
            parts.append(name)
    return " ".join(parts)


def plot_results(results: list[dict], out: str, title: str | None = None) -> None:
    """One line per result (points of runs stopped early drawn as crosses at their lower bound)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on these machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        pts = sorted((p for p in res["points"] if p["ttft_mean_s"] is not None), key=lambda p: p["rps"])
        full = [p for p in pts if not p.get("stopped_early")]
        (line,) = ax.plot([p["rps"] for p in full], [p["ttft_mean_s"] for p in full], marker="o", label=label(res))
        stopped = [p for p in pts if p.get("stopped_early")]
        if stopped:
            ax.plot([p["rps"] for p in stopped], [p["ttft_mean_s"] for p in stopped], "x", color=line.get_color())
        if res.get("slo_rps") is not None:
            ax.axvline(res["slo_rps"], color=line.get_color(), linestyle=":", linewidth=1)
    for slo in sorted({r["slo_ttft_s"] for r in results if r.get("slo_ttft_s") is not None}):
        ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_ylim(bottom=0)
    _finish(fig, ax, out, title)


def plot_pareto(systems: dict[str, dict], out: str, title: str | None = None) -> None:
    """DWDP's end-to-end axes: per system, output tokens/s per process against TPS/user (the mean
    of 1/TPOT), one point per rate (labelled), with each point's 95% intervals over repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in systems.items():
        pts = sorted((p for p in res["points"] if p.get("tps_user_mean") is not None), key=lambda p: p["rps"])
        if not pts:
            continue
        xs, ys = [p["tps_user_mean"] for p in pts], [p["output_tok_s_per_process"] for p in pts]
        xerr = [[x - (p.get("tps_user_mean_ci") or [x, x])[0] for x, p in zip(xs, pts)],
                [(p.get("tps_user_mean_ci") or [x, x])[1] - x for x, p in zip(xs, pts)]]
        yerr = [[y - (p.get("output_tok_s_per_process_ci") or [y, y])[0] for y, p in zip(ys, pts)],
                [(p.get("output_tok_s_per_process_ci") or [y, y])[1] - y for y, p in zip(ys, pts)]]
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, marker="o", capsize=3, label=name)
        for x, y, p in zip(xs, ys, pts):
            ax.annotate(f"{p['rps']:g} rps", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("TPS/user (tokens/s per request: mean of 1/TPOT)")
    ax.set_ylabel("output tokens/s per process")
    _finish(fig, ax, out, title)


def plot_fronts(fronts: dict[str, list], out: str, xlabel: str, ylabel: str, title: str | None = None) -> None:
    """Pareto fronts, one line per system: ``fronts[name]`` is its [x, y] points by ascending x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, front in fronts.items():
        ax.plot([p[0] for p in front], [p[1] for p in front], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    _finish(fig, ax, out, title)


def _finish(fig, ax, out: str, title: str | None) -> None:
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
