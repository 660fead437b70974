"""Generalization and sharpness of base / SAM / GSAM on scikit-learn digits with noisy labels.

The demo's MLP on the demo's digits split, AdamW with warmup and cosine decay,
every contender at its tuned values, several seeds per label-noise level (0, 20
and 40% of the training labels replaced by a wrong class). Reported per contender:
test accuracy, the share of corrupted labels the model fitted, and on the full
training set (noisy labels) the final loss, the top Hessian eigenvalue and the
surrogate gap at one fixed rho. Tables and what they say: benchmarks/README.md.

    python benchmarks/generalization.py           # full: 6 seeds, 60 epochs (~4 min, 2 cores)
    python benchmarks/generalization.py --quick   # 2 seeds, 20 epochs (about a minute)
    python benchmarks/generalization.py --tune    # the validation sweep behind DEFAULTS

Writes ``results/generalization[_quick].json`` and a PNG (``--tune``:
``results/generalization_tune.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import optax_gsam
from optax_gsam import demo

import harness
from harness import Contender
from harness import before_base

TASK = harness.Task("digits", demo.MLP(), demo.load_digits, (0.0, 0.2, 0.4), 64, 60)
GAP_RHO = 0.1  # the fixed radius of the surrogate-gap measurement, for every optimizer
POWER_ITERATIONS = 50
CONTENDERS: dict[str, Contender] = {
  **harness.CONTENDERS,
  "gsam k=5": Contender(
    before_base(lambda hp: optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=5)), "gsam"
  ),
}
# The validation sweep (--tune): the base lr, then each key's rho and alpha grids at that lr.
TUNE_NOISE, TUNE_EPOCHS, TUNE_SEEDS = 0.2, 40, 4
LR_GRID = (1e-3, 2e-3, 5e-3)
RHO_GRID = (0.05, 0.1, 0.2, 0.4)
ALPHA_GRID = (0.1, 0.3, 0.6)
GRIDS = {
  "sam": (RHO_GRID, (0.0,)),
  "gsam": (RHO_GRID, ALPHA_GRID),
  "gsam-lr": (RHO_GRID, ALPHA_GRID),
}
# Chosen with --tune (generalization_tune.json).
DEFAULTS: dict[str, dict[str, float]] = {
  "base": {"lr": 1e-3, "rho": 0.0, "alpha": 0.0},
  "sam": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  "gsam": {"lr": 1e-3, "rho": 0.2, "alpha": 0.3},
  "gsam-lr": {"lr": 1e-3, "rho": 0.4, "alpha": 0.1},
}
METRICS = ("accuracy", "noise_fitted", "train_loss", "lambda_max", "gap")


def top_hessian_eigenvalue(
  loss_fn: Callable, params: Any, key: jax.Array, iterations: int
) -> jax.Array:
  """Power iteration on Hessian-vector products (forward-over-reverse)."""
  flat, unravel = ravel_pytree(params)

  def hvp(v):
    return ravel_pytree(jax.jvp(jax.grad(loss_fn), (params,), (unravel(v),))[1])[0]

  def body(_, v):
    w = hvp(v)
    return w / (jnp.linalg.norm(w) + 1e-30)

  v0 = jax.random.normal(key, flat.shape, flat.dtype)
  v = jax.lax.fori_loop(0, iterations, body, v0 / jnp.linalg.norm(v0))
  return jnp.vdot(v, hvp(v))


def surrogate_gap(loss_fn: Callable, params: Any, rho: float) -> jax.Array:
  """:math:`f(w + \\rho g / \\|g\\|) - f(w)` with the full-batch gradient ``g``."""
  loss, grads = jax.value_and_grad(loss_fn)(params)
  scale = rho / (optax.tree.norm(grads) + 1e-12)
  return loss_fn(jax.tree.map(lambda w, g: w + scale * g, params, grads)) - loss


def sharpness(full_loss: Callable, params: Any, key: jax.Array) -> dict[str, jax.Array]:
  """Measured after training on the full training set with its (noisy) labels."""
  return {
    "lambda_max": top_hessian_eigenvalue(full_loss, params, key, POWER_ITERATIONS),
    "gap": surrogate_gap(full_loss, params, GAP_RHO),
  }


def summarize(results: dict[str, list[tuple[harness.Run, dict]]]) -> list[dict]:
  """Mean and std over seeds per (noise level, contender), and the mean accuracy curves."""
  rows = []
  for noise in sorted({run.noise for pairs in results.values() for run, _ in pairs}):
    for name, pairs in results.items():
      metrics = [m for run, m in pairs if run.noise == noise]
      row: dict[str, Any] = {"noise": noise, "contender": name, "seeds": len(metrics)}
      for key in (*METRICS, "accuracy_curve"):
        values = np.array([m[key] for m in metrics], dtype=np.float64)
        row[f"{key}_mean"], row[f"{key}_std"] = values.mean(0).tolist(), values.std(0).tolist()
      row["values"] = {key: [m[key] for m in metrics] for key in METRICS}
      rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  header = ("noise", "optimizer", "test acc %", "noise fitted %", "train loss", "lambda_max")
  cells = [(*header, f"gap@rho={GAP_RHO}")]
  for r in rows:
    pm = lambda key, scale=1.0, digits=2, r=r: harness.mean_std(r["values"][key], scale, digits)
    cells.append(
      (
        f"{100 * r['noise']:.0f}%",
        r["contender"],
        pm("accuracy", 100),
        "-" if r["noise"] == 0 else pm("noise_fitted", 100, 1),
        pm("train_loss", digits=3),
        pm("lambda_max", digits=1),
        pm("gap", digits=4),
      )
    )
  return harness.render_table(cells)


def plot(rows: list[dict], path: Path) -> None:
  """Test accuracy per noise level (bars, ± std) and test-accuracy curves at the highest noise."""
  noises = sorted({r["noise"] for r in rows})
  names = list(dict.fromkeys(r["contender"] for r in rows))
  fig, (bars, curves) = harness.figure(1, 2, figsize=(10, 3.8))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    sel = [next(r for r in rows if r["noise"] == n and r["contender"] == name) for n in noises]
    mean = [100 * r["accuracy_mean"] for r in sel]
    std = [100 * r["accuracy_std"] for r in sel]
    bars.bar(np.arange(len(noises)) + i * width, mean, width, yerr=std, capsize=3, label=name)
    mean, std = (100 * np.array(sel[-1][f"accuracy_curve_{k}"]) for k in ("mean", "std"))
    epochs = np.arange(1, len(mean) + 1)
    curves.plot(epochs, mean, label=name)
    curves.fill_between(epochs, mean - std, mean + std, alpha=0.2)
  low = min(100 * (r["accuracy_mean"] - r["accuracy_std"]) for r in rows)
  bars.set_ylim(max(0, low - 3), 100)
  bars.set_xticks(np.arange(len(noises)) + width * (len(names) - 1) / 2)
  bars.set_xticklabels([f"{100 * n:.0f}% noise" for n in noises])
  bars.set_ylabel("test accuracy % (mean ± std over seeds)")
  bars.legend(fontsize=8)
  curves.set(xlabel="epoch", ylabel="test accuracy %", ylim=(max(0, low - 10), 100))
  curves.set_title(f"{100 * noises[-1]:.0f}% label noise")
  curves.legend(fontsize=8)
  harness.save_figure(fig, path)


def tune(args, argv) -> dict:
  """The sweep behind :data:`DEFAULTS`, on a validation split at :data:`TUNE_NOISE` label noise."""
  task = dataclasses.replace(TASK, noise_levels=(TUNE_NOISE,), epochs=args.epochs or TUNE_EPOCHS)
  seeds = args.seeds or TUNE_SEEDS
  keys = {
    "base",
    *(c.hparams for n, c in CONTENDERS.items() if n in (args.contenders or CONTENDERS)),
  }
  tuned_with = {key: CONTENDERS[key] for key in keys}
  grids = {key: grid for key, grid in GRIDS.items() if key in keys}
  chosen, sweep = harness.tune(task, tuned_with, LR_GRID, grids, seeds=seeds)
  print(f"best: {chosen[TUNE_NOISE]}")
  result = {"noise": TUNE_NOISE, "epochs": task.epochs, "seeds": seeds, "sweep": sweep}
  return harness.save(
    "generalization_tune", "full", {**result, "best": chosen[TUNE_NOISE]}, args.out_dir, argv
  )


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the table, writes JSON (and a PNG unless ``--no-plot``)."""
  parser = harness.parser(__doc__, CONTENDERS)
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--noise", type=float, nargs="*", default=list(TASK.noise_levels))
  parser.add_argument("--tune", action="store_true", help="run the hyperparameter sweep instead")
  args = parser.parse_args(argv)
  if args.tune:
    return tune(args, argv)
  mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 6)
  task = dataclasses.replace(TASK, epochs=args.epochs or (20 if args.quick else TASK.epochs))
  contenders = {n: c for n, c in CONTENDERS.items() if not args.contenders or n in args.contenders}
  hparams = {name: DEFAULTS[c.hparams] for name, c in contenders.items()}
  print(
    f"digits, noise {args.noise}, {seeds} seeds, {task.epochs} epochs of batch {task.batch_size}, AdamW + warmup/cosine; {hparams}"
  )
  start = time.perf_counter()
  results: dict[str, list[tuple[harness.Run, dict]]] = {}
  for name, contender in contenders.items():
    hp = hparams[name]
    runs = [
      harness.Run(n, s, hp["lr"], hp["rho"], hp["alpha"]) for n in args.noise for s in range(seeds)
    ]
    out, _ = harness.run_batch(
      contender, task, runs, validation=False, curves=True, final_metrics=sharpness
    )
    results[name] = list(zip(runs, out, strict=True))
  rows = summarize(results)
  print(format_table(rows))
  seconds = time.perf_counter() - start
  print(
    f"lambda_max and gap: full training set, training (noisy) labels; gap at rho={GAP_RHO} for every optimizer. {seconds:.0f} s."
  )
  result = {
    "seconds": seconds,
    "seeds": seeds,
    "epochs": task.epochs,
    "batch_size": task.batch_size,
    "hparams": hparams,
    "gap_rho": GAP_RHO,
    "sharpness_labels": "training labels (noisy)",
    "rows": rows,
  }
  draw = None if args.no_plot else functools.partial(plot, rows)
  return harness.save("generalization", mode, result, args.out_dir, argv, draw)


if __name__ == "__main__":
  main()
