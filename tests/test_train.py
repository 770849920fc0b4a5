"""The manual gradient-stitching trainer (`python -m flash_nif.train`).

Small models only (seconds on a 2-core CPU): the whole-model gradient check passes and catches a
broken layer, a few steps lower the loss, N straight steps and N/2 + --resume + N/2 end with
bit-identical parameters/optimizer state/curves, and bad command lines fail with a clear message.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

train = pytest.importorskip("flash_nif.train")

from flash_nif.train import cli, model as model_mod  # noqa: E402
from flash_nif.train.backend import float64_reference_attention, get_attention, get_device  # noqa: E402
from flash_nif.train.data import RecallTask  # noqa: E402
from flash_nif.train.gradcheck import DEFAULT_TOL, grad_check, tiny_config  # noqa: E402
from flash_nif.train.model import ModelConfig  # noqa: E402
from flash_nif.train.trainer import TrainConfig, Trainer  # noqa: E402

SMALL = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--dim", "32", "--seq", "16",
         "--batch", "8", "--eval-batches", "2", "--eval-every", "4", "--ckpt-every", "3", "--no-progress"]


@pytest.fixture(scope="module")
def cpu(fa):
    """The CPU device and flash_nif's native attention (skips/fails like the rest of the suite)."""
    device = get_device("cpu")
    return device, get_attention("flash_nif", device)


def small_config(**over) -> TrainConfig:
    values = dict(cli.DEFAULTS)
    values.update(layers=2, heads=4, kv_heads=2, dim=32, seq=16, batch=16, lr=3e-3, warmup=5,
                  eval_batches=2, eval_every=10, ckpt_every=10)
    values.update(over)
    return TrainConfig(**values)


def test_grad_check_float64_layers_exact():
    """Hand-written backward of every layer with the oracle's attention, all in float64: only the
    finite-difference error remains."""
    cfg, task = tiny_config(ModelConfig(vocab=1, dim=8, layers=2, heads=2, kv_heads=1, seq=8))
    res = grad_check(cfg, task, float64_reference_attention(), get_device("cpu"), dtype=np.float64,
                     max_coords=10_000)
    assert res.coords == sum(int(np.prod(s)) for s in model_mod.param_shapes(cfg).values())
    assert res.max_rel_err < 1e-6, res.per_param


def test_grad_check_native_passes(cpu):
    """The training path (float32, flash_nif's backward stitched in) against float64 finite differences."""
    device, attention = cpu
    cfg, task = tiny_config(ModelConfig(vocab=1, dim=32, layers=3, heads=4, kv_heads=2, seq=16))
    res = grad_check(cfg, task, attention, device, max_coords=16)
    assert set(res.per_param) == set(model_mod.param_shapes(cfg))
    assert res.passed(DEFAULT_TOL), (res.max_rel_err, res.worst, res.per_param)


def test_grad_check_catches_a_wrong_backward(cpu, monkeypatch):
    device, attention = cpu
    cfg, task = tiny_config(ModelConfig(vocab=1, dim=8, layers=1, heads=2, kv_heads=1, seq=8))
    monkeypatch.setattr(model_mod, "rope_bwd", lambda dy, cos, sin: dy)  # forgets the rotation
    res = grad_check(cfg, task, attention, device, max_coords=16)
    assert not res.passed(DEFAULT_TOL)
    assert res.worst.endswith(("wq", "wk", "attn_norm", "embed")), res.per_param


def test_task_needs_lookup():
    task = RecallTask(seq=16, num_keys=8, num_values=8)
    rng = np.random.default_rng(0)
    tokens, targets = task.sample(rng, 5)
    n = task.num_pairs
    for row, tgt in zip(tokens, targets):
        pairs = dict(zip(row[0:2 * n:2], row[1:2 * n:2]))
        assert len(pairs) == n  # distinct keys
        for pos in range(2 * n, task.seq, 2):
            assert tgt[pos] == pairs[row[pos]] == row[pos + 1]
        assert (tgt[:2 * n] == -1).all() and (tgt[2 * n + 1::2] == -1).all()


def test_few_steps_lower_the_loss(cpu):
    device, attention = cpu
    trainer = Trainer(small_config(steps=40), device, attention)
    eval_before, _ = trainer.evaluate()
    losses = [trainer.train_step()[0] for _ in range(40)]
    eval_after, _ = trainer.evaluate()
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses
    assert eval_after < eval_before


