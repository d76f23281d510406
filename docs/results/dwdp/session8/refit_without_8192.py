"""The session-8 profile with its 8192-token attention sample left out and the block fit redone the
way ``moeflow profile`` does it: isolates what sampling the longest prompt changes from how the
machine drifted between sessions.

    python docs/results/dwdp/session8/refit_without_8192.py docs/results/dwdp/session8/profile.json OUT.json
"""
from __future__ import annotations

import json
import sys

from moeflow.bench.provenance import write_json
from moeflow.sim.profiled import fit_nonneg


def main(src: str, dst: str) -> None:
    with open(src) as f:
        prof = json.load(f)
    prof.pop("provenance", None)
    kept = [a for a in prof["attention"]["samples"] if max(a["q_lens"]) < 8192]
    fit = fit_nonneg([[1, a["tokens"], a["pairs"], a["seqs"]] for a in kept], [a["s"] for a in kept])
    prof["attention"] = {"samples": kept, "fit": dict(zip(("c0", "per_token", "per_pair", "per_seq"), fit))}
    prof["derived_from"] = src
    write_json(dst, prof)
    print(f"{len(kept)} samples; fit {prof['attention']['fit']}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
