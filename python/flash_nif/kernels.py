"""The CUDA kernel variants and the NVRTC compile check (no GPU needed).

``python -m flash_nif.kernels --arch sm_80 --arch sm_90a`` compiles every kernel variant the
library can launch with NVRTC (the system's, or pip's ``nvidia-cuda-nvrtc``), from the sources
embedded in the extension, on all cores and through the launcher's disk cache (``--fresh`` skips
it); prints registers, spill bytes, stack and the shared memory each kernel declares; and exits 1
on a compile error, a spill (past SPILL_ALLOWANCE's few), shared memory that fits no GPU it is
meant for, or (sm_90a-only kernels) a ptxas warning that wgmma was serialized or setmaxnreg ignored.

The variant table is the launcher's (``_native.cuda_kernel_variants``, from config.rs). The golden
snapshot ``tests/golden/kernel_variants.json`` pins it, with each kernel's shared memory; after an
intended change to tiles, defines or a kernel's layout, regenerate it from a checkout with

    python -m flash_nif.kernels --write-golden tests/golden/kernel_variants.json

and ``--golden PATH`` checks a run against it (``make test-kernels`` does).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from . import _cuda  # noqa: F401 - registers sys.path, where pip's NVRTC may live
from . import _native

HEAD_DIMS = tuple(range(8, 257, 8))
# Default for the check: the smallest D, every tile-class boundary (64 | 72, 128 | 136), padded
# head dims (D % 16 == 8: 40, 72, 136) and the largest. `--head-dims all` compiles all 32 (~5x longer).
CHECK_HEAD_DIMS = (8, 40, 64, 72, 128, 136, 256)

# Opt-in shared memory per block: the default tiles must fit an H100 (the A100's 163 KiB falls back
# to the small tiles where needed), the last candidate every sm_80+ GPU (sm_86 / sm_89: 99 KiB).
MAX_SMEM_DEFAULT = 227 * 1024
MAX_SMEM_ANY = 99 * 1024

# Spills a kernel may have (bytes of spill stores + loads, on each arch), where its measured-faster build
# keeps them out of its inner loop. decode's PAIRED one-wave kernels (bf16 q over 4-bit caches in
# groups of 64, 128 registers; kv_variants.rs decode_one_wave): DecodeWork's fields stored at the
# set-up and reloaded once a stage for the copy engine's box coordinates and by the epilogue (NVRTC
# -lineinfo), 12 bytes on sm_90a (52 for the one-warp kernel between sessions 56 and 57), where they
# run (decode.rs takes them on Hopper only), 0-52 on sm_80; 8-11 % faster than the tile-8 kernels,
# which do not spill (bench/RESULTS.md, sessions 54 and 56).
SPILL_ALLOWANCE = (
    (re.compile(r"^decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps\d+_state_tile4_stages2_min_blocks(4|8|16)$"), 64),
    # The one-warp 8-bit kernels with the softmax and weight votes (decode.cu MAX_VOTE): a word stored
    # at the set-up and reloaded once a stage and by the epilogue, 24 bytes on sm_90a; 256 x 256
    # (where they run) 45.3-45.4 -> 44.6-45.2 us with the votes (RESULTS, sessions 57-58).
    (re.compile(r"^decode_(bf16|f16)_d128_cache_bits8_k_group64_v_group64_num_warps1_state_tile8_stages2_min_blocks16$"), 32),
)


def spill_allowed(name: str) -> int:
    """The spill bytes the check lets `name` have (0: none)."""
    return next((limit for pattern, limit in SPILL_ALLOWANCE if pattern.match(name)), 0)


# Kernels only sm_90a runs (compiled for it alone; their shared memory need only fit a Hopper GPU).
SM90_KERNELS = frozenset(_native.cuda_sm90_kernels())

# The head dim of a kernel that takes it at run time (rotary): every check lists it, whatever head dims.
ANY_HEAD_DIM = 0

# The variant fields the golden snapshot pins (besides smem_bytes).
TABLE_FIELDS = ("name", "kernel", "dtype", "head_dim", "source", "entry", "defines", "block_m", "block_n",
                "num_warps", "tile_set")


def variants(head_dims=CHECK_HEAD_DIMS) -> list[dict]:
    """The launcher's variants for these head dims (see ``_native.cuda_kernel_variants``)."""
    return _native.cuda_kernel_variants(list(head_dims))


def launched_tile_sets(arch: str) -> list[str]:
    """The tile sets a GPU of this arch can launch: Hopper (sm_90 / sm_90a) gives every block the
    227 KiB the default tiles fit in (fit_errors checks it), so it never falls back to the small
    ones; older archs may (sm_86 / sm_89: 99 KiB)."""
    return ["default"] if arch.startswith("sm_90") else ["default", "small"]