def _load(out):
    with np.load(os.path.join(out, "checkpoint.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_resume_is_bit_exact(cpu, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert cli.main(SMALL + ["--steps", "10", "--out", straight]) == 0
    assert cli.main(SMALL + ["--steps", "5", "--out", split]) == 0
    assert _load(split)["param/head"].shape == _load(straight)["param/head"].shape
    assert cli.main(["--steps", "10", "--out", split, "--resume", "--no-progress"]) == 0

    a, b = _load(straight), _load(split)
    assert set(a) == set(b)
    state = [k for k in a if k.startswith(("param/", "adam_m/", "adam_v/"))]
    assert len(state) == 3 * len(model_mod.param_shapes(TrainConfig(**{**cli.DEFAULTS, "layers": 2}).model()))
    for key in state + ["hist/train_loss", "hist/train_acc"]:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    # the split run also evaluated where it stopped (step 5); every other eval point is identical
    at = {s: i for i, s in enumerate(b["hist/eval_step"])}
    for i, s in enumerate(a["hist/eval_step"]):
        assert a["hist/eval_loss"][i] == b["hist/eval_loss"][at[s]], s
    ma, mb = json.loads(str(a["meta"])), json.loads(str(b["meta"]))
    assert ma["step"] == mb["step"] == 10 and ma["data_rng"] == mb["data_rng"]

    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    for key in ("loss_first", "loss_last", "eval_accuracy", "grad_check_max_rel_err", "steps",
                "tokens_per_s", "device", "config"):
        assert key in summary, key
    assert summary["steps"] == 10 and summary["device"] == "cpu"
    assert summary["grad_check_max_rel_err"] < DEFAULT_TOL
    assert (tmp_path / "split" / "loss.png").stat().st_size > 10_000


def test_resume_rejects_a_conflicting_config(cpu, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert cli.main(SMALL + ["--steps", "2", "--out", out]) == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(["--steps", "4", "--out", out, "--resume", "--dim", "64"])
    assert exc.value.code == 2
    assert "conflicts with the checkpoint" in capsys.readouterr().err


def test_no_progress_bar_when_stderr_is_not_a_terminal(cpu, tmp_path, capsys):
    # `make demo > log 2>&1`: the bar's carriage-return redraws must not fill the log
    args = [a for a in SMALL if a != "--no-progress"] + ["--steps", "4", "--out", str(tmp_path / "run")]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "train:" not in err, err
    assert "step     4: eval loss" in out and out.rstrip().splitlines()[-1].startswith("wrote "), out


def test_readme_options_table_lists_every_cli_option():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    demo = readme[readme.index("## Training demo"):]
    table = demo[demo.index("| option | default | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = {m for row in table.splitlines() for m in re.findall(r"--[a-z][a-z-]*", row.split("|")[1])}
    options = {o for a in cli.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert documented == options - {"--help"}


def _run_cli(*args):
    env = dict(os.environ)
    # the subprocess imports flash_nif from where this process found it
    import flash_nif

    root = os.path.dirname(os.path.dirname(os.path.abspath(flash_nif.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-m", "flash_nif.train", *args], capture_output=True,
                          text=True, env=env, timeout=120)


BAD_ARGS = [
    (["--steps", "-5"], "--steps: must be a positive integer"),
    (["--steps", "ten"], "--steps: expected an integer"),
    (["--heads", "4", "--kv-heads", "3"], "--heads 4 must be divisible by --kv-heads 3"),
    (["--dim", "30", "--heads", "4"], "--dim 30 must be divisible by --heads 4"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--lr", "-1"], "--lr: must be > 0"),
    (["--seq", "30"], "must be a multiple of 4"),
    (["--resume", "--out", "/nonexistent/flash_nif_run"], "no checkpoint at"),
]


@pytest.mark.parametrize("args,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_fail_clearly(fa, args, message):
    proc = _run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cuda_without_a_gpu_backend_is_an_error_not_a_fallback(fa, tmp_path):
    if "cuda" in fa.info().get("backends", []):
        pytest.skip("this build has a CUDA backend: see test_cuda_run")
    proc = _run_cli("--device", "cuda", "--steps", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "--device cuda" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_cuda_run(fa, tmp_path):
    cupy = pytest.importorskip("cupy")
    if "cuda" not in fa.info().get("backends", []):
        pytest.skip("flash_nif built without the CUDA backend")
    out = str(tmp_path / "gpu")
    assert cli.main(SMALL + ["--steps", "6", "--device", "cuda", "--out", out]) == 0
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["grad_check_max_rel_err"] < DEFAULT_TOL
    assert cupy is not None
