"""Generalization and sharpness of base / SAM / GSAM on scikit-learn digits with noisy labels.

The demo's MLP on the demo's digits split, AdamW with warmup and cosine decay,
every contender at its tuned values, several seeds per label-noise level (0, 20
and 40% of the training labels replaced by a wrong class). Reported per contender:
test accuracy, the share of corrupted labels the model fitted, and on the full
training set (noisy labels) the final loss and the sharpness, measured with
optax_gsam's measures: the top Hessian eigenvalue (Lanczos), the Hessian trace
(Hutchinson), worst-case m-sharpness, adaptive sharpness, the surrogate gap at one
fixed rho, and the spectral density (SLQ); and the top eigenvalue during training,
every TRACK_EVERY epochs, with what tracking it costs. Tables and what they say:
benchmarks/README.md.

    python -m benchmarks.science.generalization           # full: 6 seeds, 60 epochs
    python -m benchmarks.science.generalization --quick   # 2 seeds, 20 epochs
    python -m benchmarks.science.generalization --tune    # the validation sweep behind DEFAULTS
    python -m benchmarks.science.generalization --cost    # only what tracking lambda_max costs
    python -m benchmarks.science.generalization --norm    # SAM-ON: base, SAM, SAM-ON on NormMLP

Writes ``results/generalization[_quick].json`` and two PNGs, ``generalization[_quick].png``
(accuracy) and ``generalization[_quick]_sharpness.png`` (lambda_max over training and the final
spectral densities); ``--tune``: ``results/generalization_tune.json``; ``--cost``:
``results/generalization_cost.json``; ``--norm`` adds ``_ln`` to the names.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import optax_gsam
from optax_gsam import demo

from benchmarks import harness
from benchmarks import tuning
from benchmarks.harness import Contender
from benchmarks.harness import before_base
from benchmarks.models import NormMLP
from benchmarks.science.pareto_contenders import TRAJECTORY_GRIDS

TASK = harness.Task("digits", demo.MLP(), demo.load_digits, (0.0, 0.2, 0.4), 64, 60)
NORM_TASK = dataclasses.replace(TASK, name="digits-ln", model=NormMLP())  # --norm
# The sharpness measured after training, on the full training set with its (noisy) labels.
GAP_RHO = 0.1  # the fixed radius of the surrogate gap and of m-sharpness, for every optimizer
LANCZOS_ITERATIONS = 20  # Hessian-vector products for lambda_max
TRACE_PROBES = 10  # Hutchinson probes per run (the seeds average them further)
M = 64  # m of m-sharpness: the training batch size
ASCENT_STEPS = 5  # projected ascent steps per group of m examples
ADAPTIVE_RHO = 0.5  # the radius of adaptive sharpness, relative to |w| (ASAM's CIFAR value)
DENSITY_ITERATIONS = 30  # Lanczos steps of the spectral density (one probe per run)
# lambda_max during training: every TRACK_EVERY epochs, TRACK_ITERATIONS products.
TRACK_EVERY, TRACK_ITERATIONS = 10, 8
COST_ROUNDS = 3  # base is timed this many times with and without tracking, interleaved
CONTENDERS: dict[str, Contender] = {
  **harness.CONTENDERS,
  "gsam k=5": Contender(
    before_base(lambda hp: optax_gsam.gsam(hp.rho, hp.alpha, policy=optax_gsam.every_k_policy(5))),
    "gsam",
  ),
  # Ascent directions, each at the paper's default and its own tuned rho.
  "friendly-sam": Contender(
    before_base(lambda hp: optax_gsam.sam(hp.rho, ascent=optax_gsam.friendly_ascent())),
    "friendly-sam",
  ),
  "vasso": Contender(
    before_base(lambda hp: optax_gsam.sam(hp.rho, ascent=optax_gsam.vasso_ascent())), "vasso"
  ),
  "sam 2-step": Contender(
    before_base(lambda hp: optax_gsam.sam(hp.rho, ascent_steps=2)), "sam 2-step"
  ),
  # LookSAM's per-layer rescaling of the reused direction, at GSAM's values.
  "gsam k=5 per-layer": Contender(
    before_base(
      lambda hp: optax_gsam.gsam(
        hp.rho, hp.alpha, policy=optax_gsam.every_k_policy(5, reuse_scale="per_leaf")
      )
    ),
    "gsam",
  ),
  # SAM-ON perturbs the LayerNorms only: --norm trains every contender on NormMLP.
  "sam-on": Contender(
    before_base(lambda hp: optax_gsam.sam(hp.rho, mask=harness.norm_layers)), "sam-on"
  ),
  # SAF and MESA (the rho slot is lambda, MESA's alpha its EMA decay): --contenders saf mesa.
  **harness.TRAJECTORY_CONTENDERS,
}
# What --norm trains (NormMLP: the MLP with a LayerNorm per hidden layer), and the default run.
NORM_CONTENDERS = ("base", "sam", "sam-on")
DEFAULT_CONTENDERS = tuple(
  name for name in CONTENDERS if name != "sam-on" and name not in harness.TRAJECTORY_CONTENDERS
)
# The validation sweep (--tune): the base lr, then each key's rho and alpha grids at that lr.
TUNE_NOISE, TUNE_EPOCHS, TUNE_SEEDS = 0.2, 40, 4
LR_GRID = (1e-3, 2e-3, 5e-3)
RHO_GRID = (0.05, 0.1, 0.2, 0.4)
ALPHA_GRID = (0.1, 0.3, 0.6)
GRIDS = {
  "sam": (RHO_GRID, (0.0,)),
  "gsam": (RHO_GRID, ALPHA_GRID),
  "gsam-lr": (RHO_GRID, ALPHA_GRID),
  "friendly-sam": (RHO_GRID, (0.0,)),
  "vasso": (RHO_GRID, (0.0,)),
  "sam 2-step": (RHO_GRID, (0.0,)),
  **TRAJECTORY_GRIDS,  # pareto.py's: SAF's lambda, MESA's decay
}
# --norm's sweep tunes each key's learning rate and rho together (tuning.tune(joint=True)), 4 x 4
# points, the base 16 learning rates: tuning the base's rate first, then rho at it, left every
# key on a grid edge (the base's rate fell from 1e-3 to 1.25e-4 over three sweeps, and SAM-ON's
# best rho moved with it, from 4 to 2). SAM-ON moves the 1024 LayerNorm parameters alone: its
# radii are ten times SAM's.
NORM_LR_GRID = (1.25e-4, 2.5e-4, 5e-4, 1e-3)
NORM_GRIDS = {"sam": ((0.1, 0.2, 0.4, 0.8), (0.0,)), "sam-on": ((1.0, 2.0, 4.0, 8.0), (0.0,))}
# Chosen with --tune (generalization_tune.json).
DEFAULTS: dict[str, dict[str, float]] = {
  "base": {"lr": 1e-3, "rho": 0.0, "alpha": 0.0},
  "sam": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  "gsam": {"lr": 1e-3, "rho": 0.2, "alpha": 0.3},
  "gsam-lr": {"lr": 1e-3, "rho": 0.4, "alpha": 0.1},
  # --tune --contenders friendly-sam vasso "sam 2-step" (validation accuracy 76.3 to 76.6%)
  "friendly-sam": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  "vasso": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  "sam 2-step": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  # --tune --contenders saf mesa (generalization_tune_trajectory.json; validation accuracy
  # 75.95% and 76.48%): SAF's lambda 1, MESA's decay 0.995 at the authors' lambda 0.8.
  "saf": {"lr": 1e-3, "rho": 1.0, "alpha": 0.0},
  "mesa": {"lr": 1e-3, "rho": 0.8, "alpha": 0.995},
}
# --norm: chosen with --tune --norm (generalization_tune_ln.json; the base's rate is the grid's
# lowest, tied with the next two at 76.22% validation accuracy).
NORM_DEFAULTS: dict[str, dict[str, float]] = {
  "base": {"lr": 1.25e-4, "rho": 0.0, "alpha": 0.0},
  "sam": {"lr": 2.5e-4, "rho": 0.2, "alpha": 0.0},
  "sam-on": {"lr": 5e-4, "rho": 4.0, "alpha": 0.0},
}
METRICS = (
  "accuracy",
  "noise_fitted",
  "train_loss",
  "lambda_max",
  "trace",
  "m_sharpness",
  "adaptive_sharpness",
  "gap",
)


def sharpness(loss_fn: Callable, params: Any, key: jax.Array, train_set: Any) -> dict[str, Any]:
  """Measured after training on the full training set with its (noisy) labels."""
  eig_key, trace_key, density_key = jax.random.split(key, 3)
  measure = functools.partial(optax_gsam.m_sharpness, loss_fn, params, rho=GAP_RHO)
  # m-sharpness: the first M * (n // M) examples in groups of M.
  groups = jax.tree.map(lambda a: a[: len(a) - len(a) % M], train_set)
  density = optax_gsam.hessian_spectral_density(
    loss_fn, params, train_set, density_key, num_probes=1, num_iterations=DENSITY_ITERATIONS
  )
  eigenvalues = optax_gsam.hessian_eigenvalues(
    loss_fn, params, train_set, eig_key, num_iterations=LANCZOS_ITERATIONS
  )
  trace = optax_gsam.hessian_trace(loss_fn, params, train_set, trace_key, num_probes=TRACE_PROBES)
  return {
    "lambda_max": eigenvalues[0],
    "trace": trace.trace,
    "m_sharpness": measure(groups, m=M, ascent_steps=ASCENT_STEPS),
    "adaptive_sharpness": optax_gsam.m_sharpness(
      loss_fn, params, train_set, rho=ADAPTIVE_RHO, ascent_steps=ASCENT_STEPS, adaptive=True
    ),
    "gap": measure(train_set, ascent_steps=1),  # f(w + rho g / ||g||) - f(w)
    "density_eigenvalues": density.eigenvalues[0],
    "density_weights": density.weights[0],
  }


def track(loss_fn: Callable, params: Any, key: jax.Array, train_set: Any) -> dict[str, jax.Array]:
  """lambda_max during training (fewer products than the final one)."""
  top = optax_gsam.hessian_eigenvalues(
    loss_fn, params, train_set, key, num_iterations=TRACK_ITERATIONS
  )
  return {"lambda_max": top[0]}


def summarize(results: dict[str, list[tuple[harness.Run, dict]]]) -> list[dict]:
  """Mean and std over seeds per (noise level, contender), the mean curves and the densities."""
  rows = []
  for noise in sorted({run.noise for pairs in results.values() for run, _ in pairs}):
    for name, pairs in results.items():
      metrics = [m for run, m in pairs if run.noise == noise]
      row: dict[str, Any] = {"noise": noise, "contender": name, "seeds": len(metrics)}
      for key in (*METRICS, "accuracy_curve", "lambda_max_track"):
        values = np.array([m[key] for m in metrics], dtype=np.float64)
        for stat in ("mean", "std"):  # epochs not measured: None (JSON null), not NaN
          value = getattr(values, stat)(0)
          row[f"{key}_{stat}"] = np.where(np.isnan(value), None, value).tolist()
      row["values"] = {key: [m[key] for m in metrics] for key in METRICS}
      row["density"] = {k: [m[f"density_{k}"] for m in metrics] for k in ("eigenvalues", "weights")}
      rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  header = ("noise", "optimizer", "test acc %", "noise fitted %", "train loss", "lambda_max")
  cells = [(*header, "trace", f"m-sharp m={M}", "adaptive", f"gap@rho={GAP_RHO}")]
  for r in rows:
    pm = lambda key, scale=1.0, digits=2, r=r: harness.mean_std(r["values"][key], scale, digits)
    cells.append(
      (
        f"{100 * r['noise']:.0f}%",
        r["contender"],
        pm("accuracy", 100),
        "-" if r["noise"] == 0 else pm("noise_fitted", 100, 1),
        pm("train_loss", digits=3),
        pm("lambda_max", digits=2),
        pm("trace", digits=1),
        pm("m_sharpness", digits=4),
        pm("adaptive_sharpness", digits=4),
        pm("gap", digits=4),
      )
    )
  return harness.render_table(cells)


def plot(rows: list[dict], path: Path) -> None:
  """Test accuracy per noise level (bars, ± std) and test-accuracy curves at the highest noise.

  Also ``<stem>_sharpness.png``: lambda_max over training and the final spectral densities.
  """
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
  plot_sharpness(rows, noises, names, path.with_name(f"{path.stem}_sharpness.png"))


def plot_sharpness(rows: list[dict], noises: list, names: list, path: Path) -> None:
  """Per noise level: lambda_max over training (mean ± std) and the final SLQ densities."""
  fig, axes = harness.figure(2, len(noises), figsize=(4 * len(noises), 7), squeeze=False)
  for column, noise in enumerate(noises):
    top, density = axes[0, column], axes[1, column]
    sel = {n: next(r for r in rows if r["noise"] == noise and r["contender"] == n) for n in names}
    nodes = np.concatenate([np.ravel(r["density"]["eigenvalues"]) for r in sel.values()])
    grid = np.linspace(nodes.min(), nodes.max(), 400)
    sigma = (nodes.max() - nodes.min()) / 200
    for name, r in sel.items():
      mean, std = (np.array(r[f"lambda_max_track_{k}"], np.float64) for k in ("mean", "std"))
      epochs = np.flatnonzero(np.isfinite(mean)) + 1
      top.errorbar(epochs, mean[epochs - 1], std[epochs - 1], marker="o", ms=3, label=name)
      slq = optax_gsam.SpectralDensity(
        *(np.array(r["density"][k]) for k in ("eigenvalues", "weights"))
      )
      density.semilogy(grid, np.maximum(np.asarray(slq.smoothed(grid, sigma)), 1e-6), label=name)
    top.set(yscale="log", xlabel="epoch", ylabel="lambda_max (training set)")
    top.set_title(f"{100 * noise:.0f}% label noise")
    density.set(
      xlabel="Hessian eigenvalue", ylabel="density (SLQ, seeds pooled)", ylim=(1e-6, None)
    )
  axes[0, 0].legend(fontsize=8)
  harness.save_figure(fig, path)


def contender_names(args) -> tuple[str, ...]:
  """``--contenders``, or the default set; ``--norm`` has its own set and values."""
  if not args.norm:
    return tuple(args.contenders or DEFAULT_CONTENDERS)
  names = tuple(args.contenders or NORM_CONTENDERS)
  if set(names) - set(NORM_CONTENDERS):
    raise SystemExit(f"--norm trains {NORM_CONTENDERS} only, got {names}")
  return names


def tune(args, argv) -> dict:
  """The sweep behind :data:`DEFAULTS`, on a validation split at :data:`TUNE_NOISE` label noise."""
  task = NORM_TASK if args.norm else TASK
  task = dataclasses.replace(task, noise_levels=(TUNE_NOISE,), epochs=args.epochs or TUNE_EPOCHS)
  seeds = args.seeds or TUNE_SEEDS
  names = contender_names(args)
  keys = {"base", *(c.hparams for n, c in CONTENDERS.items() if n in names)}
  tuned_with = {key: CONTENDERS[key] for key in keys}
  grids = {key: grid for key, grid in (NORM_GRIDS if args.norm else GRIDS).items() if key in keys}
  lr_grid = NORM_LR_GRID if args.norm else LR_GRID
  chosen, sweep = tuning.tune(task, tuned_with, lr_grid, grids, seeds=seeds, joint=args.norm)
  print(f"best: {chosen[TUNE_NOISE]}")
  result = {"noise": TUNE_NOISE, "epochs": task.epochs, "seeds": seeds, "sweep": sweep}
  result = {**result, "model": task.model.__class__.__name__, "best": chosen[TUNE_NOISE]}
  suffix = "_ln" if args.norm else ""
  return harness.save("generalization_tune", "full", result, args.out_dir, argv, suffix=suffix)


def tracking_cost(task: harness.Task, runs: list[harness.Run], every: int) -> dict:
  """The share of training time that tracking lambda_max takes, on the cheapest contender.

  The base optimizer's training of ``runs`` is compiled with and without tracking (no
  final measurements in either) and the two programs run in turn, ``COST_ROUNDS`` times
  each, alternating which goes first; the share is the median of the paired ratios
  minus 1, so a change in the machine's load between rounds cancels.
  """
  x_train, x_eval, inputs = harness.batch_inputs(task, runs, validation=False)
  programs = {}
  for tracked in (True, False):
    train, _ = harness.make_train(
      CONTENDERS["base"], task, x_train, x_eval, track=track if tracked else None, track_every=every
    )
    programs[tracked] = train.lower(*inputs).compile()
  seconds: dict[bool, list[float]] = {True: [], False: []}
  for i in range(COST_ROUNDS):
    for tracked in (True, False) if i % 2 == 0 else (False, True):
      start = time.perf_counter()
      jax.block_until_ready(programs[tracked](*inputs))
      seconds[tracked].append(time.perf_counter() - start)
  ratios = np.array(seconds[True]) / np.array(seconds[False])
  share = float(np.median(ratios) - 1)
  print(
    f"tracking lambda_max every {every} epochs ({TRACK_ITERATIONS} products): "
    f"{100 * share:.1f}% of base training time (median of {COST_ROUNDS} paired ratios "
    f"{np.round(ratios, 3).tolist()}; {len(runs)} runs of {task.epochs} epochs)"
  )
  return {
    "contender": "base",
    "track_every_epochs": every,
    "runs": len(runs),
    "epochs": task.epochs,
    "seconds_tracked": seconds[True],
    "seconds_untracked": seconds[False],
    "share": share,
  }


def cost_only(args, argv) -> dict:
  """``--cost``: the tracking cost alone, on the base optimizer's runs at the last noise level."""
  task = dataclasses.replace(TASK, epochs=args.epochs or TASK.epochs)
  hp = DEFAULTS["base"]
  runs = [harness.Run(args.noise[-1], s, hp["lr"], 0.0) for s in range(args.seeds or 6)]
  result = tracking_cost(task, runs, args.track_every)
  return harness.save("generalization_cost", "full", result, args.out_dir, argv)


