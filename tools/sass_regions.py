"""sass_regions.py — where a kernel's executed instructions and stall samples go, from the
per-instruction CSV that `tools/device_ab.sh` writes with SASS=NAME:FMT (ncu's source page, SASS):
the opcode totals, and the straight runs of instructions that execute equally often (a loop body,
a copy loop, the set-up) ranked by their share. Development tool; needs no GPU.

    python tools/sass_regions.py sass_counts_new_8.csv [--units 524288] [--top 12]

--units divides the executed counts (e.g. B * S_cache * Hkv = 524288 at 8 x 8192, Hkv = 8: warp
instructions per key and kv head).
"""

from __future__ import annotations

import argparse
import collections
import csv


def read(path: str) -> tuple[list[str], list[list[str]]]:
    header, rows = None, []
    for row in csv.reader(open(path)):
        if row and row[0] == "Address":
            header = row
        elif header and len(row) == len(header) and row[0].startswith("0x"):
            rows.append(row)
    if header is None:
        raise SystemExit(f"{path}: no per-instruction table (ncu --page source --print-source sass --csv)")
    return header, rows


def opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--units", type=float, default=1.0, help="divide executed counts by this")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    header, rows = read(args.csv)
    executed = header.index("Instructions Executed")
    samples = header.index("Warp Stall Sampling (All Samples)")
    total = sum(int(r[executed]) for r in rows)
    total_samples = max(sum(int(r[samples]) for r in rows), 1)
    print(f"{total} warp instructions executed ({total / args.units:.2f} per unit), {total_samples} stall samples")

    per_op, per_op_samples = collections.Counter(), collections.Counter()
    for r in rows:
        per_op[opcode(r[1])] += int(r[executed])
        per_op_samples[opcode(r[1])] += int(r[samples])
    for op, n in per_op.most_common(args.top):
        print(f"  {op:10s} {n / args.units:8.2f} per unit  {100 * per_op_samples[op] / total_samples:5.1f} % of samples")

    # Runs of consecutive instructions with the same executed count.
    base = int(rows[0][0], 16)
    runs: list[list] = []
    for r in rows:
        count, address = int(r[executed]), int(r[0], 16) - base
        if runs and runs[-1][2] == count:
            runs[-1][1] = address
            runs[-1][3].append(opcode(r[1]))
            runs[-1][4] += int(r[samples])
        else:
            runs.append([address, address, count, [opcode(r[1])], int(r[samples])])
    print("runs (offsets from the kernel's start):")
    for first, last, count, ops, n_samples in sorted(runs, key=lambda run: -run[2] * len(run[3]))[: args.top]:
        share = 100 * count * len(ops) / max(total, 1)
        common = " ".join(f"{k}={c}" for k, c in collections.Counter(ops).most_common(6))
        print(f"  {first:#07x}-{last:#07x} {count:9d} x {len(ops):4d} = {share:5.1f} %, "
              f"{100 * n_samples / total_samples:5.1f} % of samples: {common}")


if __name__ == "__main__":
    main()
