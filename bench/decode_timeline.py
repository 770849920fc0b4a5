"""Where a decode call's GPU time goes between kernels (development tool): the kernels of N
back-to-back `flash_nif.decode` calls, from torch's profiler (CUPTI timestamps, nothing serialised
as under ncu), run eagerly and replayed from a CUDA graph. Per call, medians: the decode kernel's
duration, the merge kernel's (where the keys are split), the tail (merge end - decode end), and the
period (one call's decode start to the next's); plus CUDA-event time per call of each mode.
Hkv = 8, H = 32, D = 128, Sq = 1, bf16 q, groups of 64.

    python bench/decode_timeline.py [--shapes 8x8192,1x131072] [--formats bf16,8,4] [--calls 40]
        [--splits bf16=2,8=4,4=4] [--graph-only]

--splits fixes num_splits per format (the same blocks at every S_cache, so that a sweep over S_cache
separates the kernels' fixed time from their time per key).
"""

import argparse
import json
import os
import statistics
import tempfile

import torch

import flash_nif
from decode import capture_graph  # bench/decode.py (this script's folder is on the path)

HKV, H, D = 8, 32, 128


def kernels(fn):
    """[(name, start us, duration us)] of the CUDA kernels fn() ran, in start order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace["traceEvents"]
           if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out, key=lambda e: e[1])


def summary(ks):
    dec = [k for k in ks if "decode" in k[0]]
    mer = [k for k in ks if "merge" in k[0]]
    med = statistics.median
    row = {"decode": med(k[2] for k in dec)}
    if len(dec) > 1:
        row["period"] = med(b[1] - a[1] for a, b in zip(dec, dec[1:]))
    if mer and len(mer) == len(dec):
        row["merge"] = med(k[2] for k in mer)
        row["tail"] = med(m[1] + m[2] - (d[1] + d[2]) for d, m in zip(dec, mer))
    return row


def event_time(fn, calls):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x8192,1x131072")
    ap.add_argument("--formats", default="bf16,8,4")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--splits", default="", help="FORMAT=N,...: num_splits per format (default: the library's)")
    ap.add_argument("--graph-only", action="store_true")
    args = ap.parse_args()
    splits = {f: int(n) for f, n in (x.split("=") for x in args.splits.split(",") if x)}
    n = args.calls
    print(f"{torch.cuda.get_device_name()}; us, medians over {n} calls")
    print("| B x S | cache | mode | event us/call | decode | merge | tail | period |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        b, s = (int(x) for x in shape.split("x"))
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name in args.formats.split(","):
            kc, vc = (k, v) if name == "bf16" else (flash_nif.quantize_kv(x, bits=int(name), group_size=64) for x in (k, v))

            ns = splits.get(name)

            def eager():
                for _ in range(n):
                    flash_nif.decode(q, kc, vc, num_splits=ns)

            eager()
            graph = capture_graph(torch, eager)
            modes = (("eager", eager), ("graph", graph.replay))
            for mode, fn in modes[1:] if args.graph_only else modes:
                t = event_time(fn, n)
                r = summary(kernels(fn))
                cell = lambda key: f"{r[key]:.1f}" if key in r else "-"
                print(f"| {b} x {s} | {name}{'' if ns is None else f' ({ns} splits)'} | {mode} | {t:.1f} | {cell('decode')} | {cell('merge')} | {cell('tail')} | "
                      f"{cell('period')} |", flush=True)
            del graph
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
