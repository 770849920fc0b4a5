"""Summarises `ncu --page source --print-source sass --csv` output (development tool): the SASS
instructions with the most warp-state samples, and the totals per stall reason.

    ncu --kernel-name flash_bwd_sm90 --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python bench/profile_sm90.py backward > prof.csv
    python bench/ncu_stalls.py prof.csv [top]
"""

import csv
import io
import sys
from collections import Counter


def main(path: str, top: int = 40) -> None:
    text = open(path, encoding="utf-8", errors="replace").read()
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


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