def parse_args(argv: list[str] | None):
  parser = harness.parser(__doc__, CONTENDERS)
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--noise", type=float, nargs="*", default=list(TASK.noise_levels))
  parser.add_argument("--tune", action="store_true", help="run the hyperparameter sweep instead")
  parser.add_argument("--track-every", type=int, default=TRACK_EVERY, help="epochs per lambda_max")
  parser.add_argument("--cost", action="store_true", help="only measure what tracking costs")
  parser.add_argument(
    "--norm",
    action="store_true",
    help="train NormMLP (a LayerNorm per hidden layer) with NORM_CONTENDERS, for SAM-ON",
  )
  return parser.parse_args(argv)


def train_all(task, contenders, hparams, runs_of, track_every) -> tuple[list[dict], dict]:
  """Trains each contender's runs together (vmapped); the rows and each contender's timings."""
  results: dict[str, list[tuple[harness.Run, dict]]] = {}
  timings: dict[str, dict] = {}
  for name, contender in contenders.items():
    runs = runs_of(hparams[name])
    timings[name] = {}
    out, _ = harness.run_batch(
      contender,
      task,
      runs,
      validation=False,
      curves=True,
      final_metrics=sharpness,
      track=track,
      track_every=track_every,
      timings=timings[name],
    )
    results[name] = list(zip(runs, out, strict=True))
  return summarize(results), timings


