"""The soak run's verdict, figure and summary (``moeflow bench soak`` writes them).

Pass: every request answered (no client-side timeout or broken connection), no unexpected 5xx
(only the kill's 500s for requests in flight at the kill and 503s while the deployment was
rebuilt), bad requests refused with their 4xx, no upward RSS trend in any process after its warm-up,
no descriptor leak in the server, at most one deployment's segments in /dev/shm at any time, and
no process or segment left after shutdown.
"""
from __future__ import annotations

import numpy as np

EXPECTED_4XX = {"bad_json": 400, "bad_field": 400, "bad_model": 404, "too_big": 413}
WARMUP_S = 60.0
IN_FLIGHT_GRACE_S = 10.0  # a request in flight at the kill ends with its error within this
TREND_LIMIT = 0.05  # fitted growth over a process's life after warm-up, as a fraction of its mean RSS
TREND_FLOOR_MB = 10.0  # growth below this is allocator noise, whatever the fraction


def classify(a: dict, kill: dict) -> str:
    """ok | refused (an expected 4xx) | kill_500 | restart_503 | disconnected | unexpected_5xx | wrong | unanswered."""
    at, healed = kill.get("at_s", float("inf")), kill.get("healed_at_s", float("inf"))
    if a["note"] is not None and a["note"] != "disconnected":
        return "unanswered"
    if a["kind"] in EXPECTED_4XX:
        return "refused" if a["status"] == EXPECTED_4XX[a["kind"]] else ("unexpected_5xx" if a["status"] >= 500 else "wrong")
    if a["status"] == 503 and a["code"] == "engine_unavailable" and at <= a["sent_s"] <= healed + 1.0:
        return "restart_503"
    if a["code"] == "engine_failed" and a["sent_s"] <= at + 1.0 and a["end_s"] <= at + IN_FLIGHT_GRACE_S:
        return "kill_500"
    if a["status"] >= 500 or a["code"] is not None:
        return "unexpected_5xx"
    if a["note"] == "disconnected":
        return "disconnected"
    return "ok" if a["status"] == 200 and a["finish"] == "length" else "wrong"


def _series(samples: list[dict]) -> dict[str, dict]:
    """Per process: role, times, RSS (MB), descriptors."""
    out: dict[str, dict] = {}
    for s in samples:
        for pid, p in s["procs"].items():
            d = out.setdefault(pid, {"role": p["role"], "t": [], "rss": [], "fds": []})
            d["t"].append(s["t"])
            d["rss"].append(p["rss_mb"])
            d["fds"].append(p["fds"])
    return out


def _trend(t: list[float], y: list[float]) -> tuple[float, float] | None:
    """(slope MB/min, fitted growth over the span MB) after the process's own warm-up (a worker
    started by the restart warms up again: counted from the load's start, its first batches were
    fitted as growth); None if too few samples."""
    since = t[0] + WARMUP_S if t else 0.0
    tt = np.array([x for x in t if x >= since])
    yy = np.array([v for x, v in zip(t, y) if x >= since])
    if len(tt) < 6 or tt[-1] - tt[0] < 60:
        return None
    slope = float(np.polyfit(tt, yy, 1)[0])
    return slope * 60, slope * (tt[-1] - tt[0])