def compile_report(archs, head_dims=CHECK_HEAD_DIMS, jobs=None, fresh=False, masked_archs=None,
                   tf32_archs=None) -> list[dict]:
    """One dict per (variant, arch) that arch can launch, compiled in parallel (see
    ``_native.cuda_compile_report``). ``masked_archs`` and ``tf32_archs`` (default: all of
    ``archs``) limit the MASKED and the f32 tensor-core (TF32_TERMS) variants to those archs."""
    groups: dict[tuple, list[str]] = {}
    for a in archs:
        masked = masked_archs is None or a in masked_archs
        tf32 = tf32_archs is None or a in tf32_archs
        groups.setdefault((tuple(launched_tile_sets(a)), masked, tf32), []).append(a)
    return [r for (sets, masked, tf32), group in groups.items()
            for r in _native.cuda_compile_report(group, list(head_dims), jobs, fresh, list(sets), masked, tf32)]


def sm90_warnings(report: dict) -> list[str]:
    """ptxas's warnings that an sm_90a-only kernel lost what it is for: wgmma serialized (C7510-C7515:
    "Potential Performance Loss"), or setmaxnreg ignored (C7508)."""
    if report["kernel"] not in SM90_KERNELS:
        return []
    return [line.split("ptxas info    : ")[-1].strip() for line in report.get("log", "").splitlines()
            if "Potential Performance Loss" in line or "C7508" in line]


def _per_arch(rows):
    """The rows, a snapshot row whose shared memory is {arch: bytes} as one row per arch."""
    for r in rows:
        if isinstance(r["smem_bytes"], dict):
            yield from ({**r, "smem_bytes": b, "arch": arch} for arch, b in r["smem_bytes"].items())
        else:
            yield r


def fit_errors(rows) -> list[str]:
    """Shared-memory rules of compiled variants (rows with kernel, dtype, head_dim, defines,
    tile_set, smem_bytes and optionally arch): the default tiles fit MAX_SMEM_DEFAULT, and each
    launch's last candidate (its small tiles, or the default when there are none) MAX_SMEM_ANY, on
    the archs that launch small tiles (see launched_tile_sets), the sm_90a-only kernels aside."""
    last = {}
    errors = []
    for r in _per_arch(rows):
        if r["tile_set"] == "default" and r["smem_bytes"] > MAX_SMEM_DEFAULT:
            errors.append(f"{r['name']} ({r.get('arch', '')}) needs {r['smem_bytes']} bytes > {MAX_SMEM_DEFAULT}")
        key = (r["kernel"], r["dtype"], r["head_dim"], r["defines"].get("IS_CAUSAL"), r["defines"].get("MASKED"),
               r["defines"].get("CACHE_BITS"), r["defines"].get("K_GROUP"), r["defines"].get("V_GROUP"), r.get("arch"))
        if "small" not in launched_tile_sets(r.get("arch", "")) or r["kernel"] in SM90_KERNELS:
            continue
        if key not in last or r["tile_set"] == "small":
            last[key] = r
    for r in last.values():
        if r["smem_bytes"] > MAX_SMEM_ANY:
            errors.append(f"{r['name']} ({r.get('arch', '')}) is a last candidate and needs {r['smem_bytes']} "
                          f"bytes > {MAX_SMEM_ANY}")
    return errors


def golden_errors(golden: dict, reports: list[dict]) -> list[str]:
    """Differences between a run and the golden snapshot: the variant table for the run's head dims,
    and each compiled kernel's shared memory."""
    dims = sorted({r["head_dim"] for r in reports} - {ANY_HEAD_DIM})
    missing = [d for d in dims if d not in golden["head_dims"]]
    if missing:
        return [f"head dims {missing} are not in the golden snapshot (it has {golden['head_dims']})"]
    want = [v for v in golden["variants"] if v["head_dim"] in dims or v["head_dim"] == ANY_HEAD_DIM]
    got = [{f: v[f] for f in TABLE_FIELDS} for v in variants(dims)]
    errors = []
    if [{f: v[f] for f in TABLE_FIELDS} for v in want] != got:
        names_want, names_got = {v["name"] for v in want}, {v["name"] for v in got}
        errors.append("the variant table differs from the golden snapshot: "
                      f"new {sorted(names_got - names_want)[:5]}, gone {sorted(names_want - names_got)[:5]} "
                      "(or changed fields / order); regenerate it if intended (see --write-golden)")
    smem = {v["name"]: v["smem_bytes"] for v in want}
    for r in reports:
        want_bytes = smem.get(r["name"])
        if isinstance(want_bytes, dict):  # a kernel whose shared memory depends on the arch
            want_bytes = want_bytes.get(r["arch"])
        if r["ok"] and want_bytes != r["smem_bytes"]:
            errors.append(f"{r['name']} ({r['arch']}) declares {r['smem_bytes']} bytes of shared memory, "
                          f"the golden snapshot {want_bytes}")
    return errors


