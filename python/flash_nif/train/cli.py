"""`python -m flash_nif.train`: gradient check, training with a progress bar, eval, checkpoints,
summary.json and loss.png. See `python -m flash_nif.train --help`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from . import checkpoint
from .backend import FRAMEWORKS, SetupError, get_attention, get_device
from .gradcheck import DEFAULT_TOL, grad_check, tiny_config
from .plot import plot_curves
from .trainer import TrainConfig, Trainer

PROG = "python -m flash_nif.train"

# Model/task/optimiser defaults. They default to None on the parser so that --resume can tell an
# explicit value (checked against the checkpoint) from an omitted one (taken from the checkpoint).
DEFAULTS = dict(steps=1000, layers=2, heads=4, kv_heads=2, dim=64, seq=32, batch=64, lr=1e-3, seed=0,
                weight_decay=0.1, clip=1.0, warmup=50, num_keys=16, num_values=16,
                eval_every=50, eval_batches=8, ckpt_every=100)


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


def _float_range(lo: float, *, inclusive: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not np.isfinite(value) or value < lo or (not inclusive and value == lo):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo}, got {text}")
        return value
    return parse


class _HelpFormatter(argparse.HelpFormatter):
    """Shows parser-level defaults; the None defaults spell out DEFAULTS in their help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a small decoder-only transformer on associative recall with a hand-written "
                    "backward pass stitched to flash_nif's attention forward_with_states/backward "
                    "(or, with --framework torch, the same model in torch with flash_nif.torch.attention). "
                    "A whole-model gradient check runs first.",
        formatter_class=_HelpFormatter,
    )
    pos, nonneg = _int_at_least(1), _int_at_least(0)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=pos, help=f"total optimiser steps (with --resume: the new total) "
                                             f"(default: {d['steps']})")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: NumPy arrays; cuda: CuPy arrays and flash_nif's GPU backend (no fallback)")
    g.add_argument("--framework", choices=FRAMEWORKS, default="numpy",
                   help="numpy: every layer's backward by hand, stitched to flash_nif's forward/backward "
                        "(NumPy or CuPy); torch: the same model as torch modules, flash_nif.torch.attention "
                        "for attention and torch autograd for the rest (torch tensors on --device)")
    g.add_argument("--seed", type=nonneg, help=f"seeds the parameters, the data and the eval set (default: {d['seed']})")
    g.add_argument("--out", default="runs/train", metavar="DIR",
                   help="checkpoint.npz, summary.json and loss.png go here")
    g.add_argument("--resume", action="store_true",
                   help="continue DIR/checkpoint.npz exactly (config comes from the checkpoint)")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=pos, help=f"transformer blocks (default: {d['layers']})")
    g.add_argument("--heads", type=pos, help=f"query heads (default: {d['heads']})")
    g.add_argument("--kv-heads", type=pos, help=f"key/value heads; heads %% kv-heads == 0 (GQA) (default: {d['kv_heads']})")
    g.add_argument("--dim", type=pos, help=f"model width; dim/heads is the head dim (default: {d['dim']})")
    g = p.add_argument_group("task and optimiser")
    g.add_argument("--seq", type=pos, help=f"sequence length, a multiple of 4: seq/4 key-value pairs, "
                                           f"then seq/4 queries (default: {d['seq']})")
    g.add_argument("--batch", type=pos, help=f"sequences per step (default: {d['batch']})")
    g.add_argument("--lr", type=_float_range(0.0, inclusive=False), help=f"AdamW learning rate (default: {d['lr']})")
    g.add_argument("--weight-decay", type=_float_range(0.0, inclusive=True),
                   help=f"AdamW decoupled weight decay on projection matrices (default: {d['weight_decay']})")
    g.add_argument("--clip", type=_float_range(0.0, inclusive=True),
                   help=f"global gradient-norm clip, 0 = off (default: {d['clip']})")
    g.add_argument("--warmup", type=nonneg, help=f"linear learning-rate warmup steps (default: {d['warmup']})")
    g.add_argument("--num-keys", type=pos, help=f"key tokens in the vocabulary (default: {d['num_keys']})")
    g.add_argument("--num-values", type=pos, help=f"value tokens in the vocabulary (default: {d['num_values']})")
    g = p.add_argument_group("evaluation, checkpoints, checks")
    g.add_argument("--eval-every", type=pos, help=f"steps between held-out evaluations (default: {d['eval_every']})")
    g.add_argument("--eval-batches", type=pos, help=f"held-out batches of --batch sequences (default: {d['eval_batches']})")
    g.add_argument("--ckpt-every", type=pos, help=f"steps between checkpoints (default: {d['ckpt_every']})")
    g.add_argument("--attention", choices=("flash_nif", "reference"), default="flash_nif",
                   help="attention kernels for training: flash_nif's, or the float64 NumPy oracle "
                        "(CPU, slow; for development)")
    g.add_argument("--grad-check-tol", type=_float_range(0.0, inclusive=False), default=DEFAULT_TOL,
                   help="maximum relative error allowed in the gradient check")
    g.add_argument("--blas-threads", type=_int_at_least(0), default=1,
                   help="BLAS threads for the NumPy matmuls (needs threadpoolctl), or torch's intra-op "
                        "threads with --framework torch (0 = leave as is). One is fastest for these small "
                        "matrices on a busy 2-core machine")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is shown only when stderr is a terminal, so logs stay clean)")
    return p


