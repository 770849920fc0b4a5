"""The shared fixture folders' cases (tests/fixtures/<folder>, written by the generators there from
the float64 oracle; ExUnit reads the same files)."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import ml_dtypes
import numpy as np

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def read_cases(folder: str) -> list[tuple[dict, dict]]:
    """(case, tensors) of every case in tests/fixtures/`folder`: little-endian bytes read as native
    arrays."""
    manifest = json.loads((FIXTURES / folder / "manifest.json").read_text())
    assert manifest["byte_order"] == "little"
    out = []
    for c in manifest["cases"]:
        blob = (FIXTURES / folder / c["file"]).read_bytes()
        tensors = {}
        for e in c["tensors"]:
            dtype = ml_dtypes.bfloat16 if e["dtype"] == "bfloat16" else np.dtype(e["dtype"])
            size = np.dtype(dtype).itemsize
            raw = np.frombuffer(blob, dtype=f"<u{size}", count=e["nbytes"] // size, offset=e["offset"])
            tensors[e["name"]] = raw.astype(f"=u{size}").view(dtype).reshape(e["shape"])
        out.append((c, tensors))
    return out


def assert_generator_reproduces(folder: str, tmp_path: pathlib.Path) -> None:
    """tests/fixtures/generate_`folder`.py, run into tmp_path, writes the committed files byte for
    byte (the fixtures are not stale)."""
    sys.path.insert(0, str(FIXTURES))
    try:
        generator = importlib.import_module(f"generate_{folder}")
    finally:
        sys.path.remove(str(FIXTURES))
    generator.build(tmp_path)
    for f in sorted((FIXTURES / folder).iterdir()):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f"{f.name} is stale: rerun generate_{folder}.py"
