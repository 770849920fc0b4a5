"""Summarises `ncu --page source --print-source sass --csv` output (development tool): the SASS
instructions with the most warp-state samples, and the totals per stall reason.

    ncu --kernel-name flash_bwd_sm90 --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python bench/profile_sm90.py backward > prof.csv
    python bench/ncu_stalls.py prof.csv[.gz] [top] [--roles]

--roles: in a warp-specialised kernel (run_roles: the consumers' code first, the producer's after
its `USETMAXREG.DEALLOC`), each role's stall reasons, its top opcodes by samples and by executed
instructions, and its samples on mbarrier waits (the `BRA` back to a `SYNCS.PHASECHK` try-wait).
"""

import csv
import gzip
import io
import sys
from collections import Counter


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def main(path: str, top: int = 40) -> None:
    text = read_text(path)
    start = text.find('"Address"')  # ncu prints its log lines before the table
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    sample_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total_col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    reasons = Counter()
    for r in rows:
        for c in sample_cols:
            try:
                reasons[c] += float(r[c] or 0)
            except ValueError:
                pass
    total = sum(float(r[total_col] or 0) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples")
    for c, n in reasons.most_common(20):
        print(f"  {c:60s} {n:9.0f}")
    ranked = sorted(rows, key=lambda r: -float(r[total_col] or 0))[:top]
    for r in ranked:
        n = float(r[total_col] or 0)
        detail = sorted(((float(r[c] or 0), c) for c in sample_cols if c != total_col and (r[c] or "0") not in ("0", "")), reverse=True)[:3]
        print(f"{r['Address']:>6} {100 * n / total:5.1f}%  {r['Source'][:70]:70s} {detail}")


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def roles(path: str) -> None:
    text = read_text(path)
    rows = list(csv.DictReader(io.StringIO(text[text.find('"Address"'):])))
    total_col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    exec_col = next((c for c in rows[0] if c == "Instructions Executed"), None)
    sample_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    split = next((i for i, r in enumerate(rows) if "SETMAXREG.DEALLOC" in r["Source"]), None)
    if split is None:
        print("no USETMAXREG.DEALLOC: not a warp-specialised kernel")
        return
    num = lambda r, c: float(r[c] or 0) if (r[c] or "").replace(".", "", 1).isdigit() else 0.0
    # An mbarrier wait: the try-wait, and the branch that loops back to it (the samples land there).
    waits = {r["Address"] for r in rows if "SYNCS.PHASECHK" in r["Source"]}
    for name, part in (("consumers", rows[:split]), ("producer", rows[split:])):
        total = sum(num(r, total_col) for r in part) or 1.0
        print(f"== {name}: {total:.0f} samples")
        reasons = Counter()
        for r in part:
            for c in sample_cols:
                reasons[c] += num(r, c)
        for c, n in reasons.most_common(8):
            print(f"  {c:40s} {100 * n / total:5.1f} %")
        on_waits = sum(num(r, total_col) for r in part
                       if r["Address"] in waits or (opcode(r["Source"]) == "BRA" and any(w in r["Source"] for w in waits)))
        print(f"  on mbarrier waits: {100 * on_waits / total:.1f} %")
        by_samples, by_exec = Counter(), Counter()
        for r in part:
            by_samples[opcode(r["Source"])] += num(r, total_col)
            if exec_col:
                by_exec[opcode(r["Source"])] += num(r, exec_col)
        print("  samples by opcode:", ", ".join(f"{k} {100 * v / total:.1f}" for k, v in by_samples.most_common(10)))
        if exec_col:
            n = sum(by_exec.values()) or 1.0
            print("  executed by opcode:", ", ".join(f"{k} {100 * v / n:.1f}" for k, v in by_exec.most_common(10)))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--roles"]
    if "--roles" in sys.argv:
        roles(args[0])
    else:
        main(args[0], int(args[1]) if len(args) > 1 else 40)
