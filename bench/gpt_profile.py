"""Profile of bench/gpt_step.py's flash_nif steps: which device work runs inside and around our ops.

torch.profiler records two training steps; the Chrome trace it exports is read back and every
device event (kernel, memcpy, memset) is tied to the CPU ops that launched it (CUPTI correlation id
-> the runtime/driver launch call -> the CPU ops open on that thread at that moment). Each event
gets a label:

  ours            launched by a flash_nif op (flash_nif::attention_forward / _backward) directly
  copy in ours    launched inside a flash_nif op by a torch copy (aten::copy_, contiguous, clone):
                  the strided views that the op makes contiguous
  copy            any other copy (aten::copy_ / clone / contiguous / stack / cat, memcpy events)
  other           everything else

Reported: device time per label and step, the kernels directly before and after each run of our
events in stream order (copies there are flagged: hidden layout work around our kernels), and
every synchronising call (cudaStreamSynchronize, cudaDeviceSynchronize, blocking memcpys, ...)
with the ops it came from. On the CPU there are no device events: the report then lists the CPU
ops inside our ops (flash_nif's own copies of strided NumPy views happen in Rust and are not
visible to the profiler).
"""

from __future__ import annotations

import bisect
import collections
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

OUR_OPS = ("flash_nif::attention_forward", "flash_nif::attention_backward")
COPY_OPS = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::_to_copy", "aten::stack", "aten::cat")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_WORDS = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD", "cuMemcpy ")


def _is_sync(name: str) -> bool:
    if "Async" in name:
        return False
    return any(w in name for w in SYNC_WORDS) or name in ("cudaMemcpy", "cuMemcpy")


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0)