def resolve_config(args, parser, ckpt_meta: dict | None) -> TrainConfig:
    """Defaults, or the checkpoint's values with --resume; explicit conflicting values are errors."""
    values = {}
    for key in DEFAULTS:
        given = getattr(args, key)
        if ckpt_meta is not None and key in TrainConfig.FIXED:
            stored = ckpt_meta["config"][key]
            if given is not None and given != stored:
                parser.error(f"--{key.replace('_', '-')} {given} conflicts with the checkpoint's "
                             f"{stored} (omit it with --resume)")
            values[key] = stored
        elif given is not None:
            values[key] = given
        elif ckpt_meta is not None and key in ckpt_meta["config"]:
            values[key] = ckpt_meta["config"][key]  # e.g. the planned --steps of an interrupted run
        else:
            values[key] = DEFAULTS[key]
    cfg = TrainConfig(**values)

    if cfg.heads % cfg.kv_heads:
        parser.error(f"--heads {cfg.heads} must be divisible by --kv-heads {cfg.kv_heads}")
    if cfg.dim % cfg.heads:
        parser.error(f"--dim {cfg.dim} must be divisible by --heads {cfg.heads}")
    if (cfg.dim // cfg.heads) % 2:
        parser.error(f"head dim --dim/--heads = {cfg.dim // cfg.heads} must be even (rotary positions)")
    if cfg.seq % 4:
        parser.error(f"--seq {cfg.seq} must be a multiple of 4 (seq/4 pairs, then seq/4 queries)")
    if cfg.seq // 4 > cfg.num_keys:
        parser.error(f"--seq {cfg.seq} needs {cfg.seq // 4} distinct keys per sequence, more than "
                     f"--num-keys {cfg.num_keys}")
    if ckpt_meta is not None and cfg.steps < ckpt_meta["step"]:
        parser.error(f"--steps {cfg.steps} is below the checkpoint's step {ckpt_meta['step']}")
    return cfg


class _TorchThreads:
    """torch's intra-op threads set for the run and restored after it (threadpoolctl's interface)."""

    def __init__(self, n: int):
        import torch

        self.torch, self.old = torch, torch.get_num_threads()
        torch.set_num_threads(n)

    def restore_original_limits(self):
        self.torch.set_num_threads(self.old)


class _Limits:
    def __init__(self, limits):
        self.limits = [limit for limit in limits if limit is not None]

    def restore_original_limits(self):
        for limit in reversed(self.limits):
            limit.restore_original_limits()


def limit_blas_threads(n: int, framework: str = "numpy"):
    """Cap the BLAS thread pool (small matmuls lose badly to thread hand-offs on a loaded CPU: the
    NumPy layers, and either framework's float64 gradient check); with torch, also torch's
    intra-op threads (its OpenMP workers, spinning between the small ops, starve flash_nif's own
    threads: 1,300 tokens/s with 2 on the busy 2-core machine, 46,000 with 1)."""
    if n <= 0:
        return None
    return _Limits([_blas_limits(n), _TorchThreads(n) if framework == "torch" else None])


def _blas_limits(n: int):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("note: threadpoolctl is not installed (pip install threadpoolctl), so BLAS keeps its default "
              "threads; on a busy 2-core CPU the small matmuls then run several times slower "
              "(OPENBLAS_NUM_THREADS=1 in the environment does the same job)", file=sys.stderr)
        return None
    return threadpool_limits(limits=n, user_api="blas")


def fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = args.out

    ckpt = None
    if args.resume:
        if not os.path.exists(checkpoint.path_in(out)):
            parser.error(f"--resume: no checkpoint at {checkpoint.path_in(out)}")
        try:
            ckpt = checkpoint.load(out)
        except Exception as exc:  # a damaged or foreign file
            parser.error(f"--resume: cannot read {checkpoint.path_in(out)}: {exc}")
        meta = ckpt.get("meta")
        needed = {"step", "adam_step", "data_rng", "config", "train_time", "tokens"}
        if not isinstance(meta, dict) or not needed <= meta.keys() or not isinstance(meta["config"], dict) \
                or not set(TrainConfig.FIXED) <= meta["config"].keys():
            parser.error(f"--resume: {checkpoint.path_in(out)} is not a flash_nif.train checkpoint")
    cfg = resolve_config(args, parser, ckpt["meta"] if ckpt else None)

    try:
        device = get_device(args.device, args.framework)
        attention = get_attention(args.attention, device)
    except SetupError as exc:
        parser.error(str(exc))

    limiter = limit_blas_threads(args.blas_threads if device.name == "cpu" else 0, device.framework)
    try:
        return run(args, cfg, device, attention, ckpt, started)
    finally:
        if limiter is not None:
            limiter.restore_original_limits()


def run(args, cfg: TrainConfig, device, attention, ckpt: dict | None, started: float) -> int:
    """Gradient check, training loop, summary.json and loss.png (after the command line is valid)."""
    out = args.out
    trainer = Trainer(cfg, device, attention)
    if ckpt is not None:
        try:
            trainer.load(ckpt)
        except (ValueError, KeyError) as exc:
            return fail(f"--resume: {exc}")
    mcfg, task = trainer.model_cfg, trainer.task
    say = print
    say(f"flash_nif.train: device {device.name}, framework {device.framework}, attention {attention.name}; "
        f"{mcfg.layers} layers, {mcfg.heads} heads / {mcfg.kv_heads} kv heads, dim {mcfg.dim} "
        f"(head dim {mcfg.head_dim}), {trainer.num_params():,} parameters")
    say(f"task: associative recall, seq {task.seq} = {task.num_pairs} key-value pairs + "
        f"{task.num_pairs} queries, {task.num_keys} keys, {task.num_values} values "
        f"(chance accuracy {task.chance_accuracy:.3f}); batch {cfg.batch}, lr {cfg.lr:g}")

    # ---- whole-model gradient check (every run, on the device and kernels that train)
    small, small_task = tiny_config(mcfg)
    try:
        gc = grad_check(small, small_task, attention, device, seed=cfg.seed)
    except Exception as exc:
        return fail(f"gradient check could not run: {type(exc).__name__}: {exc}")
    ok = gc.passed(args.grad_check_tol)
    say(f"gradient check ({gc.attention} {gc.dtype} vs float64 finite differences, "
        f"{small.layers} layers, dim {small.dim}, {gc.coords} coordinates of {len(gc.per_param)} "
        f"tensors): max rel err {gc.max_rel_err:.2e} in {gc.worst} (tol {args.grad_check_tol:g}) "
        f"{'ok' if ok else 'FAILED'}")
    if not ok:
        worst = sorted(gc.per_param.items(), key=lambda kv: -kv[1])[:5]
        return fail("gradient check failed: " + ", ".join(f"{k} {v:.2e}" for k, v in worst))

    if ckpt is not None:
        say(f"resumed {checkpoint.path_in(out)} at step {trainer.step}")
    elif os.path.exists(checkpoint.path_in(out)):
        say(f"note: starting afresh; {checkpoint.path_in(out)} will be overwritten (use --resume to continue it)")
    os.makedirs(out, exist_ok=True)

    # ---- training
    stop = {"flag": False}

    def on_sigint(signum, frame):
        if stop["flag"]:
            raise KeyboardInterrupt
        stop["flag"] = True

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        if trainer.step == 0:
            trainer.evaluate()  # the untrained model, for the curve
        bar = None
        tqdm = None
        if not args.no_progress:
            try:
                from tqdm import tqdm
            except ImportError:
                say("note: tqdm is not installed (pip install tqdm); no progress bar")
        if tqdm is not None:
            # disable=None: tqdm draws nothing when stderr is not a terminal (a log file, CI), so
            # redirected output holds the eval lines, not carriage-return redraws.
            bar = tqdm(total=cfg.steps, initial=trainer.step, desc="train", unit="step",
                       dynamic_ncols=True, mininterval=0.5, file=sys.stderr, disable=None)
        run_time, run_tokens = 0.0, 0
        while trainer.step < cfg.steps and not stop["flag"]:
            t0 = trainer.train_time
            loss, acc, gnorm = trainer.train_step()
            run_time += trainer.train_time - t0
            run_tokens += trainer.tokens_per_step
            if bar is not None:
                bar.set_postfix({"loss": f"{loss:.3f}", "acc": f"{acc:.3f}",
                                 "tok/s": f"{run_tokens / max(run_time, 1e-9):,.0f}"}, refresh=False)
                bar.update(1)
            if not np.isfinite(loss):
                if bar is not None:
                    bar.close()
                return fail(f"loss became {loss} at step {trainer.step}; try a lower --lr")
            if trainer.step % cfg.eval_every == 0 or trainer.step == cfg.steps:
                eloss, eacc = trainer.evaluate()
                msg = f"step {trainer.step:5d}: eval loss {eloss:.4f}  eval acc {eacc:.3f}  (train loss {loss:.4f})"
                (bar.write if bar is not None else say)(msg)
            if trainer.step % cfg.ckpt_every == 0:
                trainer.save(out)
        if bar is not None:
            bar.close()
    finally:
        signal.signal(signal.SIGINT, old_handler)

    if not trainer.history["eval_step"] or trainer.history["eval_step"][-1] != trainer.step:
        trainer.evaluate()
    trainer.save(out)
    if stop["flag"]:
        say(f"interrupted: checkpoint at step {trainer.step} in {checkpoint.path_in(out)}; "
            f"continue with --resume --out {out}")
        return 130

    # ---- summary and plot
    h = trainer.history
    summary = {
        "loss_first": h["train_loss"][0] if h["train_loss"] else None,
        "loss_last": h["train_loss"][-1] if h["train_loss"] else None,
        "eval_loss": h["eval_loss"][-1],
        "eval_accuracy": h["eval_acc"][-1],
        "eval_accuracy_first": h["eval_acc"][0],
        "chance_accuracy": task.chance_accuracy,
        "grad_check_max_rel_err": gc.max_rel_err,
        "grad_check": {"worst": gc.worst, "tol": args.grad_check_tol, "coordinates": gc.coords,
                       "attention": gc.attention, "dtype": gc.dtype, "model": gc.config},
        "steps": trainer.step,
        "tokens_per_s": trainer.tokens / trainer.train_time if trainer.train_time > 0 else None,
        "train_time_s": trainer.train_time,
        "wall_time_s": time.perf_counter() - started,
        "device": device.name,
        "framework": device.framework,
        "attention": attention.name,
        "config": trainer.config_dict(),
    }
    summary_path = os.path.join(out, "summary.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    try:
        png = plot_curves(h, os.path.join(out, "loss.png"), chance=task.chance_accuracy,
                          title=f"flash_nif.train: {mcfg.layers} layers, {mcfg.heads}/{mcfg.kv_heads} "
                                f"heads, dim {mcfg.dim}, seq {task.seq}, {trainer.step} steps ({device.name})")
    except ImportError as exc:
        say(f"note: no loss.png, matplotlib is not available (pip install matplotlib): {exc}")
        png = None
    def num(x, spec):
        return "n/a" if x is None else format(x, spec)

    say(f"done: {trainer.step} steps, loss {num(summary['loss_first'], '.4f')} -> "
        f"{num(summary['loss_last'], '.4f')}, held-out accuracy {summary['eval_accuracy']:.3f} "
        f"(chance {task.chance_accuracy:.3f}), {num(summary['tokens_per_s'], ',.0f')} tokens/s")
    say(f"wrote {', '.join(p for p in (summary_path, png, checkpoint.path_in(out)) if p)}")
    return 0
