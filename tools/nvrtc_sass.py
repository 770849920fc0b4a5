"""nvrtc_sass.py — compile the kernel variants whose names match a regex with NVRTC, as the launcher
does (its options come from the extension: compile.rs owns them), and print ptxas's resource line
and instruction counts of the SASS (development tool; needs no GPU). The cubins and SASS land in
--out.

    .venv/bin/python tools/nvrtc_sass.py 'decode_bf16_d128_cache_bits4_k_group64_v_group64' [--arch sm_90a]
        [--count HMMA,LDS,PRMT] [--head-dims 128] [--loop HMMA]

--loop OP also counts the opcodes of the innermost loop around the instructions OP names (the first
to the last; the loop: from its back branch's target to that branch), e.g. decode's block loop.

NVRTC is pip's nvidia-cuda-nvrtc (the Makefile's venv); cuobjdump and nvdisasm pip's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys

import flash_nif._native as native
import nvidia

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NV = os.path.join(list(nvidia.__path__)[0], "cu13")


def expand(name: str, seen: set) -> str:
    """The source with its local includes inlined once each, as sources.rs expands the embedded
    copies; read from the working tree, so an edit is compiled without rebuilding the extension."""
    out = []
    for line in open(os.path.join(ROOT, "cuda", name)):
        m = re.match(r'\s*#include "([^"]+)"', line)
        if m:
            if m.group(1) not in seen:
                seen.add(m.group(1))
                out.append(expand(m.group(1), seen))
        elif line.strip() != "#pragma once":
            out.append(line)
    return "".join(out)


def nvrtc(src: str, name: str, opts: list[str]) -> tuple[bytes, str]:
    lib = ctypes.CDLL(os.path.join(NV, "lib", "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"{name}: NVRTC error\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log.value.decode()


INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def loop_histogram(sass: str, op: str) -> tuple[int, collections.Counter]:
    """Opcodes of the loop that holds every `op` instruction of the SASS: from the target of the
    first backward branch after the last `op` to that branch."""
    insns = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in INSN.finditer(sass)]
    at = [a for a, name, _ in insns if name.split(".")[0] == op]
    if not at:
        return 0, collections.Counter()
    for a, name, rest in insns:
        target = re.search(r"0x([0-9a-f]+)", rest) if name.startswith("BRA") else None
        if a > at[-1] and target and int(target.group(1), 16) <= at[0]:
            body = [n.split(".")[0] for b, n, _ in insns if int(target.group(1), 16) <= b <= a]
            return len(body), collections.Counter(body)
    return 0, collections.Counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pattern")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--count", default="HMMA,LDS,LDSM,PRMT,LOP3,SHF,FFMA,FMUL,MUFU,SHFL,BAR,LDGSTS,LDL,STL")
    ap.add_argument("--out", default="/tmp/sass")
    ap.add_argument("--loop", default="", help="opcode histogram of the loop around these instructions (e.g. HMMA)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dims = [int(d) for d in args.head_dims.split(",")]
    for v in native.cuda_kernel_variants(dims, arch=args.arch):
        if not re.search(args.pattern, v["name"]):
            continue
        cubin, log = nvrtc(expand(v["source"], set()), v["source"], v["nvrtc_options"])
        path = os.path.join(args.out, f"{v['name']}.{args.arch}.cubin")
        open(path, "wb").write(cubin)
        env = dict(os.environ, PATH=os.path.join(NV, "bin") + os.pathsep + os.environ.get("PATH", ""))
        sass = subprocess.run([os.path.join(NV, "bin", "cuobjdump"), "-sass", path], capture_output=True, text=True, env=env).stdout
        open(path + ".sass", "w").write(sass)
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
        usage = " ".join(l.strip() for l in log.splitlines() if "registers" in l or "spill" in l)
        print(v["name"], args.arch)
        print("  ", usage)
        print("  ", " ".join(f"{k}={ops.get(k, 0)}" for k in args.count.split(",")), f"total={sum(ops.values())}")
        if args.loop:
            n, body = loop_histogram(sass, args.loop)
            print(f"   loop around {args.loop}: {n} instructions:", " ".join(f"{k}={c}" for k, c in body.most_common(16)))


if __name__ == "__main__":
    main()
