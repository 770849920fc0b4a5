"""CUDA kernel variants and the NVRTC compile check (no GPU needed).

``python -m flash_nif.kernels --arch sm_80 --arch sm_90a`` compiles every kernel variant the
library can launch with NVRTC, prints variant, arch, registers, spill bytes and shared memory,
and exits non-zero on a compile error or a spill in a main kernel.

The variant table here mirrors ``native/flash-core/src/cuda/config.rs`` (the launcher's table);
``tests/test_gpu.py`` checks that the two agree when the native module is built. This module is
importable on its own (it needs only the standard library), so it can run before the native
extension exists: NVRTC is loaded with ctypes from the system (``libnvrtc.so.13``/``.12``) or from
pip's ``nvidia-cuda-nvrtc`` wheel.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import pathlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# Kernel sources: $FLASH_NIF_CUDA_DIR, flash_nif/cuda, cuda/ beside python/ in a checkout, ./cuda.
_HERE = pathlib.Path(__file__).resolve().parent
CUDA_DIRS = [_HERE / "cuda", _HERE.parents[1] / "cuda", pathlib.Path.cwd() / "cuda"]
if os.environ.get("FLASH_NIF_CUDA_DIR"):
    CUDA_DIRS.insert(0, pathlib.Path(os.environ["FLASH_NIF_CUDA_DIR"]))

DTYPES = {"f16": 0, "bf16": 1, "f32": 2}
KERNELS = ("fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv", "bwd_dkdv_dq", "bwd_dq_convert")
ENTRY = {
    "fwd": "flash_fwd",
    "bwd_preprocess": "flash_bwd_preprocess",
    "bwd_dq": "flash_bwd_dq",
    "bwd_dkdv": "flash_bwd_dkdv",
    "bwd_dkdv_dq": "flash_bwd_dkdv",  # bwd_dkdv.cu with ATOMIC_DQ=1: the default backward
    "bwd_dq_convert": "flash_bwd_dq_convert",
}
MAIN_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_dq")  # a spill in one of these fails the check
ELEMENTWISE = ("bwd_preprocess", "bwd_dq_convert")

HEAD_DIMS = tuple(range(8, 257, 8))
# Default for the check: the smallest D, every tile-class boundary (64 | 72, 128 | 136), padded
# head dims (D % 16 == 8: 40, 72, 136) and the largest. `--head-dims all` compiles all 32 (~5x longer).
CHECK_HEAD_DIMS = (8, 40, 64, 72, 128, 136, 256)


@dataclass(frozen=True)
class Variant:
    """One specialised kernel: its source file, entry point, -D defines and launch shape."""

    kernel: str
    dtype: str
    head_dim: int
    source: str
    block_m: int
    block_n: int
    num_warps: int
    d_split: int = 1
    defines: tuple = field(default=())

    @property
    def entry(self) -> str:
        return ENTRY[self.kernel]

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def name(self) -> str:
        return f"{self.kernel}_{self.dtype}_d{self.head_dim}_" + "_".join(
            f"{k.lower()}{v}" for k, v in self.defines if k not in ("FLASH_DTYPE", "HEAD_DIM")
        )

    def options(self, arch: str) -> list[str]:
        return [f"-arch={arch}", "-std=c++17", "-default-device"] + [f"-D{k}={v}" for k, v in self.defines]

    def smem_bytes(self) -> int:
        return smem_bytes(self.kernel, self.dtype, self.head_dim, self.block_m, self.block_n, self.d_split)


def tiles(kernel: str, dtype: str, head_dim: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, num_warps, d_split, min_blocks) for a kernel. Mirrors config.rs."""
    d = head_dim
    if kernel in ELEMENTWISE:
        return 8, 1, 8, 1, 1
    if kernel == "bwd_dkdv_dq" and dtype != "f32" and d <= 128:  # 128 keys on 8 warps (config.rs says why)
        return (96, 128, 8, 1, 1) if d <= 64 else (64, 128, 8, 1, 1)
    kernel = "bwd_dkdv" if kernel == "bwd_dkdv_dq" else kernel
    if dtype == "f32":
        if kernel == "fwd":
            bm, bn = (128, 128 if d <= 64 else 64) if simt_f32(d) else (128, 64) if d <= 64 else (64, 64) if d <= 128 else (32, 16)
        elif kernel == "bwd_dq":
            bm, bn = (128 if d <= 64 else 64, 64) if simt_f32(d) else (64, 64) if d <= 64 else (64, 32) if d <= 128 else (16, 16)
        elif simt_f32(d):  # bwd_dkdv
            bm, bn = 64, 128 if d <= 64 else 64
        else:
            bm, bn = (64, 64) if d <= 128 else (16, 16)
        return bm, bn, 8, 1, 1
    if kernel == "fwd":
        # 4th value for the forward: M_TILES (16-row tiles per warp)
        return (128, 64, 4, 2, 1) if d <= 64 else (128, 32, 4, 2, 1) if d <= 128 else (64, 32, 4, 1, 1)
    if kernel == "bwd_dq":
        return (64, 128, 4, 1, 1) if d <= 64 else (64, 64, 4, 1, 1) if d <= 128 else (64, 32, 4, 1, 1)
    # bwd_dkdv: block_n keys (16 per warp / d_split), block_m queries per step
    if d <= 64:
        return 96, 64, 4, 1, 1
    if d <= 128:
        return 64, 64, 4, 1, 1
    return 32, 64, 8, 2, 1


