"""`python -m flash_nif.train --framework torch`: the demo's model as torch modules with
flash_nif.torch's op, against the hand-stitched NumPy run (skipped without torch).

The two frameworks start from the same parameters, draw the same batches and apply the same AdamW
(optim.py: bit-identical on both, checked below), so they differ only by float32 rounding in the
layers (torch's and NumPy's matmul and reduction orders). Measured on the 2-core development
machine (AMD EPYC Zen 4, torch 2.13 CPU, 2026-11-23): the loss curves of the two over 100 steps
differ by at most 2.2e-7 relative (about two float32 ulps) for CURVE_CONFIG and 1.9e-7 for the
default demo, with no growth over the steps; parameters after 100 steps by 6.8e-7 (relative
norm). CURVE_TOL allows 9x that worst case. Bugs the check must catch, measured the same way (max relative loss
difference over the 100 steps): attention scale 1.01/sqrt(D) 2.0e-3, 2/sqrt(D) 4.7e-2, a window
of 8 keys 2.4e-1, non-causal 8.1e-1 -- a thousand times above the bound or more.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_nif.train import cli  # noqa: E402
from flash_nif.train.backend import TorchAttention, get_attention, get_device, to_host  # noqa: E402
from flash_nif.train.data import RecallTask  # noqa: E402
from flash_nif.train.gradcheck import DEFAULT_TOL, grad_check, tiny_config  # noqa: E402
from flash_nif.train.model import ModelConfig, Transformer, init_params  # noqa: E402
from flash_nif.train.torch_model import TorchTransformer  # noqa: E402
from flash_nif.train.trainer import TrainConfig, Trainer  # noqa: E402

CURVE_TOL = 2e-6
"""Largest relative difference of a step's loss between the frameworks (module docstring)."""

CURVE_STEPS = 100

SMALL = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--dim", "32", "--seq", "16",
         "--batch", "8", "--eval-batches", "2", "--eval-every", "3", "--ckpt-every", "3", "--no-progress"]


def config(**over) -> TrainConfig:
    values = dict(cli.DEFAULTS)
    values.update(layers=2, heads=4, kv_heads=2, dim=32, seq=16, batch=16, lr=3e-3, warmup=5,
                  eval_batches=2, eval_every=10, ckpt_every=10)
    values.update(over)
    return TrainConfig(**values)


CURVE_CONFIG = config()
# Learns the task in ~250 steps (held-out accuracy 0.998 at 250 and 300, both frameworks).
ACCURACY_CONFIG = config(batch=32, warmup=20, num_keys=8, num_values=8, eval_batches=4)


@pytest.fixture
def one_thread():
    """One BLAS thread and one torch intra-op thread, as the CLI's default --blas-threads 1 (on a
    busy 2-core machine, threads spinning between the small ops starve flash_nif's own)."""
    limits = cli.limit_blas_threads(1, "torch")
    yield
    limits.restore_original_limits()


def trainer(framework: str, cfg: TrainConfig, device: str = "cpu", attention=None) -> Trainer:
    dev = get_device(device, framework)
    return Trainer(cfg, dev, attention or get_attention("flash_nif", dev))


def loss_curve(t: Trainer, steps: int) -> np.ndarray:
    return np.array([t.train_step()[0] for _ in range(steps)])


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(a)))


def test_same_loss_and_gradients_as_the_numpy_model(fa, one_thread):
    """One batch, the same float32 parameters: the torch modules compute the hand-stitched model."""
    cfg = ModelConfig(vocab=24, dim=32, layers=2, heads=4, kv_heads=2, seq=16)
    rng = np.random.default_rng(7)
    params = init_params(cfg, rng)
    for name in params:  # norm gains away from 1, so a missing gain shows
        if name.endswith("norm"):
            params[name] = (1 + 0.2 * rng.standard_normal(params[name].shape)).astype(np.float32)
    tokens, targets = RecallTask(seq=16, num_keys=12, num_values=12).sample(rng, 4)

    np_dev, t_dev = get_device("cpu", "numpy"), get_device("cpu", "torch")
    loss_n, correct_n, count_n, grads_n = Transformer(cfg, get_attention("flash_nif", np_dev)).loss_and_grads(
        params, tokens, targets)
    model = TorchTransformer(cfg, get_attention("flash_nif", t_dev))
    loss_t, correct_t, count_t, grads_t = model.loss_and_grads(
        {k: t_dev.put(p.copy()) for k, p in params.items()}, t_dev.put(tokens), t_dev.put(targets))
    assert count_t == count_n and int(correct_t) == int(correct_n)
    assert abs(float(loss_t) - float(loss_n)) <= 1e-6 * abs(float(loss_n))
    assert set(grads_t) == set(grads_n)
    for name, g in grads_n.items():
        gt = to_host(grads_t[name])
        assert gt.dtype == g.dtype == np.float32 and gt.shape == g.shape, name
        err = np.linalg.norm(gt - g) / np.linalg.norm(g)
        assert err < 1e-5, (name, err)  # float32 rounding, summation orders (measured: <= 4.7e-7)


