"""flash_nif.quantize_kv, dequantize_kv, decode and merge_states against the shared KV-cache
fixtures in tests/fixtures/decode (written by tests/fixtures/generate_decode.py from the float64
oracle). ExUnit (elixir/test/decode_test.exs) checks the NIF against the same numbers, so Python
and Elixir are judged alike; tests/test_quant.py holds the wider sweeps."""

from __future__ import annotations

import numpy as np

from fixture_cases import FIXTURES, assert_generator_reproduces, read_cases


def _cases():
    return read_cases("decode")


def _of(kind):
    return [(c, t) for c, t in _cases() if c["kind"] == kind]


def test_quantize_fixtures(fa):
    cases = _of("quantize")
    assert {(c["bits"], c["group_size"]) for c, _ in cases} == {(4, 32), (4, 64), (8, 32), (8, 64)}
    assert {c["dtype"] for c, _ in cases} == {"float32", "float16", "bfloat16"}
    for c, t in cases:
        got = fa.quantize_kv(t["x"], bits=c["bits"], group_size=c["group_size"])
        np.testing.assert_array_equal(got.values, t["values"], err_msg=c["name"])
        for part in ("scales", "biases"):
            np.testing.assert_array_equal(getattr(got, part).view(np.uint8), t[part].view(np.uint8), err_msg=c["name"])
        deq = fa.dequantize_kv(got).astype(np.float32)
        assert np.all(np.abs(deq - t["deq"]) <= t["deq_tol"]), c["name"]


def test_decode_fixtures(fa, rel_err):
    cases = _of("decode")
    assert {c["quant"] and tuple(c["quant"]) for c, _ in cases} >= {None, (8, 32), (4, 64), (4, 32)}
    assert {c["seq_q"] for c, _ in cases} >= {1, 4, 16} and any(c["heads"] > c["kv_heads"] for c, _ in cases)
    for c, t in cases:
        if c["quant"] is None:
            k, v = t["k"], t["v"]
        else:
            k, v = (fa.quantize_kv(t[n], bits=c["quant"][0], group_size=c["quant"][1]) for n in ("k", "v"))
        window = None if c["window"] is None else tuple(c["window"])
        for splits in c["splits"]:
            o, lse = fa.decode(t["q"], k, v, cache_seqlens=t["cache_seqlens"], leftpad_k=t["leftpad_k"],
                               causal=c["causal"], scale=c["scale"], window=window, softcap=c["softcap"],
                               num_splits=splits)
            ctx = f"{c['name']} splits={splits}"
            assert rel_err(o, t["o"]) <= c["tol"]["o"], ctx
            assert rel_err(lse, t["lse"]) <= c["tol"]["lse"], ctx
            empty = t["cache_seqlens"] == t["leftpad_k"]
            assert np.all(o[empty] == 0) and np.isneginf(lse[empty]).all(), ctx


def test_merge_fixtures(fa, rel_err):
    for c, t in _of("merge"):
        o, lse = fa.merge_states(t["o_parts"], t["lse_parts"])
        assert o.dtype == t["o_parts"].dtype
        assert rel_err(o, t["o"]) <= c["tol"]["o"], c["name"]
        assert rel_err(lse, t["lse"]) <= c["tol"]["lse"], c["name"]


def test_readme_decode_loop_runs(fa):
    """The README's decode loop (its own assert checks each step against forward)."""
    readme = (FIXTURES.parents[1] / "README.md").read_text()
    section = readme[readme.index("## Decoding over (quantized) KV caches"):]
    loop = [b.split("```")[0] for b in section.split("```python")[1:] if "for step in" in b.split("```")[0]]
    assert len(loop) == 1
    exec(compile(loop[0], "README.md decode loop", "exec"), {})


def test_fixtures_are_what_the_generator_writes(tmp_path):
    assert_generator_reproduces("decode", tmp_path)