def sharpness_settings(track_every: int) -> dict:
  """How the sharpness columns and the tracked lambda_max were measured."""
  return {
    "lanczos_iterations": LANCZOS_ITERATIONS,
    "trace_probes": TRACE_PROBES,
    "m": M,
    "ascent_steps": ASCENT_STEPS,
    "adaptive_rho": ADAPTIVE_RHO,
    "density_iterations": DENSITY_ITERATIONS,
    "track_every_epochs": track_every,
    "track_iterations": TRACK_ITERATIONS,
  }


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the table, writes JSON (and a PNG unless ``--no-plot``)."""
  args = parse_args(argv)
  if args.tune:
    return tune(args, argv)
  if args.cost:
    return cost_only(args, argv)
  mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 6)
  task = NORM_TASK if args.norm else TASK
  task = dataclasses.replace(task, epochs=args.epochs or (20 if args.quick else TASK.epochs))
  names = contender_names(args)
  contenders = {n: c for n, c in CONTENDERS.items() if n in names}
  defaults = NORM_DEFAULTS if args.norm else DEFAULTS
  hparams = {name: defaults[c.hparams] for name, c in contenders.items()}
  print(
    f"{task.name} ({task.model.__class__.__name__}), noise {args.noise}, {seeds} seeds, {task.epochs} epochs of batch {task.batch_size}, AdamW + warmup/cosine; {hparams}"
  )
  start = time.perf_counter()
  runs_of = lambda hp: [
    harness.Run(n, s, hp["lr"], hp["rho"], hp["alpha"]) for n in args.noise for s in range(seeds)
  ]
  rows, timings = train_all(task, contenders, hparams, runs_of, args.track_every)
  print(format_table(rows))
  cost = {}
  if "base" in contenders:
    cost_runs = [r for r in runs_of(defaults["base"]) if r.noise == args.noise[-1]]
    cost = tracking_cost(task, cost_runs, args.track_every)
  seconds = time.perf_counter() - start
  print(
    f"Sharpness: full training set, training (noisy) labels; lambda_max by Lanczos "
    f"({LANCZOS_ITERATIONS} products), trace by Hutchinson ({TRACE_PROBES} probes), m-sharpness "
    f"(rho={GAP_RHO}) and adaptive sharpness (rho={ADAPTIVE_RHO}) by {ASCENT_STEPS} ascent "
    f"steps, gap = one step at rho={GAP_RHO}. {seconds:.0f} s."
  )
  result = {
    "seconds": seconds,
    "seeds": seeds,
    "epochs": task.epochs,
    "batch_size": task.batch_size,
    "model": task.model.__class__.__name__,
    "hparams": hparams,
    "gap_rho": GAP_RHO,
    "sharpness_labels": "training labels (noisy)",
    "sharpness_settings": sharpness_settings(args.track_every),
    "timings": timings,
    "tracking_cost": cost,
    "rows": rows,
  }
  draw = None if args.no_plot else functools.partial(plot, rows)
  suffix = "_ln" if args.norm else ""
  return harness.save("generalization", mode, result, args.out_dir, argv, draw, suffix=suffix)


if __name__ == "__main__":
  main()