def golden_snapshot(head_dims, reports: list[dict]) -> dict:
    """The snapshot of a successful run: the table of these head dims and each kernel's shared memory
    (one size, or {arch: size} for a kernel whose stages depend on the arch, like decode's 8-bit)."""
    by_arch = {}
    for r in reports:
        by_arch.setdefault(r["name"], {})[r["arch"]] = r["smem_bytes"]
    smem = {n: next(iter(a.values())) if len(set(a.values())) == 1 else dict(sorted(a.items())) for n, a in by_arch.items()}
    return {
        "head_dims": sorted(head_dims),
        "variants": [{**{f: v[f] for f in TABLE_FIELDS}, "smem_bytes": smem[v["name"]]} for v in variants(head_dims)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_nif.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="target, e.g. sm_80 or sm_90a (repeatable; default both)")
    ap.add_argument("--head-dims", default="check",
                    help="'check' (a representative set, the default), 'all' (every multiple of 8 to 256) "
                         "or a comma list")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    ap.add_argument("--fresh", action="store_true", help="compile everything, skipping the disk cache")
    ap.add_argument("--masked-arch", action="append",
                    help="compile the MASKED variants only for these archs (repeatable; default: every --arch; 'none': for none)")
    ap.add_argument("--tf32-arch", action="append",
                    help="compile the f32 tensor-core (TF32) variants only for these archs (repeatable; default: every --arch; "
                         "'none': for none)")
    ap.add_argument("--golden", metavar="PATH", help="check the table and shared memory against a snapshot")
    ap.add_argument("--write-golden", metavar="PATH", help="write the snapshot of this run")
    ap.add_argument("-v", "--verbose", action="store_true", help="print NVRTC logs")
    args = ap.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90a"]
    dims = {"all": HEAD_DIMS, "check": CHECK_HEAD_DIMS}.get(args.head_dims)
    if dims is None:
        dims = tuple(int(x) for x in args.head_dims.split(","))
    version, library = _native.cuda_nvrtc()
    print(f"NVRTC {version} ({library}); kernel sources embedded in {_native.__file__}")
    t0 = time.perf_counter()
    reports = compile_report(archs, dims, args.jobs, args.fresh, args.masked_arch, args.tf32_arch)
    seconds = time.perf_counter() - t0
    failures = []
    print(f"{'variant':72s} {'arch':7s} {'regs':>4s} {'spill':>5s} {'stack':>5s} {'smem':>7s}")
    for r in reports:
        if not r["ok"]:
            failures.append(f"{r['name']} ({r['arch']}): compile error")
            print(f"{r['name']:72s} {r['arch']:7s} COMPILE ERROR\n{r['error']}")
            continue
        flag = ""
        if r["spill_bytes"] > spill_allowed(r["name"]):
            failures.append(f"{r['name']} ({r['arch']}) spills {r['spill_bytes']} bytes")
            flag = "  <- SPILL"
        elif r["spill_bytes"] > 0:
            flag = "  (spill allowed)"
        for warning in sm90_warnings(r):
            failures.append(f"{r['name']} ({r['arch']}): {warning}")
            flag = "  <- " + warning.split(":")[0]
        print(f"{r['name']:72s} {r['arch']:7s} {r['registers']:4d} {r['spill_bytes']:5d} {r['stack_bytes']:5d} "
              f"{r['smem_bytes']:7d}{flag}")
        if args.verbose:
            print(r["log"])
    compiled = [r for r in reports if r["ok"]]
    failures += fit_errors(compiled)
    if args.golden:
        with open(args.golden) as f:
            failures += golden_errors(json.load(f), reports)
    cached = sum(r.get("cached", False) for r in compiled)
    print(f"{len(reports)} variants x archs in {seconds:.1f} s ({cached} from the cache), {len(failures)} failed")
    for msg in failures:
        print("FAIL", msg)
    if args.write_golden and not failures:
        snap = golden_snapshot(dims, compiled)
        rows = ",\n".join(" " + json.dumps(v) for v in snap["variants"])  # one variant a line: readable diffs
        with open(args.write_golden, "w") as f:
            f.write(f'{{"head_dims": {json.dumps(snap["head_dims"])}, "variants": [\n{rows}\n]}}\n')
        print(f"wrote {args.write_golden}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
