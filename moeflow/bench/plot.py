"""``moeflow bench plot``: mean TTFT vs request rate for one or more ``bench serve`` JSON files."""
from __future__ import annotations

import argparse
import json

from moeflow.measure.plot import expand, plot_results


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="mean TTFT vs rate of `bench serve` JSON files, with the SLO line")
    p.add_argument("inputs", nargs="+", metavar="RESULT.json")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--title", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    results = []
    for path in args.inputs:
        with open(path) as f:
            results.extend(expand(json.load(f)))
    plot_results(results, args.out, args.title)
    print(f"wrote {args.out}")
    return 0