def judge(r: dict) -> dict:
    kill = r["kill"]
    classes: dict[str, int] = {}
    for a in r["answers"]:
        c = classify(a, kill)
        classes[c] = classes.get(c, 0) + 1
    memory = {}
    for pid, d in _series(r["samples"]).items():
        tr = _trend(d["t"], d["rss"])
        if tr is not None:
            slope, growth = tr
            mean = float(np.mean(d["rss"]))
            memory[pid] = {"role": d["role"], "mean_mb": round(mean, 1), "slope_mb_per_min": round(slope, 3),
                           "growth_mb": round(growth, 2),
                           "bounded": bool(growth < max(TREND_FLOOR_MB, TREND_LIMIT * mean))}
    server = next(d for d in _series(r["samples"]).values() if d["role"] == "server")
    half = len(server["fds"]) // 2
    # NOTE: the floor, not the peak: each open client connection (served, queued or kept alive) is
    # a descriptor, so peaks follow the load; a leak raises the count the server returns to
    fds_first, fds_last = min(server["fds"][:half] or [0]), min(server["fds"][half:] or [0])
    max_deployments = max(s["shm"]["deployments"] for s in r["samples"])
    after = r["after_shutdown"]
    checks = {
        "every request answered": classes.get("unanswered", 0) == 0,
        "no unexpected 5xx": classes.get("unexpected_5xx", 0) == 0,
        "bad requests refused with their 4xx, good ones complete": classes.get("wrong", 0) == 0,
        "the kill failed requests and the server healed": classes.get("kill_500", 0) > 0 and "healed_at_s" in kill,
        "bounded memory after warm-up": all(m["bounded"] for m in memory.values()),
        "no descriptor leak in the server": fds_last <= fds_first + 2,
        "one deployment's segments at most": max_deployments <= 1,
        "nothing left after shutdown": not after["processes_left"] and after["shm"]["files"] == 0,
    }
    checks = {k: bool(ok) for k, ok in checks.items()}
    return {"pass": all(checks.values()), "checks": checks, "answers": classes, "memory": memory,
            "server_fds": {"first_half_floor": fds_first, "second_half_floor": fds_last,
                           "peak": max(server["fds"])},
            "max_deployments_in_shm": max_deployments,
            "heal_s": (kill["healed_at_s"] - kill["at_s"]) if "healed_at_s" in kill else None}


def write_report(r: dict, out: str) -> None:
    _plot(r, out + ".png")
    v = r["verdict"]
    name = out.rsplit("/", 1)[-1]
    lines = ["# Soak: a server under load, with disconnects, bad requests and a worker kill (issue 18, item 7)", "",
             f"`{' '.join(r['command'][2:])}` driven by `moeflow bench soak` (provenance in `{name}.json`).", "",
             f"![RSS, descriptors, /dev/shm and latency over time]({name}.png)", "",
             f"Soak: {r['duration_s']:.0f} s at {r['rps']} rps (production x {r['length_scale']}), "
             f"{len(r['answers'])} requests; MoE worker pid {r['kill'].get('pid')} SIGKILLed at "
             f"{r['kill'].get('at_s', float('nan')):.0f} s, serving again after "
             f"{v['heal_s'] if v['heal_s'] is not None else float('nan'):.1f} s. Verdict: "
             f"{'PASS' if v['pass'] else 'FAIL'}.", "", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'yes' if ok else '**no**'} |" for k, ok in v["checks"].items()]
    lines += ["", "| answers | count |", "|---|---|"] + [f"| {k} | {n} |" for k, n in sorted(v["answers"].items())]
    lines += ["", "| process | mean RSS MB | slope MB/min after warm-up | fitted growth MB |", "|---|---|---|---|"]
    lines += [f"| {m['role']} {pid} | {m['mean_mb']} | {m['slope_mb_per_min']} | {m['growth_mb']} |"
              for pid, m in v["memory"].items()]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for pid, d in _series(r["samples"]).items():
        ax[0].plot(d["t"], d["rss"], label=f"{d['role']} {pid}")
        if d["role"] == "server":
            ax[1].plot(d["t"], d["fds"], label=f"server {pid}")
    ax[0].set_ylabel("RSS MB")
    ax[0].legend(fontsize=7)
    ax[1].set_ylabel("open fds (server)")
    t = [s["t"] for s in r["samples"]]
    ax[2].plot(t, [s["shm"]["mb"] for s in r["samples"]])
    ax[2].set_ylabel("/dev/shm MB")
    kill = r["kill"]
    for cls, color in (("ok", "tab:blue"), ("kill_500", "tab:red"), ("restart_503", "tab:orange"),
                       ("unexpected_5xx", "black")):
        pts = [(a["sent_s"], a["end_s"] - a["sent_s"]) for a in r["answers"] if classify(a, kill) == cls]
        if pts:
            ax[3].scatter(*zip(*pts), s=6, color=color, label=cls)
    ax[3].set_ylabel("request latency s")
    ax[3].set_yscale("log")
    ax[3].legend(fontsize=7)
    ax[3].set_xlabel("seconds since the load started")
    for a in ax:
        if "at_s" in kill:
            a.axvline(kill["at_s"], color="red", lw=0.8, ls="--")
        if "healed_at_s" in kill:
            a.axvline(kill["healed_at_s"], color="green", lw=0.8, ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
