"""Tuning on a validation split: each hyperparameter key's values chosen per noise level.

A script calls ``tuning.tune`` with the contender that tunes each key and the key's grids;
the runs themselves are the harness's (:func:`benchmarks.harness.run_batch`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np

from benchmarks.harness import Contender
from benchmarks.harness import Run
from benchmarks.harness import Task
from benchmarks.harness import run_batch


def _best_points(
  task: Task,
  contenders: dict[str, Contender],
  key: str,
  points: dict[float, list[tuple[float, float, float]]],
  *,
  seeds: int,
  sweep: dict[str, list[dict]],
  compiler_options: dict | None,
) -> dict:
  """Trains ``key``'s contender on every ``(lr, rho, alpha)`` of ``points`` (per noise level).

  Returns the best point per noise level by mean validation accuracy over ``seeds``; appends
  every point's score to ``sweep[key]``.
  """
  runs = [
    Run(noise, s, *point) for noise, grid in points.items() for point in grid for s in range(seeds)
  ]
  metrics, _ = run_batch(
    contenders[key], task, runs, validation=True, compiler_options=compiler_options
  )
  best: dict[float, dict] = {}
  for i in range(0, len(runs), seeds):
    run = runs[i]
    acc = float(np.mean([m["accuracy"] for m in metrics[i : i + seeds]]))
    point = {"noise": run.noise, "lr": run.lr, "rho": run.rho, "alpha": run.alpha}
    sweep.setdefault(key, []).append({**point, "val_accuracy": acc})
    print(f"  tune {task.name} {key:8s} {point}: val acc {100 * acc:.2f}%", flush=True)
    if run.noise not in best or acc > best[run.noise][1]:
      best[run.noise] = ({"lr": run.lr, "rho": run.rho, "alpha": run.alpha}, acc)
  return {noise: point for noise, (point, _) in best.items()}


def tune(
  task: Task,
  contenders: dict[str, Contender],
  lr_grid: Sequence[float],
  grids: dict[str, tuple[Sequence[float], Sequence[float] | Mapping[float, Sequence[float]]]],
  *,
  seeds: int,
  compiler_options: dict | None = None,
  joint: bool = False,
) -> tuple[dict, dict]:
  """Per noise level: the base learning rate, then each key's (rho, alpha) at that learning rate.

  With ``joint``, each key's learning rate is tuned together with its rho and alpha, over
  ``lr_grid x rhos x alphas``, and the base's over as many learning rates, spaced
  geometrically across ``lr_grid``'s range: every key gets the same number of points.

  Args:
    task: what to train; every noise level of it is tuned separately.
    contenders: per hyperparameter key (``"base"`` and those of ``grids``), the contender
      that is trained to tune it.
    lr_grid: the base learning rates tried.
    grids: per key, its grid of rho values and its grid of alpha values (or, per noise
      level, one: a combination's trajectory knob at the value its own tuning chose there).
    seeds: seeds per grid point; the score is the mean validation accuracy.
    compiler_options: passed to XLA.

  Returns:
    The chosen values, ``{noise: {key: {"lr", "rho", "alpha"}}}``, and the whole sweep.
  """
  sweep: dict[str, list[dict]] = {}
  evaluate = functools.partial(
    _best_points, task, contenders, seeds=seeds, sweep=sweep, compiler_options=compiler_options
  )
  noises = task.noise_levels
  base_lrs = list(lr_grid)
  alphas_at = lambda alphas, n: alphas[n] if isinstance(alphas, Mapping) else alphas
  if joint and grids:
    sizes = {
      len(lr_grid) * len(rhos) * len(alphas_at(alphas, n))
      for rhos, alphas in grids.values()
      for n in noises
    }
    if len(sizes) != 1:
      raise ValueError(f"joint tuning needs grids of one size for every key, got sizes {sizes}")
    [size] = sizes
    base_lrs = np.geomspace(min(lr_grid), max(lr_grid), size).tolist()
  chosen = {
    n: {"base": p}
    for n, p in evaluate("base", {n: [(lr, 0.0, 0.0) for lr in base_lrs] for n in noises}).items()
  }
  for key, (rhos, alphas) in grids.items():
    lrs = lambda n: lr_grid if joint else (chosen[n]["base"]["lr"],)
    points = {
      n: [(lr, r, a) for lr in lrs(n) for r in rhos for a in alphas_at(alphas, n)] for n in noises
    }
    for n, point in evaluate(key, points).items():
      chosen[n][key] = point
  return chosen, sweep
