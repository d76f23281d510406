"""``moeflow bench plot``: mean TTFT vs request rate for one or more ``bench serve`` JSON files, or
(``--pareto``) a ``bench compare`` result's output tokens/s per process against TPS/user."""
from __future__ import annotations

import argparse
import json

from moeflow.measure.plot import expand, plot_pareto, plot_results


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="mean TTFT vs rate of `bench serve` JSON files, with the SLO line")
    p.add_argument("inputs", nargs="+", metavar="RESULT.json")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--title", default=None)
    p.add_argument("--pareto", action="store_true", help="bench compare results: output tokens/s per process "
                   "against TPS/user, one point per rate (DWDP's end-to-end axes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.pareto:
        systems = {}
        for path in args.inputs:
            with open(path) as f:
                systems.update(json.load(f)["systems"])
        plot_pareto(systems, args.out, args.title)
        print(f"wrote {args.out}")
        return 0
    results = []
    for path in args.inputs:
        with open(path) as f:
            results.extend(expand(json.load(f)))
    plot_results(results, args.out, args.title)
    print(f"wrote {args.out}")
    return 0