class _Stack:
    """The CPU ops (and record_function ranges) of one thread, which nest: each op's parent is
    found once by a sweep, so the ops open at a time are a bisect and a walk up the parents."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.ops]
        self.parent = []
        open_ = []  # indices of the ops enclosing the current one
        for i, e in enumerate(self.ops):
            while open_ and _end(self.ops[open_[-1]]) < e["ts"]:
                open_.pop()
            self.parent.append(open_[-1] if open_ else None)
            open_.append(i)

    def at(self, ts: float) -> list[dict]:
        """The ops open at ts, outermost first."""
        i = bisect.bisect_right(self.starts, ts) - 1
        chain = []
        while i is not None and i >= 0:
            if _end(self.ops[i]) >= ts:
                chain.append(self.ops[i])
            i = self.parent[i]
        return chain[::-1]


def _chain(ops: list[dict]) -> str:
    names = [e["name"] for e in ops if not e["name"].startswith("ProfilerStep")]
    return " > ".join(names[-4:]) if names else "(no op)"


def analyse(trace: dict) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_tid[e["tid"]].append(e)
    stacks = {tid: _Stack(ops) for tid, ops in by_tid.items()}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def ops_at(e):
        stack = stacks.get(e["tid"])
        return stack.at(e["ts"]) if stack else []

    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == "train_step"]
    rows = []
    unlinked = 0  # device events whose launch call the trace lacks: their ops are unknown
    for e in device:
        launch = launches.get(e.get("args", {}).get("correlation"))
        unlinked += launch is None
        ops = ops_at(launch) if launch else []
        names = [o["name"] for o in ops]
        ours = next((o for o in ops if o["name"] in OUR_OPS), None)
        copy = any(n in COPY_OPS for n in names) or e["cat"] == "gpu_memcpy"
        label = ("copy in ours" if copy else "ours") if ours else ("copy" if copy else "other")
        rows.append({"name": e["name"], "cat": e["cat"], "ts": e["ts"], "dur": e.get("dur", 0), "label": label,
                     "ours_id": id(ours) if ours else None, "ours_op": ours["name"] if ours else None,
                     "chain": _chain(ops)})

    per_label = collections.Counter()
    for r in rows:
        per_label[r["label"]] += r["dur"]
    nsteps = max(len(steps), 1)

    # runs of consecutive device events of one our-op call, and their neighbours in stream order
    neighbours = collections.Counter()
    flagged = collections.Counter()
    i = 0
    while i < len(rows):
        if rows[i]["ours_id"] is None:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and rows[j + 1]["ours_id"] == rows[i]["ours_id"]:
            j += 1
        for side, k in (("before", i - 1), ("after", j + 1)):
            if 0 <= k < len(rows):
                n = rows[k]
                key = (rows[i]["ours_op"], side, n["label"], n["name"][:90], n["chain"])
                neighbours[key] += 1
                if n["label"].startswith("copy"):
                    flagged[key] += 1
        i = j + 1

    inside = collections.Counter()
    for r in rows:
        if r["ours_id"] is not None:
            inside[(r["ours_op"], r["label"], r["name"][:90], r["chain"])] += r["dur"]

    syncs = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and _is_sync(e["name"]):
            ops = ops_at(e)
            in_ours = any(o["name"] in OUR_OPS for o in ops)
            syncs[(e["name"], in_ours, _chain(ops))] += 1

    cpu_inside = collections.Counter()
    if not device:  # a CPU run: the ops our ops call
        for tid, stack in stacks.items():
            for op in stack.ops:
                outer = [o for o in stack.at(op["ts"]) if o["name"] in OUR_OPS and o is not op]
                if outer:
                    cpu_inside[(outer[0]["name"], op["name"])] += op.get("dur", 0)

    span = sum(s["dur"] for s in steps) / nsteps if steps else None
    return {
        "steps": len(steps),
        "device_events": len(rows),
        "device_events_without_launch": unlinked,
        "step_wall_us": span,
        "device_us_per_step": {k: v / nsteps for k, v in per_label.items()},
        "inside_our_ops_us_per_step": [
            {"op": k[0], "label": k[1], "kernel": k[2], "launched_by": k[3], "us": v / nsteps}
            for k, v in sorted(inside.items(), key=lambda kv: -kv[1])],
        "neighbours": [
            {"op": k[0], "side": k[1], "label": k[2], "kernel": k[3], "launched_by": k[4], "count": v}
            for k, v in sorted(neighbours.items(), key=lambda kv: -kv[1])],
        "copies_adjacent_to_ours": [
            {"op": k[0], "side": k[1], "kernel": k[3], "launched_by": k[4], "count": v} for k, v in flagged.items()],
        "syncs": [{"call": k[0], "inside_our_op": k[1], "launched_by": k[2], "count": v} for k, v in syncs.items()],
        "cpu_ops_inside_ours_us_per_step": [
            {"op": k[0], "child": k[1], "us": v / nsteps} for k, v in sorted(cpu_inside.items(), key=lambda kv: -kv[1])],
    }


def report(s: dict) -> str:
    out = [f"profile: {s['steps']} steps" + (f", {s['step_wall_us'] / 1e3:.2f} ms CPU wall per step" if s["step_wall_us"] else "")]
    if s["device_us_per_step"]:
        if s["device_events_without_launch"]:
            out.append(f"WARNING: {s['device_events_without_launch']} of {s['device_events']} device events have no "
                       "launch call in the trace (labelled 'other', ops unknown)")
        out.append("device time per step by label: " + ", ".join(
            f"{k} {v / 1e3:.3f} ms" for k, v in sorted(s["device_us_per_step"].items())))
        out.append("inside our ops (per step):")
        out += [f"  {r['op']:30s} {r['label']:12s} {r['us'] / 1e3:8.3f} ms  {r['kernel']}  [{r['launched_by']}]"
                for r in s["inside_our_ops_us_per_step"]]
        out.append("stream neighbours of our ops' runs (count over the profiled steps):")
        out += [f"  {r['op']:30s} {r['side']:6s} {r['label']:12s} x{r['count']:<4d} {r['kernel']}  [{r['launched_by']}]"
                for r in s["neighbours"]]
        copies = s["copies_adjacent_to_ours"]
        out.append(f"copy kernels adjacent to ours: {sum(r['count'] for r in copies)}" if copies else
                   "copy kernels adjacent to ours: none")
        copy_in = sum(r["us"] for r in s["inside_our_ops_us_per_step"] if r["label"] == "copy in ours")
        out.append(f"copy kernels inside our ops: {copy_in / 1e3:.3f} ms per step")
    else:
        out.append("no device events (CPU run); CPU ops inside our ops (per step):")
        out += [f"  {r['op']:30s} {r['child']:40s} {r['us'] / 1e3:8.3f} ms" for r in s["cpu_ops_inside_ours_us_per_step"][:20]]
    syncs = s["syncs"]
    out.append("synchronising calls: " + ("none" if not syncs else "; ".join(
        f"{r['call']} x{r['count']} ({'INSIDE our op' if r['inside_our_op'] else 'outside'}: {r['launched_by']})" for r in syncs)))
    return "\n".join(out)


def profile_steps(setup, out_dir: str, steps: int = 2) -> tuple[str, dict]:
    """Profile `steps` of setup.step() (after two unprofiled ones); writes trace.json, the
    profiler's op table and profile.json into out_dir; returns (report text, summary)."""
    cuda = setup.args.device == "cuda"
    for _ in range(2):
        setup.step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("train_step"):
                setup.step()
            if cuda:
                torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, "trace.json")
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        summary = analyse(json.load(f))
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    with open(os.path.join(out_dir, "profile_ops.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=60))
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    text = report(summary)
    return text + f"\nwrote {trace_path}, profile_ops.txt, profile.json in {out_dir}", summary
