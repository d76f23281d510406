"""One table per seed: every quantitative result the seed paper prints against what the simulator gives.

``python docs/results/sim/seed_tables.py OUT.md`` reads the simulator's results for the three
configs (``make seed-tables`` regenerates them first, then runs this) and the cost model for what
needs no run (ASAP Fig. 5, the MoE inflection). The paper's numbers are typed in below with their
section; a result the paper gives only as a range is checked against the range widened by the
tolerance. Verdicts: "within" (inside the tolerance), "MISS", or "-" (no number to compare).
"""
from __future__ import annotations

import json
import sys

from moeflow.measure.provenance import provenance

from seed_afd import afd_rows  # noqa: E402  (beside this script)
from seed_asap import asap_rows  # noqa: E402
from seed_common import _load  # noqa: E402
from seed_dwdp import E2E, dwdp_rows  # noqa: E402


# earlier tallies of these tables, each from the file as committed then: (what changed, commit, within, compared)
EARLIER = (("before the symmetry rule (ASAP's baselines split attention by heads, ASAP by sequence)", "07dc589",
            18, 45),  # its table's 19 of 46, less the super kernel's row (within), an echo
           ("before the NVIDIA streaming rates (msmodeling's 0.6 of HBM for every memory-bound op)", "f309302",
            18, 50),
           ("before DWDP's Table 3d and Table 4's one case in the text were simulated", "ab573c4", 24, 50),
           ("before FastAFD's MoE MFU curve was read off the cost model", "2075804", 26, 53),
           ("before MiniMax-M2.5 was simulated (FastAFD §6's second model)", "5aa8c02", 27, 57),
           ("before DWDP's end-to-end rows (§5.3, Table 6) and ASAP's dual-batch and Fig. 3 claims joined", "8fda7e6",
            29, 61),
           ("before ASAP's async-dispatch latency (§5.4) joined", "16610bf", 33, 67),
           ("before afd's ports (a daemon took its M instances' rows as if each came over a link of its own)",
            "6514333", 34, 68))


def tally(rows: list[str]) -> tuple[int, int, int, int]:
    """(within, compared, without a number, not attempted) over a table's rows; a row that echoes
    an input is left out."""
    verdicts = [r.split("|")[4].strip() for r in rows if "| prediction |" in r]
    return (verdicts.count("within"), sum(v in ("within", "MISS") for v in verdicts), verdicts.count("-"),
            sum("| not attempted |" in r for r in rows))


def main(out: str) -> None:
    head = ["| result | paper | simulated | ±15% (TTFTs, Fig. 5, TPOT ±20%; ablations ±50%) | prediction or echo | "
            "measured split (where the simulated time goes) |", "|---|---|---|---|---|---|"]
    sources = [_load(n) for n in ("asap_cm384", "dwdp_gb200", "afd_gb200", "afd_minimax_gb200")]
    with open(E2E) as f:
        sources.append(json.load(f))
    commits = sorted({(d.get("provenance") or {}).get("commit", "?")[:7] for d in sources})
    here = provenance()
    text = ["# Every seed result, paper against the simulator", "",
            "Written by `docs/results/sim/seed_tables.py` from the simulator's results (`make seed-tables`; "
            f"simulated on commit {', '.join(commits)}; DWDP Fig. 1, Tables 3b and 3d and Table 4's case in the "
            f"text, ASAP Figs. 3, 3b and 5 and FastAFD's MFU are computed by the script itself, run on commit {here['commit'][:7]}"
            f"{' (dirty)' if here['dirty'] else ''}). Analytic costs: no machine enters these numbers.", ""]
    sections = (("ASAP on CloudMatrix384 (configs/asap-cm384.yaml)", asap_rows()),
                ("DWDP on GB200 (configs/dwdp-gb200.yaml)", dwdp_rows()),
                ("FastAFD on GB200 (configs/afd-gb200.yaml)", afd_rows()))
    counts = [tally(rows) for _, rows in sections]
    text += ["## Tally", "", "Predictions only: a row that echoes one of the simulator's inputs (a paper's own result "
             "taken as a constant, `sim/paper_inputs.py`) is not counted.", "",
             "| tables | within ±tolerance | compared | without a number | not attempted |", "|---|---|---|---|---|"]
    for (title, _), (w, c, n, na) in zip(sections, counts):
        text.append(f"| {title.split(' (')[0]} | {w} | {c} | {n} | {na} |")
    w, c, n, na = (sum(x) for x in zip(*counts))
    text.append(f"| **all, {', '.join(commits)}** | **{w}** | **{c}** | {n} | {na} |")
    for what, commit, ew, ec in EARLIER:
        text.append(f"| all, {commit}: {what} | {ew} | {ec} | | |")
    text.append("")
    for title, rows in sections:
        text += [f"## {title}", "", *head, *rows, ""]
    with open(out, "w") as f:
        f.write("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main(sys.argv[1])