def test_optimizer_is_bit_identical_across_frameworks():
    """AdamW (optim.py) gives the same bits on NumPy arrays and torch tensors; the clipping norm
    (a float64 sum, in each library's order) agrees to float64 rounding."""
    from flash_nif.train.optim import AdamW, clip_by_global_norm

    rng = np.random.default_rng(3)
    p_np = {"w": rng.standard_normal((64, 33)).astype(np.float32), "norm": rng.standard_normal(33).astype(np.float32)}
    p_t = {k: torch.from_numpy(v.copy()) for k, v in p_np.items()}
    opts = [AdamW(p, weight_decay=0.1, decays=lambda name: name == "w") for p in (p_np, p_t)]
    for step in range(4):
        g_np = {k: (3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p_np.items()}
        norm_t = clip_by_global_norm({k: torch.from_numpy(v.copy()) for k, v in g_np.items()}, 1.0)[1]
        g_np, norm_np = clip_by_global_norm(g_np, 1.0)
        assert abs(norm_t - norm_np) <= 1e-12 * norm_np
        g_t = {k: torch.from_numpy(v.copy()) for k, v in g_np.items()}
        opts[0].update(p_np, g_np, 1e-3 * (step + 1))
        opts[1].update(p_t, g_t, 1e-3 * (step + 1))
        for k in p_np:
            assert np.array_equal(p_np[k], p_t[k].numpy()), (step, k)
            assert np.array_equal(opts[0].v[k], opts[1].v[k].numpy()), (step, k)


def test_torch_gradient_check_passes(fa, one_thread):
    """The demo's whole-model check on the torch path: autograd through the modules and
    flash_nif.torch against float64 finite differences of the NumPy model with the oracle."""
    device = get_device("cpu", "torch")
    cfg, task = tiny_config(ModelConfig(vocab=1, dim=32, layers=2, heads=4, kv_heads=2, seq=16))
    res = grad_check(cfg, task, get_attention("flash_nif", device), device, max_coords=16)
    assert res.attention == "flash_nif.torch"
    assert res.passed(DEFAULT_TOL), (res.max_rel_err, res.worst, res.per_param)


def test_loss_curves_match_over_100_steps(fa, one_thread):
    numpy_run = trainer("numpy", CURVE_CONFIG)
    torch_run = trainer("torch", CURVE_CONFIG)
    a, b = loss_curve(numpy_run, CURVE_STEPS), loss_curve(torch_run, CURVE_STEPS)
    assert a[-1] < 0.7 * a[0]  # it trained
    assert max_rel_diff(a, b) <= CURVE_TOL, np.abs(a - b) / a
    for name, p in numpy_run.params.items():  # and the weights followed the same path
        assert np.linalg.norm(to_host(torch_run.params[name]) - p) <= 1e-5 * np.linalg.norm(p), name


def test_curve_comparison_catches_a_one_percent_attention_scale(fa, one_thread):
    """The bound has teeth: attention scaled by 1.01/sqrt(D) instead of 1/sqrt(D) fails it."""
    import flash_nif.torch as fnt

    def scaled(q, k, v):
        return fnt.attention(q, k, v, causal=True, scale=1.01 / math.sqrt(q.shape[-1]))

    a = loss_curve(trainer("numpy", CURVE_CONFIG), CURVE_STEPS)
    b = loss_curve(trainer("torch", CURVE_CONFIG, attention=TorchAttention("wrong scale", scaled)), CURVE_STEPS)
    assert max_rel_diff(a, b) > 100 * CURVE_TOL


def test_same_held_out_accuracy(fa, one_thread):
    """Both frameworks learn the task (held-out accuracy >= 0.99, chance 0.125) and agree on it.

    Measured: 0.998 (511 of 512 answers) for both, eval losses 0.00543 and 0.00544. Past the
    point where the lookup forms, float32 differences grow like those between any two summation
    orders, so the bound allows two answers of difference rather than demanding equal bits."""
    results = {}
    for framework in ("numpy", "torch"):
        t = trainer(framework, ACCURACY_CONFIG)
        loss_curve(t, 300)
        results[framework] = t.evaluate()
    (loss_n, acc_n), (loss_t, acc_t) = results["numpy"], results["torch"]
    answers = ACCURACY_CONFIG.eval_batches * ACCURACY_CONFIG.batch * (ACCURACY_CONFIG.seq // 4)
    assert min(acc_n, acc_t) >= 0.99 and abs(acc_t - acc_n) <= 2 / answers, results
    assert abs(loss_t - loss_n) <= 0.1 * loss_n, results


def _checkpoint(out):
    with np.load(f"{out}/checkpoint.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_cli_torch_run_resumes_bit_exact(fa, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    torch_args = SMALL + ["--framework", "torch"]
    assert cli.main(torch_args + ["--steps", "6", "--out", straight]) == 0
    assert cli.main(torch_args + ["--steps", "3", "--out", split]) == 0
    assert cli.main(["--framework", "torch", "--steps", "6", "--out", split, "--resume", "--no-progress"]) == 0
    a, b = _checkpoint(straight), _checkpoint(split)
    for key in a:
        if key.startswith(("param/", "adam_m/", "adam_v/")) or key in ("hist/train_loss",):
            assert np.array_equal(a[key], b[key]), key
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["framework"] == "torch" and summary["attention"] == "flash_nif.torch"
    assert summary["grad_check_max_rel_err"] < DEFAULT_TOL
    assert torch.get_num_threads() >= 1  # the CLI restored the thread count it changed


def test_a_numpy_checkpoint_resumes_in_torch(fa, tmp_path):
    """One checkpoint format: 3 NumPy steps + 3 torch steps follow 6 NumPy steps to float32 rounding."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert cli.main(SMALL + ["--steps", "6", "--out", straight]) == 0
    assert cli.main(SMALL + ["--steps", "3", "--out", split]) == 0
    assert cli.main(["--framework", "torch", "--steps", "6", "--out", split, "--resume", "--no-progress"]) == 0
    a, b = _checkpoint(straight), _checkpoint(split)
    assert np.array_equal(a["hist/train_loss"][:3], b["hist/train_loss"][:3])
    assert max_rel_diff(a["hist/train_loss"], b["hist/train_loss"]) <= CURVE_TOL
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["framework"] == "torch"


def test_torch_framework_refuses_the_numpy_oracle(fa, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--framework", "torch", "--attention", "reference", "--steps", "1"])
    assert exc.value.code == 2
    assert "--attention reference is the NumPy framework's" in capsys.readouterr().err


def test_torch_cuda_without_a_gpu_is_an_error_not_a_fallback(fa, tmp_path, capsys):
    if torch.cuda.is_available() and "cuda" in fa.info().get("backends", []):
        pytest.skip("a GPU and flash_nif's CUDA backend are present: see test_cuda_loss_curve_matches_the_numpy_cpu_run")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--framework", "torch", "--device", "cuda", "--steps", "1", "--out", str(out)])
    assert exc.value.code == 2
    assert "--device cuda" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
def test_cuda_loss_curve_matches_the_numpy_cpu_run(fa):
    """--framework torch --device cuda: our CUDA kernels in true float32 and cuBLAS float32 (TF32
    off, torch's default for matmuls) against the NumPy run on the CPU."""
    if not torch.cuda.is_available() or "cuda" not in fa.info().get("backends", []):
        pytest.skip("needs a GPU and flash_nif's CUDA backend")
    assert not torch.backends.cuda.matmul.allow_tf32
    a = loss_curve(trainer("numpy", CURVE_CONFIG), CURVE_STEPS)
    gpu = trainer("torch", CURVE_CONFIG, device="cuda")
    assert gpu.params["embed"].is_cuda
    b = loss_curve(gpu, CURVE_STEPS)
    assert max_rel_diff(a, b) <= CURVE_TOL, np.abs(a - b) / a
