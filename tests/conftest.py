"""Shared fixtures for the flash_nif test suite.

* ``ref``: the float64 oracle, :mod:`flash_nif.reference`. It is pure NumPy,
  so it is loaded straight from ``python/flash_nif/reference.py`` when the
  package itself cannot be imported (native extension not built yet).
* ``fa``: the public ``flash_nif`` package with its native extension. Tests
  that use it are skipped when it is missing, except under CI (``CI`` set)
  or with ``FLASH_NIF_REQUIRE_NATIVE=1``, where a missing extension fails.
* ``make_inputs``, ``rel_err``, ``assert_close_to_oracle``: helpers for
  random inputs and per-dtype tolerances (see ``assert_close_to_oracle``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

F32_TOL = 1e-5
"""Relative norm error allowed for float32 (true f32 arithmetic)."""

LOWP_SLACK = 1e-5
"""Absolute slack added to ``2 * baseline`` for float16 / bfloat16."""

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _load_reference():
    try:
        from flash_nif import reference

        return reference
    except Exception:  # package present but native extension missing, or not installed
        path = ROOT / "python" / "flash_nif" / "reference.py"
        spec = importlib.util.spec_from_file_location("flash_nif_reference_standalone", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _load_native():
    try:
        import flash_nif

        flash_nif.forward  # noqa: B018 - the attribute must exist
        return flash_nif
    except Exception as exc:  # ImportError, AttributeError from a partial package
        return exc


_NATIVE = _load_native()


def native_required() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("FLASH_NIF_REQUIRE_NATIVE") == "1"


@pytest.fixture(scope="session")
def ref():
    """The float64 NumPy oracle module."""
    return _load_reference()


@pytest.fixture(scope="session")
def fa():
    """The ``flash_nif`` package (skips, or fails under CI, when not built)."""
    if isinstance(_NATIVE, Exception):
        msg = f"flash_nif native extension not importable: {_NATIVE!r}"
        if native_required():
            pytest.fail(msg)
        pytest.skip(msg)
    return _NATIVE


def _make_inputs(seed, b, sq, sk, h, hkv, d, dtype=np.float32, q_scale=1.0):
    """Random ``q, k, v, do`` in ``dtype`` (standard normal, never zeros).

    ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``, ``do [B, Sq, H, D]``;
    ``q`` is multiplied by ``q_scale`` (large values make peaky softmax).
    """
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((b, sq, h, d)) * q_scale).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    do = rng.standard_normal((b, sq, h, d)).astype(dtype)
    return q, k, v, do


@pytest.fixture(scope="session")
def make_inputs():
    return _make_inputs


def _rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` in float64 over finite entries.

    Non-finite entries (``-inf`` lse of rows that see no key) must sit at the
    same places with the same values, else the error is ``inf``.
    """
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    fin = np.isfinite(want)
    if not np.array_equal(fin, np.isfinite(got)):
        return float("inf")
    if not np.array_equal(got[~fin], want[~fin], equal_nan=True):
        return float("inf")
    num = np.linalg.norm(got[fin] - want[fin])
    den = np.linalg.norm(want[fin])
    if den == 0.0:
        return float(num)
    return float(num / den)


@pytest.fixture(scope="session")
def rel_err():
    return _rel_err


def _tolerance(want, dtype) -> tuple[float, float]:
    """``(tolerance, baseline)`` for an output stored in ``dtype``.

    float32: a fixed ``F32_TOL``. float16 / bfloat16: ``2 * baseline +
    LOWP_SLACK`` where ``baseline`` is the error of the float64 oracle's own
    result merely rounded to ``dtype`` -- the least error any kernel storing
    its output in ``dtype`` can have (FlashAttention's test pattern: the
    kernel may be at most twice as far off as that).
    """
    if np.dtype(dtype) == np.dtype(np.float32):
        return F32_TOL, 0.0
    baseline = _rel_err(np.asarray(want).astype(dtype), want)
    return 2.0 * baseline + LOWP_SLACK, baseline


def _assert_close_to_oracle(name, got, want, dtype, context=""):
    """Assert ``got`` (kernel, ``dtype``) matches ``want`` (oracle, float64)."""
    tol, baseline = _tolerance(want, dtype)
    err = _rel_err(got, want)
    if baseline > 0.0:
        key = (np.dtype(dtype).name, name)
        WORST_RATIO[key] = max(WORST_RATIO.get(key, 0.0), err / baseline)
    assert err <= tol, (
        f"{name}: relative error {err:.3g} > tolerance {tol:.3g} "
        f"(dtype {np.dtype(dtype).name}, rounding baseline {baseline:.3g}) {context}"
    )
    return err


@pytest.fixture(scope="session")
def assert_close_to_oracle():
    return _assert_close_to_oracle


# Worst errors seen by the accuracy tests, printed at the end of the run
# (pytest -rA or -s not needed: a terminal summary section).
WORST: dict[tuple[str, str], float] = {}
# worst kernel error / rounding baseline, float16 and bfloat16 (the bound is 2)
WORST_RATIO: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="session")
def record_error():
    def record(dtype_name: str, tensor: str, err: float) -> None:
        key = (dtype_name, tensor)
        WORST[key] = max(WORST.get(key, 0.0), err)

    return record


# Why the tests marked `gpu` were skipped: their own skip reasons (test_gpu.py's probe of
# flash_nif.info()["cuda"], torch and CuPy), counted for one line at the end of the run.
GPU_SKIPS: dict[str, int] = {}


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" in report.keywords and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
        GPU_SKIPS[reason] = GPU_SKIPS.get(reason, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if GPU_SKIPS:
        reasons = sorted(GPU_SKIPS.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line(
            f"{sum(GPU_SKIPS.values())} GPU tests skipped: "
            + "; ".join(f"{reason} ({n})" for reason, n in reasons)
        )
    if not WORST:
        return
    terminalreporter.section("worst relative error vs the float64 oracle")
    # dtypes first, then per-kernel keys such as "f32-3xf16-sm90" (test_tf32.py's error table)
    names = ["f32", "f16", "bf16"] + sorted({dn for dn, _ in WORST} - {"f32", "f16", "bf16"})
    for dtype_name in names:
        row = {t: e for (dn, t), e in WORST.items() if dn == dtype_name}
        if row:
            cells = "  ".join(f"{t}={row[t]:.2e}" for t in ("o", "lse", "dq", "dk", "dv") if t in row)
            terminalreporter.write_line(f"{dtype_name:5s} {cells}")
    for dtype_name in ("float16", "bfloat16"):
        row = {t: r for (dn, t), r in WORST_RATIO.items() if dn == dtype_name}
        if row:
            cells = "  ".join(f"{t}={row[t]:.3f}" for t in ("o", "dq", "dk", "dv") if t in row)
            terminalreporter.write_line(f"{dtype_name} error / rounding baseline (bound 2): {cells}")
