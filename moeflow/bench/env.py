"""``moeflow env``: the hardware report — what this machine computes natively and how fast."""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="hardware report: CPU, ISA, measured GEMM rates per dtype, memcpy, shm latency")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.hardware.report import measure

    r = measure()
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    rows = [("CPU", r["cpu_model"]), ("ISA (torch)", r["isa"]), ("ISA flags", " ".join(r["isa_flags"]) or "-"),
            ("cores", r["cores"]), ("torch", r["torch"]), ("python", r["python"]),
            ("native dtypes", ", ".join(r["native_dtypes"]))]
    for d, g in r["gemm"].items():
        m, k, n = g["shape"]
        rows.append((f"GEMM {d} (1 thread)", f"{g['gflops']:.1f} GFLOP/s  [{m}x{k}]x[{k}x{n}]"
                     + ("" if g["native"] else "  (emulated)")))
    rows += [("memcpy (1 thread)", f"{r['memcpy_gbps']:.1f} GB/s"),
             ("shm flag round trip", f"{r['shm_flag_round_trip_us']:.1f} us"),
             ("dtype='auto' picks", f"{r['auto_dtype']} for a bfloat16 checkpoint"),
             ("  because", r["auto_dtype_reason"].removeprefix("auto: "))]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