def small_tiles(kernel: str, dtype: str, head_dim: int) -> tuple[int, int, int, int, int]:
    """Tiles for GPUs with 99 KiB blocks (sm_86/89), used when tiles() needs more. Mirrors config.rs."""
    d = head_dim
    if kernel in ELEMENTWISE:
        return tiles(kernel, dtype, d)
    kernel = "bwd_dkdv" if kernel == "bwd_dkdv_dq" else kernel
    if dtype == "f32":
        if kernel == "fwd":
            bm, bn = (64, 64) if d <= 64 else (64, 32) if d <= 128 else (32, 16)
        elif kernel == "bwd_dkdv" and simt_f32(d):
            bm, bn = 64, 32 if d <= 64 else 16
        elif kernel == "bwd_dq" and simt_f32(d):
            bm, bn = (64, 32) if d <= 64 else (32, 32)
        else:
            bm, bn = (64, 64) if d <= 64 else (32, 32) if d <= 128 else (16, 16)
        return bm, bn, 8, 1, 1
    if kernel == "fwd":
        return tiles(kernel, dtype, d) if d <= 128 else (32, 32, 2, 1, 1)
    if kernel == "bwd_dq":
        return tiles(kernel, dtype, d) if d <= 64 else (64, 32, 4, 1, 1) if d <= 128 else (32, 32, 2, 1, 1)
    return tiles(kernel, dtype, d) if d <= 64 else (32, 64, 4, 1, 1) if d <= 128 else (16, 32, 4, 2, 1)


def smem_bytes(kernel: str, dtype: str, d: int, bm: int, bn: int, d_split: int = 1) -> int:
    """Dynamic shared memory of a variant, in bytes (mirrors the layouts in cuda/*.cu)."""
    if kernel in ELEMENTWISE:
        return 0
    if dtype == "f32":
        kernel = "bwd_dkdv" if kernel == "bwd_dkdv_dq" else kernel
        if kernel == "fwd" and simt_f32(d):
            return 4 * (bm * (d + 4) + bn * (d + 4) + bn * d + bm * (bn + 16))
        if kernel == "bwd_dkdv" and simt_f32(d):
            return 4 * (2 * (bn + bm) * (d + 4) + 2 * bn * (bm + 16) + 2 * bm)
        if kernel == "bwd_dq" and simt_f32(d):
            return 4 * ((2 * bm + 3 * bn) * (d + 4) + bm * (bn + 16))
        fs = d + 1
        if kernel == "fwd":
            return 4 * ((bm + 2 * bn) * fs + bm * (bn + 1))
        if kernel == "bwd_dq":
            return 4 * ((2 * bm + 2 * bn) * fs + bm * (bn + 1))
        return 4 * ((2 * bn + 2 * bm) * fs + 2 * bn * (bm + 1) + 2 * bm)
    unit = 16 if kernel in ("fwd", "bwd_dq") else 16 * d_split
    dpad = (d + unit - 1) // unit * unit
    srow = dpad + 8
    if kernel == "fwd":
        return 2 * (bm + 4 * bn) * srow
    if kernel == "bwd_dq":
        return 2 * (2 * bm + 4 * bn) * srow
    dkdv = 2 * (2 * bn + 4 * bm) * srow + 4 * 4 * bm
    return dkdv + (2 * bn * (bm + 8) if kernel == "bwd_dkdv_dq" else 0)  # + dS^T [bn][bm + 8]


