"""The launcher's kernel table against its golden snapshot, and the compile check (no GPU needed).

tests/golden/kernel_variants.json pins every variant of the check's head dims (name, defines,
source, tiles, tile set) and the shared memory each kernel declares. After an intended change,
regenerate it: python -m flash_nif.kernels --write-golden tests/golden/kernel_variants.json
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from flash_nif import kernels

GOLDEN_PATH = pathlib.Path(__file__).resolve().parent / "golden" / "kernel_variants.json"


@pytest.fixture(scope="module")
def golden(fa):
    if not hasattr(fa._native, "cuda_kernel_variants"):
        pytest.skip("built without the CUDA backend")
    return json.loads(GOLDEN_PATH.read_text())


def test_variant_table_matches_the_golden_snapshot(golden):
    got = [{f: v[f] for f in kernels.TABLE_FIELDS} for v in kernels.variants(golden["head_dims"])]
    want = [{f: v[f] for f in kernels.TABLE_FIELDS} for v in golden["variants"]]
    assert [v["name"] for v in got] == [v["name"] for v in want]
    assert got == want


def test_golden_check_head_dims_are_the_clis():
    assert json.loads(GOLDEN_PATH.read_text())["head_dims"] == sorted(kernels.CHECK_HEAD_DIMS)


def test_golden_shared_memory_fits_the_gpus(golden):
    """Default tiles fit an H100's 227 KiB; each launch's last candidate a 99 KiB sm_86."""
    assert kernels.fit_errors(golden["variants"]) == []
    assert all(v["smem_bytes"] == 0 for v in golden["variants"] if v["kernel"] in ("bwd_preprocess", "bwd_dq_convert", "pad"))


def test_fit_rules_catch_an_oversized_kernel(golden):
    rows = [dict(v) for v in golden["variants"]]
    small = next(v for v in rows if v["tile_set"] == "small")
    small["smem_bytes"] = kernels.MAX_SMEM_ANY + 16
    assert len(kernels.fit_errors(rows)) == 1


def test_spills_are_allowed_only_where_named(golden):
    """The spill allowance names decode's PAIRED 4-bit one-wave kernels (four, eight and sixteen
    blocks an SM) and its one-warp 8-bit ones (sixteen, bf16 and fp16 q), present in the table, and
    no other variant."""
    allowed = [v["name"] for v in golden["variants"] if kernels.spill_allowed(v["name"])]
    q4 = [n for n in allowed if n.startswith("decode_bf16_d128_cache_bits4_k_group64_v_group64")]
    q8 = [n for n in allowed if "_d128_cache_bits8_k_group64_v_group64_num_warps1_" in n]
    assert sorted(n.rsplit("_", 1)[1] for n in q4) == ["blocks16", "blocks4", "blocks8"]
    assert all("_state_tile4_" in n for n in q4)
    assert sorted(n.split("_", 2)[1] for n in q8) == ["bf16", "f16"]
    assert all(n.endswith("_min_blocks16") for n in q8)
    assert sorted(allowed) == sorted(q4 + q8)
    assert not kernels.spill_allowed("decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps4_state_tile4_stages2_min_blocks3")
    assert not kernels.spill_allowed("decode_bf16_d128_cache_bits8_k_group64_v_group64_num_warps4_state_tile8_stages2_min_blocks4")


def test_no_define_is_dead_weight(golden):
    """EVEN_M changed no code (rows past Sq are zero-filled, never stored): it is not in the key."""
    assert not any("EVEN_M" in v["defines"] for v in golden["variants"])


def _nvrtc_or_skip(fa):
    try:
        fa._native.cuda_nvrtc()
    except fa.DeviceError as e:
        pytest.skip(f"no NVRTC: {e}")


def test_compile_check_from_outside_the_source_tree(fa, golden, tmp_path):
    """The CLI compiles from the embedded sources in any directory, and each kernel's shared memory
    matches the snapshot (a representative subset; `make test-kernels` compiles all)."""
    _nvrtc_or_skip(fa)
    cmd = [sys.executable, "-m", "flash_nif.kernels", "--arch", "sm_80", "--head-dims", "8", "--golden", str(GOLDEN_PATH)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 failed" in r.stdout


def test_compile_report_names_the_error(fa):
    _nvrtc_or_skip(fa)
    rows = fa._native.cuda_compile_report(["sm_80"], [8], 1)
    assert {r["arch"] for r in rows} == {"sm_80"} and all(r["ok"] for r in rows)
    assert len(rows) == len(kernels.variants([8]))
    bad = fa._native.cuda_compile_report(["sm_1"], [8], 1)[0]
    assert not bad["ok"] and bad["error"]


def test_tile_override_hook(fa):
    native = fa._native
    if not hasattr(native, "cuda_set_tile_override"):
        pytest.skip("built without the CUDA backend")
    before = kernels.variants([64])
    native.cuda_set_tile_override("fwd", "bf16", 64, (64, 64, 4, 1, 1))
    try:
        assert kernels.variants([64]) == before  # the table, not this process's overrides
    finally:
        native.cuda_set_tile_override("fwd", "bf16", 64, None)
    with pytest.raises(fa.UnsupportedError):
        native.cuda_set_tile_override("fwd2", "bf16", 64, (64, 64, 4, 1, 1))
    with pytest.raises(fa.UnsupportedError):
        native.cuda_set_tile_override("bwd_preprocess", "bf16", 64, (64, 64, 4, 1, 1))
    with pytest.raises(fa.DTypeError):
        native.cuda_set_tile_override("fwd", "int8", 64, (64, 64, 4, 1, 1))


def test_tools_parse():
    """tools/*.py run only on a GPU machine; here they must at least parse."""
    import ast

    tools = sorted((pathlib.Path(__file__).resolve().parents[1] / "tools").glob("*.py"))
    assert tools
    for path in tools:
        ast.parse(path.read_text(), str(path))


def test_sm90_warnings_are_failures():
    """ptxas's serialized-wgmma and ignored-setmaxnreg warnings fail the sm_90a-only kernels only."""
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
           "ptxas info    : Used 168 registers")
    sm90 = next(iter(kernels.SM90_KERNELS))
    assert len(kernels.sm90_warnings({"kernel": sm90, "log": log})) == 1
    assert kernels.sm90_warnings({"kernel": sm90, "log": "ptxas info    : Used 168 registers"}) == []
    assert kernels.sm90_warnings({"kernel": "fwd", "log": log}) == []
