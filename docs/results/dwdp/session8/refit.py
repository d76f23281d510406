"""The session-8 profile's attention block fit redone the way ``moeflow profile`` does it, with its
8192-token sample left out (``--without-8192``) and/or each sample weighted by 1/time
(``--relative``: least squares on relative errors, as ``moeflow profile`` fits since session 8):
isolates what the sample and the weighting change from how the machine drifted between sessions.

    python docs/results/dwdp/session8/refit.py SRC.json OUT.json [--without-8192] [--relative]
"""
from __future__ import annotations

import argparse
import json

from moeflow.measure.provenance import write_json
from moeflow.sim.profiled import fit_nonneg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--without-8192", action="store_true")
    ap.add_argument("--relative", action="store_true")
    args = ap.parse_args()
    with open(args.src) as f:
        prof = json.load(f)
    prof.pop("provenance", None)
    kept = [a for a in prof["attention"]["samples"] if not (args.without_8192 and max(a["q_lens"]) >= 8192)]
    fit = fit_nonneg([[1, a["tokens"], a["pairs"], a["seqs"]] for a in kept], [a["s"] for a in kept],
                     relative=args.relative)
    prof["attention"] = {"samples": kept, "fit": dict(zip(("c0", "per_token", "per_pair", "per_seq"), fit))}
    prof["derived_from"] = {"profile": args.src, "without_8192": args.without_8192, "relative": args.relative}
    write_json(args.dst, prof)
    print(f"{len(kept)} samples; fit {prof['attention']['fit']}")
    for a in prof["attention"]["samples"]:  # the fit against every sample the profile has, kept or not
        pred = fit[0] + fit[1] * a["tokens"] + fit[2] * a["pairs"] + fit[3] * a["seqs"]
        print(f"  q {a['q_lens']} ctx {a['ctx_lens']}: {a['s'] * 1e3:.1f} ms measured, {pred / a['s'] - 1:+.0%}")


if __name__ == "__main__":
    main()