def simt_f32(d: int) -> bool:
    """Head dims with the fast fp32 SIMT kernels (cuda/simt_f32.h). Mirrors config.rs."""
    return d % 64 == 0 and d <= 128


def source_file(kernel: str, dtype: str, d: int) -> str:
    if kernel == "bwd_dkdv_dq":
        kernel = "bwd_dkdv"
    if dtype == "f32" and kernel in ("fwd", "bwd_dq", "bwd_dkdv") and simt_f32(d):
        return f"{kernel}_f32_simt.cu"
    if dtype == "f32" and kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        return f"{kernel}_f32.cu"
    return f"{kernel}.cu"


def variant(kernel, dtype, head_dim, causal=False, group=1, even_m=False, even_n=False, small=False) -> Variant:
    """The variant launched for these settings; small=True: the 99 KiB-shared-memory fallback."""
    bm, bn, nw, ds, min_blocks = (small_tiles if small else tiles)(kernel, dtype, head_dim)
    defines = [("FLASH_DTYPE", DTYPES[dtype]), ("HEAD_DIM", head_dim), ("NUM_WARPS", nw)]
    if kernel not in ELEMENTWISE:
        defines += [
            ("IS_CAUSAL", int(causal)),
            ("GQA_GROUP", group),
            ("BLOCK_M", bm),
            ("BLOCK_N", bn),
            ("EVEN_M", int(even_m)),
            ("EVEN_N", int(even_n)),
        ]
        if kernel in ("bwd_dkdv", "bwd_dkdv_dq") and dtype != "f32":
            defines.append(("D_SPLIT", ds))
        if kernel == "bwd_dkdv_dq":
            defines.append(("ATOMIC_DQ", 1))
        if kernel == "fwd" and dtype != "f32":
            defines.append(("M_TILES", ds))
        defines.append(("MIN_BLOCKS", min_blocks))
    return Variant(kernel, dtype, head_dim, source_file(kernel, dtype, head_dim), bm, bn, nw, ds, tuple(defines))


def all_variants(head_dims=HEAD_DIMS) -> list[Variant]:
    """Every (kernel, dtype, head dim, causal) the library launches, default and small-shared-memory
    tiles. GQA group and EVEN_* change no code shape (a loop bound, a folded branch), so the check
    compiles them at group 1, ragged."""
    out = []
    for dtype in DTYPES:
        for d in head_dims:
            out.append(variant("bwd_preprocess", dtype, d))
            out.append(variant("bwd_dq_convert", dtype, d))
            for kernel in MAIN_KERNELS:
                for causal in (False, True):
                    v = variant(kernel, dtype, d, causal)
                    out.append(v)
                    small = variant(kernel, dtype, d, causal, small=True)
                    if small != v:
                        out.append(small)
    return out


# ---- sources -----------------------------------------------------------------------------------

def cuda_dir() -> pathlib.Path:
    for d in CUDA_DIRS:
        if (d / "params.h").exists():
            return d
    raise FileNotFoundError(f"kernel sources not found in {', '.join(map(str, CUDA_DIRS))}")


_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$')


def expand_source(name: str, directory: pathlib.Path | None = None) -> str:
    """The kernel file with its local #include "..." lines inlined (each header once), so that
    NVRTC needs no include path. The Rust launcher does the same with the embedded files."""
    directory = directory or cuda_dir()
    seen: set[str] = set()

    def walk(fname: str) -> str:
        out = []
        for line in (directory / fname).read_text().splitlines(keepends=True):
            m = _INCLUDE.match(line)
            if m:
                if m.group(1) not in seen:
                    seen.add(m.group(1))
                    out.append(walk(m.group(1)))
                continue
            if line.strip() == "#pragma once":
                continue
            out.append(line)
        return "".join(out)

    return walk(name)


