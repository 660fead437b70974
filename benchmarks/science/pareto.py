"""Accuracy against step cost: cheap sharpness-aware policies vs SAM, GSAM and the base optimizer.

Every contender trains the same model for the same number of steps, over several
seeds, on scikit-learn digits (the demo's MLP) and on MNIST-1D made locally (a
small 1-D CNN), both with label noise; learning rate and rho are tuned on a
validation split. Each contender's step cost is its full and cheap steps, timed
against the base step in the same process, weighted by the full steps it took.
On step_cost.py's ViT-tiny it also times each policy's cheap step against a base
step. The contenders, protocol, targets and results are in benchmarks/README.md.

With ``--joint`` every contender's learning rate is tuned together with its rho
(3 x 3 points; the base gets 9 learning rates over the same range), on MNIST-1D
with LayerNorms (``mnist1d-ln``), for the directions (Friendly-SAM, VaSSO, 2-step,
SAM-ON) and the policies; it reports the share of SAM's gain over the base that
each contender keeps. ``--base sgd`` swaps AdamW for SGD with momentum. SAF and
MESA (``--contenders ... saf mesa``) tune their own knob with the learning rate
(``TRAJECTORY_GRIDS``, 3 x 3 too); they always tune (no defaults yet).

    python -m benchmarks.science.pareto                     # full: tuning, 5 seeds (~60 min, 2 cores)
    python -m benchmarks.science.pareto --quick             # smoke run: small MNIST-1D, 2 epochs, DEFAULTS
    python -m benchmarks.science.pareto --no-tune --seeds 3 # the full run without tuning
    python -m benchmarks.science.pareto --joint --base sgd --tune-seeds 2 --no-vit   # ~60 min, 2 cores

Writes ``results/pareto[_quick][_joint][_sgd].json`` (``rows``: base_optimizer,
dataset, noise, contender, acc_mean, acc_std, seeds, step_cost, base_steps, ...;
``gain_shares``) and a PNG.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import tuning
from benchmarks.harness import Contender
from benchmarks.models import ViT
from benchmarks.science.pareto_contenders import CONTENDERS
from benchmarks.science.pareto_contenders import DEFAULT_CONTENDERS
from benchmarks.science.pareto_contenders import DEFAULTS
from benchmarks.science.pareto_contenders import JOINT_CONTENDERS
from benchmarks.science.pareto_contenders import JOINT_DEFAULTS
from benchmarks.science.pareto_contenders import JOINT_LR_GRIDS
from benchmarks.science.pareto_contenders import LR_GRIDS
from benchmarks.science.pareto_contenders import QUICK_COMPILER_OPTIONS
from benchmarks.science.pareto_contenders import TRAJECTORY_GRIDS
from benchmarks.science.pareto_contenders import TRAJECTORY_PAIRS
from benchmarks.science.pareto_contenders import TUNE_SEEDS
from benchmarks.science.pareto_contenders import TUNED_WITH
from benchmarks.science.pareto_contenders import grids
from benchmarks.science.pareto_contenders import joint_grids
from benchmarks.science.pareto_contenders import late_rho
from benchmarks.science.pareto_contenders import tasks
from benchmarks.science.pareto_report import check_gain_shares
from benchmarks.science.pareto_report import check_targets
from benchmarks.science.pareto_report import format_overhead
from benchmarks.science.pareto_report import format_shares
from benchmarks.science.pareto_report import format_table
from benchmarks.science.pareto_report import gain_shares
from benchmarks.science.pareto_report import plot
from benchmarks.science.pareto_report import replot

# What tests and other scripts reach through pareto: the tables, the formulas, the entry point.
__all__ = [
  "CONTENDERS",
  "DEFAULTS",
  "JOINT_CONTENDERS",
  "TRAJECTORY_GRIDS",
  "TUNED_WITH",
  "check_gain_shares",
  "gain_shares",
  "grids",
  "joint_grids",
  "late_rho",
  "main",
  "step_cost_of",
  "tasks",
]


# ----------------------------------------------------------------------------- step cost


def branch_costs(
  model,
  x,
  y,
  contenders: dict[str, Contender],
  hparams: dict,
  num_steps: int,
  base_kind: str = "adamw",
  **timing,
) -> dict[str, dict[str, float]]:
  """Per ``"contender/branch"``: its static step's median ratio to the base step (and ms, flops).

  Where a contender takes extra forward passes (MESA), also ``"forward"``: a forward pass's
  FLOPs as a share of a gradient evaluation's, from XLA's cost analysis of the two compiled.
  """
  options = timing.pop("compiler_options", None)
  params = model.init(jax.random.key(0), x[:1])
  base = harness.base_optimizer(kind=base_kind)
  compile_ = functools.partial(harness.compile_step, model, params=params, x=x, y=y)
  compile_ = functools.partial(compile_, compiler_options=options)
  timed = {"base": compile_(tx=base, contender=CONTENDERS["base"])}
  for name, contender in contenders.items():
    hp = hparams.get(contender.hparams, {"lr": 1e-3, "rho": 0.05, "alpha": 0.0})
    tx = contender.make(
      base, harness.HParams(hp["lr"], hp["rho"], hp["alpha"], num_steps, jax.random.key(0))
    )
    for branch in contender.branches:
      perturb = None if branch is None else branch == "full"
      timed[f"{name}/{branch}"] = compile_(tx=tx, contender=contender, perturb=perturb)
  costs = harness.interleaved(timed, "base", paired=True, **timing)
  if any(c.forwards for c in contenders.values()):
    costs["forward"] = forward_share(model, params, x, y, options)
  return costs


def forward_share(model, params, x, y, compiler_options=None) -> dict[str, float]:
  """A forward pass's FLOPs over a gradient evaluation's (loss and gradient), compiled by XLA."""
  loss_fn = lambda p: harness.cross_entropy(model.apply(p, x), y)
  flops = {
    name: harness.hlo_stats(jax.jit(fn).lower(params).compile(compiler_options))["flops"]
    for name, fn in (("forward", lambda p: model.apply(p, x)), ("gradient", jax.grad(loss_fn)))
  }
  return {**flops, "share": flops["forward"] / flops["gradient"]}


def step_cost_of(
  contender: Contender, costs: dict[str, dict[str, float]], name: str, n_full: float, n: int
) -> dict[str, float]:
  """``(n_full t_full + n_cheap t_cheap) / (N t_base)``, in time, FLOPs and gradient evaluations.

  ``base_steps`` counts gradient evaluations per step against the base's one: a full step
  takes ``contender.evaluations``, a cheap step one; an extra forward pass (MESA's) counts as
  its FLOPs' share of a gradient evaluation (``costs["forward"]``, :func:`forward_share`).
  """
  if not contender.branches:
    return {"step_cost": 1.0, "flops_cost": 1.0, "base_steps": 1.0}
  if contender.branches == (None,):
    only = costs[f"{name}/None"]
    out = {
      "step_cost": only["ratio"],
      "flops_cost": only["flops_ratio"],
      "base_steps": float(contender.evaluations),
    }
    if contender.forwards:
      out["base_steps"] += contender.forwards * costs["forward"]["share"]
    return out
  full = costs[f"{name}/full"]
  cheap = costs.get(f"{name}/cheap", full)  # no cheap branch: every step is full
  weigh = lambda key: (n_full * full[key] + (n - n_full) * cheap[key]) / n
  forwards = contender.forwards * costs["forward"]["share"] if contender.forwards else 0.0
  return {
    "step_cost": weigh("ratio"),
    "flops_cost": weigh("flops_ratio"),
    "base_steps": (n_full * contender.evaluations + (n - n_full)) / n + forwards,
    "full_ratio": full["ratio"],
    "cheap_ratio": cheap["ratio"],
    "full_ms": full["ms"],
    "cheap_ms": cheap["ms"],
    "base_ms": costs["base"]["ms"],
  }


def vit_overhead(
  contenders: dict[str, Contender], *, quick: bool, base_kind: str = "adamw", **timing
) -> list[dict]:
  """On step_cost.py's ViT-tiny: each policy's cheap step (``perturb=False``) vs the base step."""
  model = ViT(width=16, depth=1, heads=2) if quick else ViT()
  size, batch = (8, 4) if quick else (32, 32)
  key_x, key_y, _ = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (batch, size, size, 3))
  y = jax.random.randint(key_y, (batch,), 0, 10)
  cheap = {n: c for n, c in contenders.items() if "cheap" in c.branches}
  costs = branch_costs(
    model,
    x,
    y,
    {n: dataclasses.replace(c, branches=("cheap",)) for n, c in cheap.items()},
    {},
    1000,
    base_kind,
    **timing,
  )
  return [
    {
      "model": "vit-tiny",
      "contender": name,
      "cheap": "reuse" if name.startswith("every-") else "clean",
      "ms_per_step": costs[f"{name}/cheap"]["ms"],
      "base_ms_per_step": costs["base"]["ms"],
      "ratio_to_base": costs[f"{name}/cheap"]["ratio"],
      "flops_ratio_to_base": costs[f"{name}/cheap"]["flops_ratio"],
    }
    for name in cheap
  ]


# ----------------------------------------------------------------------------- reporting


def summarize(task, noise, contenders, metrics, costs, num_steps, hparams) -> list[dict]:
  """One row per contender at one (data set, noise level)."""
  rows = []
  for name, contender in contenders.items():
    runs = metrics[name]
    acc = np.array([m["accuracy"] for m in runs], np.float64)
    n_full = float(np.mean([m["full_steps"] for m in runs]))
    rows.append(
      {
        "dataset": task.name,
        "base_optimizer": task.base,
        "noise": noise,
        "contender": name,
        "acc_mean": float(acc.mean()),
        "acc_std": float(acc.std()),
        "seeds": len(runs),
        **step_cost_of(contender, costs, name, n_full, num_steps),
        # A transform without branches (momentum-SAM) has no full/cheap split.
        "full_fraction": None if contender.branches == (None,) else n_full / num_steps,
        "steps": num_steps,
        "train_loss_mean": float(np.mean([m["train_loss"] for m in runs])),
        "noise_fitted_mean": float(np.mean([m["noise_fitted"] for m in runs])),
        **hparams[contender.hparams],
        "accuracies": acc.tolist(),
      }
    )
  return rows


# ----------------------------------------------------------------------------- main


def train_task(task, contenders, hparams, seeds, options) -> tuple[dict, int]:
  """Every contender on every noise level of ``task``: ``{noise: {name: [metrics per seed]}}``."""
  metrics: dict[float, dict[str, list[dict]]] = {n: {} for n in task.noise_levels}
  num_steps = 0
  for name, contender in contenders.items():
    start = time.perf_counter()
    runs = [
      harness.Run(n, s, *(hparams[n][contender.hparams][k] for k in ("lr", "rho", "alpha")))
      for n in task.noise_levels
      for s in range(seeds)
    ]
    out, num_steps = harness.run_batch(
      contender, task, runs, validation=False, compiler_options=options
    )
    for run, m in zip(runs, out, strict=True):
      metrics[run.noise].setdefault(name, []).append(m)
    seconds = time.perf_counter() - start
    print(
      f"  {task.name} {name}: {len(runs)} runs of {num_steps} steps, {seconds:.0f} s", flush=True
    )
  return metrics, num_steps


def run_task(task, contenders, chosen, seeds, *, rounds: int, quick: bool) -> list[dict]:
  """Trains and times every contender on ``task``; one row per (noise level, contender)."""
  options = QUICK_COMPILER_OPTIONS if quick else None
  metrics, num_steps = train_task(task, contenders, chosen, seeds, options)
  # Step cost of each branch, once per model (the timed steps do not depend on the noise).
  data = task.load(0.0, 0)
  x, y = (jnp.asarray(a[: task.batch_size]) for a in (data.x_train, data.y_train))
  first = chosen[task.noise_levels[0]]
  costs = branch_costs(
    task.model,
    x,
    y,
    contenders,
    first,
    num_steps,
    task.base,
    rounds=rounds,
    steps=5 if quick else 20,
    compiler_options=options,
  )
  rows = []
  for n in task.noise_levels:
    rows += summarize(task, n, contenders, metrics[n], costs, num_steps, chosen[n])
  return rows


def parse_args(argv: list[str] | None):
  parser = harness.parser(__doc__, CONTENDERS)
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=None, help="override every data set's epochs")
  parser.add_argument(
    "--datasets", nargs="*", default=None, help="subset of digits, mnist1d, run in this order"
  )
  parser.add_argument("--noise", type=float, nargs="*", default=None, help="subset of noise levels")
  parser.add_argument("--no-tune", action="store_true", help="use DEFAULTS (always in --quick)")
  parser.add_argument("--no-vit", action="store_true", help="skip the ViT cheap-step overhead")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
  parser.add_argument("--tune-seeds", type=int, default=TUNE_SEEDS, help="seeds per grid point")
  parser.add_argument("--base", choices=harness.BASES, default="adamw", help="the base optimizer")
  parser.add_argument(
    "--joint",
    action="store_true",
    help="tune each key's lr and rho together (3 x 3; the base: 9 lrs) on mnist1d-ln, with"
    " JOINT_CONTENDERS, and report the share of SAM's gain each policy keeps",
  )
  parser.add_argument(
    "--replot",
    nargs=2,
    metavar=("PNG", "JSON"),
    default=None,
    help="draw the rows of --joint result files (comma-separated JSONs) against gradient"
    " evaluations into PNG, write their gain shares and target (e) beside it (<PNG>_shares.json),"
    " and train nothing (docs/choosing.md's figure)",
  )
  return parser.parse_args(argv)


def choose(task, contenders, args, options) -> tuple[dict, dict | None]:
  """Each key's (lr, rho, alpha) per noise level of ``task``, and the sweep behind them.

  Tuned on validation when ``args.tune``; else ``DEFAULTS`` (``JOINT_DEFAULTS`` under
  ``--joint``) and no sweep.
  """
  if not args.tune:
    defaults = JOINT_DEFAULTS[args.base] if args.joint else DEFAULTS[task.name]
    untuned = sorted({c.hparams for c in contenders.values()} - set(defaults[task.noise_levels[0]]))
    if untuned:
      raise SystemExit(f"No tuned values for {untuned} in this mode: tune them (drop --no-tune).")
    return {n: defaults[n] for n in task.noise_levels}, None
  keys = {"base"} | {c.hparams for c in contenders.values()}
  tuned_with = {k: CONTENDERS[TUNED_WITH[k]] for k in TUNED_WITH if k in keys}
  all_grids = joint_grids(args.base) if args.joint else grids(task.name)
  task_grids = {k: g for k, g in all_grids.items() if k in keys}
  lr_grid = JOINT_LR_GRIDS[args.base] if args.joint else LR_GRIDS[task.name]
  return tuning.tune(
    task,
    tuned_with,
    lr_grid,
    task_grids,
    seeds=args.tune_seeds,
    joint=args.joint,
    compiler_options=options,
  )


def train_all(args, contenders, seeds, rounds, argv) -> tuple[list[dict], dict, dict]:
  """Tunes (or takes the defaults), trains and times every contender on every data set.

  Saves the rows so far after each data set (``pareto[...]_partial.json``).
  """
  rows, tuned, sweeps = [], {}, {}
  by_name = tasks(args.mode, args.base)
  datasets = args.datasets or (["mnist1d-ln"] if args.joint else ["digits", "mnist1d"])
  options = QUICK_COMPILER_OPTIONS if args.quick else None
  for task in (by_name[name] for name in datasets):  # in the order given
    noises = tuple(n for n in task.noise_levels if args.noise is None or n in args.noise)
    if not noises:
      continue
    task = dataclasses.replace(task, noise_levels=noises, epochs=args.epochs or task.epochs)
    chosen, sweep = choose(task, contenders, args, options)
    if sweep is not None:
      sweeps[task.name] = sweep
    tuned[task.name] = {str(n): v for n, v in chosen.items()}
    rows += run_task(task, contenders, chosen, seeds, rounds=rounds, quick=args.quick)
    partial = {"partial": True, "seeds": seeds, "tuned": tuned, "sweep": sweeps, "rows": rows}
    harness.save("pareto", args.mode, partial, args.out_dir, argv, suffix=f"{args.suffix}_partial")
  return rows, tuned, sweeps


def report(args, rows, contenders) -> tuple[list[dict], list[dict], list[dict]]:
  """Prints the tables; times the ViT's cheap steps unless ``--no-vit``; checks the targets.

  Returns the ViT rows, the gain shares and the targets.
  """
  print(format_table(rows))
  overhead = []
  if not args.no_vit:  # single-step pairs: their ratios agree within 1.2%, 3-step samples' by 5%
    overhead = vit_overhead(
      contenders,
      quick=args.quick,
      base_kind=args.base,
      rounds=2 if args.quick else 100,
      steps=1,
      compiler_options=QUICK_COMPILER_OPTIONS if args.quick else None,
    )
    print(format_overhead(overhead))
  shares = gain_shares(rows)
  if shares:
    print("Share of SAM's gain over the base that each contender keeps:")
    print(format_shares(shares))
  checks = check_targets(rows, contenders, overhead)
  if args.joint:
    checks += check_gain_shares(shares, contenders)
  return overhead, shares, checks


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the tables, writes JSON (and a PNG unless ``--no-plot``)."""
  args = parse_args(argv)
  if not args.joint and (args.base != "adamw" or "mnist1d-ln" in (args.datasets or ())):
    raise SystemExit("--base sgd and mnist1d-ln have grids only under --joint: add --joint.")
  pairs = sorted(set(args.contenders or ()) & set(TRAJECTORY_PAIRS))
  if pairs and not args.joint:
    raise SystemExit(f"{pairs} take their knob from --joint runs (TRAJECTORY_KNOBS): add --joint.")
  if args.replot:  # also the gain shares and target (e) over all the files' rows
    return replot(*args.replot)
  args.mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 5)
  rounds = args.rounds or (2 if args.quick else 60)
  # --joint tunes unless --no-tune (JOINT_DEFAULTS), even with --quick; the rest tune unless
  # --quick or --no-tune (DEFAULTS).
  args.tune = not args.no_tune if args.joint else not (args.quick or args.no_tune)
  start = time.perf_counter()
  names = args.contenders or (JOINT_CONTENDERS if args.joint else DEFAULT_CONTENDERS)
  wanted = {n: c for n, c in CONTENDERS.items() if n in names}
  contenders = harness.available(wanted)
  # Results of another base or of --joint go to their own files: pareto[_quick][_joint][_sgd].json
  args.suffix = ("_joint" if args.joint else "") + ("" if args.base == "adamw" else f"_{args.base}")
  missing = sorted(set(wanted) - set(contenders))
  print(
    f"pareto, {args.mode}: {seeds} seeds; tuning {'on validation' if args.tune else 'off'}; {list(contenders)}; left out (not in this optax_gsam): {missing}"
  )
  rows, tuned, sweeps = train_all(args, contenders, seeds, rounds, argv)
  overhead, shares, checks = report(args, rows, contenders)
  seconds = time.perf_counter() - start
  print(f"{seconds:.0f} s")
  result = {
    "seconds": seconds,
    "seeds": seeds,
    "timing_rounds": rounds,
    "tuned": tuned,
    "base_optimizer": args.base,
    "joint_tuning": args.joint,
    "tuning": {"validation": args.tune, "seeds": args.tune_seeds, "sweep": sweeps},
    "left_out": missing,
    "rows": rows,
    "gain_shares": shares,
    "vit_cheap_step": overhead,
    "targets": checks,
  }
  x_key = "base_steps" if args.joint else "step_cost"
  draw = None if args.no_plot or not rows else functools.partial(plot, rows, x_key=x_key)
  return harness.save("pareto", args.mode, result, args.out_dir, argv, draw, suffix=args.suffix)


if __name__ == "__main__":
  main()