# ---- NVRTC through ctypes ----------------------------------------------------------------------

class NvrtcError(RuntimeError):
    pass


def _nvrtc_candidates() -> list[str]:
    found = []
    env = os.environ.get("FLASH_NIF_NVRTC")
    if env:
        found.append(env)
    for p in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            found += sorted(glob.glob(os.path.join(p, sub, "libnvrtc.so.*")), reverse=True)
    found += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    return [f for f in found if "builtins" not in f and "alt" not in os.path.basename(f)]


def load_nvrtc():
    """Load libnvrtc; pip's copy needs its libnvrtc-builtins preloaded with RTLD_GLOBAL."""
    errors = []
    for cand in _nvrtc_candidates():
        try:
            if os.path.isabs(cand):
                for b in glob.glob(os.path.join(os.path.dirname(cand), "libnvrtc-builtins.so.*")):
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            return lib, cand
        except OSError as exc:
            errors.append(f"{cand}: {exc}")
    raise NvrtcError("libnvrtc not found (pip install nvidia-cuda-nvrtc):\n  " + "\n  ".join(errors))


def nvrtc_version(lib) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_variant(lib, v: Variant, arch: str, source: str | None = None) -> dict:
    """Compile one variant to a cubin; returns registers, spills, stack and the log."""
    src = source if source is not None else expand_source(v.source)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), v.source.encode(), 0, None, None)
    if rc:
        raise NvrtcError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}")
    try:
        opts = v.options(arch) + ["-Xptxas=-v"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        info = {"variant": v.name, "arch": arch, "ok": rc == 0, "log": log}
        if rc == 0:
            m = re.search(r"Used (\d+) registers", log)
            info["registers"] = int(m.group(1)) if m else -1
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
            info["stack"], info["spill_stores"], info["spill_loads"] = (
                tuple(int(x) for x in m.groups()) if m else (-1, -1, -1)
            )
        info["smem"] = v.smem_bytes()
        return info
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_nif.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="target, e.g. sm_80 or sm_90a (repeatable)")
    ap.add_argument("--head-dims", default="check",
                    help="'check' (a representative set, the default), 'all' (every multiple of 8 to 256) or a comma list")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-v", "--verbose", action="store_true", help="print NVRTC logs")
    args = ap.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90a"]
    if args.head_dims == "all":
        dims = HEAD_DIMS
    elif args.head_dims == "check":
        dims = CHECK_HEAD_DIMS
    else:
        dims = tuple(int(x) for x in args.head_dims.split(","))
    lib, path = load_nvrtc()
    major, minor = nvrtc_version(lib)
    print(f"NVRTC {major}.{minor} ({path}); sources {cuda_dir()}")
    sources = {}
    jobs = []
    for arch in archs:
        for v in all_variants(dims):
            if v.source not in sources:
                sources[v.source] = expand_source(v.source)
            jobs.append((v, arch))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: (j[0], compile_variant(lib, j[0], j[1], sources[j[0].source])), jobs))
    failures = 0
    print(f"{'variant':72s} {'arch':7s} {'regs':>4s} {'spill':>5s} {'stack':>5s} {'smem':>7s}")
    for v, r in results:
        if not r["ok"]:
            failures += 1
            print(f"{r['variant']:72s} {r['arch']:7s} COMPILE ERROR\n{r['log']}")
            continue
        spill = r["spill_stores"] + r["spill_loads"]
        bad = spill > 0 and v.kernel in MAIN_KERNELS
        failures += bad
        flag = "  <- SPILL" if bad else ""
        print(f"{r['variant']:72s} {r['arch']:7s} {r['registers']:4d} {spill:5d} {r['stack']:5d} {r['smem']:7d}{flag}")
        if args.verbose:
            print(r["log"])
    print(f"{len(results)} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
