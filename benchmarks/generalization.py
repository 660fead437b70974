"""Generalization and sharpness of base / SAM / GSAM on scikit-learn digits with noisy labels.

The model is the demo's two-hidden-layer MLP (:class:`optax_gsam.demo.MLP`) on
the demo's 8x8 digits split (:func:`optax_gsam.demo.load_digits`: 1437 training
and 360 test images; a ``label_noise`` share of the training labels is replaced
by a different random class, the test labels stay clean). Every contender wraps
the same base optimizer, AdamW (weight decay 1e-4, batch 64) with a linear
warmup (5% of the steps) and a cosine decay to 1% of the peak learning rate.
All the runs of one contender (seeds x noise levels) train together under
``jax.vmap`` in one compiled ``lax.scan``.

Reported, as mean ± std over seeds, at 0%, 20% and 40% label noise:

* test accuracy after the last epoch (no early stopping);
* the share of the corrupted training examples the model fits to their wrong
  label (memorisation of the noise);
* sharpness at the end of training, both measured on the full training set
  **with the labels the model was trained on** (noisy ones included), i.e. on
  the objective the optimizer minimised:

  - ``lambda_max``: the top Hessian eigenvalue, by 50 steps of power iteration
    on Hessian-vector products (``jax.jvp`` of ``jax.grad``) from a random
    start (the Rayleigh quotient of the last iterate);
  - ``gap``: the surrogate gap :math:`f(w + \\rho g / \\|g\\|) - f(w)` with the
    full-batch gradient :math:`g` at the same ``rho = 0.1`` for every
    optimizer, base included, so the numbers are comparable.

Hyperparameters. Tuned a little with ``--tune`` on a validation split (the last
20% of a fixed permutation of the training set, labels with the same 20% noise,
4 seeds, 40 epochs), in the order a practitioner would: the base learning rate
over {1e-3, 2e-3, 5e-3}; then, at that learning rate, SAM's rho over
{0.05, 0.1, 0.2, 0.4}; then GSAM's rho x alpha over {0.05, 0.1, 0.2, 0.4} x
{0.1, 0.3, 0.6}. rho is constant for SAM and GSAM (no ``rho_from_lr``), so GSAM
differs from SAM only by the surrogate-gap term. The winners, in ``DEFAULTS``:
lr = 1e-3 for all; SAM rho = 0.4; GSAM rho = 0.2, alpha = 0.3. The sweep is
flat: every SAM/GSAM setting with rho >= 0.1 scored within 0.4 points of the
best on 288 noisy validation labels x 4 seeds, i.e. within noise, and 1e-3 beat
2e-3 and 5e-3 clearly for all. ``--tune`` prints and saves the whole sweep
(``benchmarks/results/generalization_tune.json``).

Run ``python benchmarks/generalization.py`` (6 seeds, 60 epochs; a few minutes
on 2 CPU cores) or ``--quick`` (2 seeds, 20 epochs; about a minute). A table
goes to stdout, JSON and a PNG (bar chart and test-accuracy curves) to
``benchmarks/results/``.

Add a contender with one line in ``CONTENDERS``, e.g.::

  "gsam_every4": Contender(lambda base, hp: optax.chain(
      optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=4), base), "gsam"),
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import optax_gsam
from optax_gsam import demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import code_version
from _common import machine
from _common import render_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NOISE_LEVELS = (0.0, 0.2, 0.4)
GAP_RHO = 0.1  # the fixed radius of the surrogate-gap measurement, for every optimizer
POWER_ITERATIONS = 50
BATCH_SIZE = 64
WEIGHT_DECAY = 1e-4


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass(frozen=True)
class HParams:
  """What a contender factory may read; the values may be traced (runs are vmapped)."""

  lr: Any
  rho: Any
  alpha: Any


@dataclasses.dataclass(frozen=True)
class Contender:
  """An optimizer factory, how its ``update`` is called, and whose tuned values it uses.

  Attributes:
    make: ``(base_optimizer, hparams) -> optimizer``.
    hparams: the key of :data:`DEFAULTS` that holds its learning rate, rho and alpha.
    protocol: ``"loss_fn"`` calls ``update(grads, state, params, loss_fn=loss_fn,
      value=loss)``; ``"grad_fn"`` passes ``grad_fn=lambda p, _: jax.grad(loss_fn)(p)``
      (``optax.contrib.sam``); ``"plain"`` passes nothing.
  """

  make: Callable[[optax.GradientTransformation, HParams], optax.GradientTransformation]
  hparams: str
  protocol: Literal["loss_fn", "grad_fn", "plain"] = "loss_fn"


CONTENDERS: dict[str, Contender] = {
  "base": Contender(lambda base, hp: base, "base", "plain"),
  "sam": Contender(lambda base, hp: optax.chain(optax_gsam.sam(hp.rho), base), "sam"),
  "gsam": Contender(lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha), base), "gsam"),
  "gsam k=5": Contender(
    lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=5), base), "gsam"
  ),
}

# Chosen with --tune (see the module docstring and generalization_tune.json).
DEFAULTS: dict[str, dict[str, float]] = {
  "base": {"lr": 1e-3, "rho": 0.0, "alpha": 0.0},
  "sam": {"lr": 1e-3, "rho": 0.4, "alpha": 0.0},
  "gsam": {"lr": 1e-3, "rho": 0.2, "alpha": 0.3},
}


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class Split:
  """Training inputs (shared by all runs) and evaluation inputs."""

  x_train: np.ndarray
  x_eval: np.ndarray


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


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


def make_train(
  contender: Contender, split: Split, *, epochs: int, batch_size: int = BATCH_SIZE
) -> Callable:
  """A jitted, vmapped ``(lr, rho, alpha, key, y_train, y_eval, clean_y_train) -> metrics``."""
  model = demo.MLP()
  n = len(split.x_train)
  steps_per_epoch = n // batch_size
  num_steps = epochs * steps_per_epoch
  unit_schedule = optax.warmup_cosine_decay_schedule(
    0.0, 1.0, max(1, num_steps // 20), num_steps, end_value=0.01
  )

  def train_one(lr, rho, alpha, key, y_train, y_eval, clean_y_train, x_train, x_eval):
    schedule = lambda count: lr * unit_schedule(count)
    base = optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    tx = contender.make(base, HParams(lr=lr, rho=rho, alpha=alpha))
    init_key, data_key, power_key = jax.random.split(key, 3)
    params = model.init(init_key, x_train[:1])
    opt_state = tx.init(params)

    def step(carry, idx):
      params, opt_state = carry
      x, y = x_train[idx], y_train[idx]
      loss_fn = lambda p: cross_entropy(model.apply(p, x), y)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      if contender.protocol == "loss_fn":
        extra = {"loss_fn": loss_fn, "value": loss}
      elif contender.protocol == "grad_fn":
        extra = {"grad_fn": lambda p, _: jax.grad(loss_fn)(p)}
      else:
        extra = {}
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      return (optax.apply_updates(params, updates), opt_state), loss

    def epoch(carry, epoch_key):
      order = jax.random.permutation(epoch_key, n)[: steps_per_epoch * batch_size]
      carry, losses = jax.lax.scan(step, carry, order.reshape(steps_per_epoch, batch_size))
      predictions = jnp.argmax(model.apply(carry[0], x_eval), axis=-1)
      return carry, (losses.mean(), jnp.mean(predictions == y_eval))

    (params, _), (losses, accuracy) = jax.lax.scan(
      epoch, (params, opt_state), jax.random.split(data_key, epochs)
    )
    full_loss = lambda p: cross_entropy(model.apply(p, x_train), y_train)
    corrupted = y_train != clean_y_train
    fitted = jnp.argmax(model.apply(params, x_train), axis=-1) == y_train
    return {
      "eval_accuracy": accuracy[-1],
      "eval_accuracy_curve": accuracy,
      "train_loss_curve": losses,
      "train_loss": full_loss(params),
      "noise_fitted": jnp.sum(fitted & corrupted) / jnp.maximum(jnp.sum(corrupted), 1),
      "lambda_max": top_hessian_eigenvalue(full_loss, params, power_key, POWER_ITERATIONS),
      "gap": surrogate_gap(full_loss, params, GAP_RHO),
    }

  return jax.jit(jax.vmap(train_one, in_axes=(0, 0, 0, 0, 0, 0, 0, None, None)))


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: its data, seed and hyperparameters."""

  noise: float
  seed: int
  lr: float
  rho: float
  alpha: float


def run_batch(
  contender: Contender, runs: list[Run], *, epochs: int, validation: bool
) -> list[dict]:
  """Trains every run of one contender together; one metrics dict per run.

  With ``validation``, the model trains on 80% of the training set and is
  evaluated on the other 20% (labels as noisy as the training labels); otherwise
  it trains on the whole training set and is evaluated on the clean test set.
  """
  datasets = [demo.load_digits(r.noise, r.seed) for r in runs]
  clean = demo.load_digits(0.0, 0).y_train
  if validation:
    order = np.random.default_rng(0).permutation(len(clean))
    cut = int(0.8 * len(order))
    train_idx, eval_idx = order[:cut], order[cut:]
    split = Split(datasets[0].x_train[train_idx], datasets[0].x_train[eval_idx])
    y_train = np.stack([d.y_train[train_idx] for d in datasets])
    y_eval = np.stack([d.y_train[eval_idx] for d in datasets])
    clean_y_train = np.stack([clean[train_idx]] * len(runs))
  else:
    split = Split(datasets[0].x_train, datasets[0].x_test)
    y_train = np.stack([d.y_train for d in datasets])
    y_eval = np.stack([d.y_test for d in datasets])
    clean_y_train = np.stack([clean] * len(runs))
  train = make_train(contender, split, epochs=epochs)
  as_array = lambda field: jnp.asarray([getattr(r, field) for r in runs], jnp.float32)
  keys = jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in runs]))
  out = train(
    as_array("lr"),
    as_array("rho"),
    as_array("alpha"),
    keys,
    y_train,
    y_eval,
    clean_y_train,
    split.x_train,
    split.x_eval,
  )
  out = jax.tree.map(np.asarray, out)
  return [{k: v[i].tolist() for k, v in out.items()} for i in range(len(runs))]


# ----------------------------------------------------------------------------- reporting


def summarize(results: dict[str, list[tuple[Run, dict]]]) -> list[dict]:
  """Mean and std over seeds per (noise level, contender)."""
  rows = []
  noises = sorted({run.noise for pairs in results.values() for run, _ in pairs})
  for noise in noises:
    for name, pairs in results.items():
      metrics = [m for run, m in pairs if run.noise == noise]
      if not metrics:
        continue
      row: dict[str, Any] = {"noise": noise, "contender": name, "seeds": len(metrics)}
      for key in ("eval_accuracy", "noise_fitted", "train_loss", "lambda_max", "gap"):
        values = np.array([m[key] for m in metrics], dtype=np.float64)
        row[f"{key}_mean"] = float(values.mean())
        row[f"{key}_std"] = float(values.std())
      row["eval_accuracy_curve_mean"] = np.mean(
        [m["eval_accuracy_curve"] for m in metrics], axis=0
      ).tolist()
      row["eval_accuracy_curve_std"] = np.std(
        [m["eval_accuracy_curve"] for m in metrics], axis=0
      ).tolist()
      rows.append(row)
  return rows


def format_table(rows: list[dict], accuracy_label: str = "test acc %") -> str:
  """A plain-text table of :func:`summarize`'s rows."""
  header = (
    "noise",
    "optimizer",
    accuracy_label,
    "noise fitted %",
    "train loss",
    "lambda_max",
    f"gap@rho={GAP_RHO}",
  )
  cells = [header]
  for r in rows:

    def pm(key, scale=1.0, digits=2, r=r):
      return f"{scale * r[key + '_mean']:.{digits}f} ± {scale * r[key + '_std']:.{digits}f}"

    cells.append(
      (
        f"{100 * r['noise']:.0f}%",
        r["contender"],
        pm("eval_accuracy", 100),
        "-" if r["noise"] == 0 else pm("noise_fitted", 100, 1),
        pm("train_loss", digits=3),
        pm("lambda_max", digits=1),
        pm("gap", digits=4),
      )
    )
  return render_table(cells)


def plot(rows: list[dict], path: Path) -> None:
  """Test accuracy per noise level (bars, ± std) and test-accuracy curves at the highest noise."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  noises = sorted({r["noise"] for r in rows})
  names = list(dict.fromkeys(r["contender"] for r in rows))
  fig, (bars, curves) = plt.subplots(1, 2, figsize=(10, 3.8))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    sel = [next(r for r in rows if r["noise"] == n and r["contender"] == name) for n in noises]
    bars.bar(
      np.arange(len(noises)) + i * width,
      [100 * r["eval_accuracy_mean"] for r in sel],
      width,
      yerr=[100 * r["eval_accuracy_std"] for r in sel],
      capsize=3,
      label=name,
    )
    top = sel[-1]
    mean = 100 * np.array(top["eval_accuracy_curve_mean"])
    std = 100 * np.array(top["eval_accuracy_curve_std"])
    epochs = np.arange(1, len(mean) + 1)
    curves.plot(epochs, mean, label=name)
    curves.fill_between(epochs, mean - std, mean + std, alpha=0.2)
  low = min(100 * r["eval_accuracy_mean"] - 100 * r["eval_accuracy_std"] for r in rows)
  bars.set_ylim(max(0, low - 3), 100)
  bars.set_xticks(np.arange(len(noises)) + width * (len(names) - 1) / 2)
  bars.set_xticklabels([f"{100 * n:.0f}% noise" for n in noises])
  bars.set_ylabel("test accuracy % (mean ± std over seeds)")
  bars.legend(fontsize=8)
  curves.set_xlabel("epoch")
  curves.set_ylabel("test accuracy %")
  curves.set_ylim(max(0, low - 10), 100)
  curves.set_title(f"{100 * noises[-1]:.0f}% label noise")
  curves.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------- tuning


def tune(epochs: int, seeds: int) -> dict:
  """The sweep behind :data:`DEFAULTS`, on a validation split at 20% label noise."""
  noise = 0.2
  sweep: dict[str, list[dict]] = {}

  def evaluate(name: str, grid: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    runs = [Run(noise, s, lr, rho, a) for lr, rho, a in grid for s in range(seeds)]
    metrics = run_batch(CONTENDERS[name], runs, epochs=epochs, validation=True)
    scores = []
    for i, (lr, rho, a) in enumerate(grid):
      acc = [m["eval_accuracy"] for m in metrics[i * seeds : (i + 1) * seeds]]
      scores.append({"lr": lr, "rho": rho, "alpha": a, "val_accuracy": float(np.mean(acc))})
      print(f"  {name:5s} lr={lr:g} rho={rho:g} alpha={a:g}: val acc {100 * np.mean(acc):.2f}%")
    sweep[name] = scores
    best = max(scores, key=lambda s: s["val_accuracy"])
    return best["lr"], best["rho"], best["alpha"]

  lr, _, _ = evaluate("base", [(lr, 0.0, 0.0) for lr in (1e-3, 2e-3, 5e-3)])
  _, sam_rho, _ = evaluate("sam", [(lr, rho, 0.0) for rho in (0.05, 0.1, 0.2, 0.4)])
  _, gsam_rho, alpha = evaluate(
    "gsam", [(lr, rho, a) for rho in (0.05, 0.1, 0.2, 0.4) for a in (0.1, 0.3, 0.6)]
  )
  best = {
    "base": {"lr": lr, "rho": 0.0, "alpha": 0.0},
    "sam": {"lr": lr, "rho": sam_rho, "alpha": 0.0},
    "gsam": {"lr": lr, "rho": gsam_rho, "alpha": alpha},
  }
  print(f"best: {best}")
  return {"noise": noise, "epochs": epochs, "seeds": seeds, "sweep": sweep, "best": best}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the table, writes JSON (and a PNG unless ``--no-plot``)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 seeds, 20 epochs (about a minute)")
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--noise", type=float, nargs="*", default=list(NOISE_LEVELS))
  parser.add_argument("--contenders", nargs="*", default=None, help=f"subset of {list(CONTENDERS)}")
  parser.add_argument("--tune", action="store_true", help="run the hyperparameter sweep instead")
  parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else argv
  command = " ".join(["python", "benchmarks/generalization.py", *argv])
  mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 6)
  epochs = args.epochs or (20 if args.quick else 60)
  args.out_dir.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()

  if args.tune:
    tuned = tune(epochs=args.epochs or 40, seeds=args.seeds or 4)
    result = {
      "benchmark": "generalization_tune",
      "command": command,
      "machine": machine(),
      "code": code_version(),
      **tuned,
    }
    (args.out_dir / "generalization_tune.json").write_text(json.dumps(result, indent=2) + "\n")
    return result

  print(
    f"digits, label noise {[f'{100 * n:.0f}%' for n in args.noise]}, {seeds} seeds, {epochs} "
    f"epochs of batch {BATCH_SIZE}, AdamW + warmup/cosine; hyperparameters {DEFAULTS}"
  )
  results: dict[str, list[tuple[Run, dict]]] = {}
  for name, contender in CONTENDERS.items():
    if args.contenders and name not in args.contenders:
      continue
    hp = DEFAULTS[contender.hparams]
    runs = [Run(n, s, hp["lr"], hp["rho"], hp["alpha"]) for n in args.noise for s in range(seeds)]
    results[name] = list(
      zip(runs, run_batch(contender, runs, epochs=epochs, validation=False), strict=True)
    )
  rows = summarize(results)
  print(format_table(rows))
  print(
    f"lambda_max and gap: full training set, training (noisy) labels; gap at rho={GAP_RHO} for "
    f"every optimizer. {time.perf_counter() - start:.0f} s."
  )
  result = {
    "benchmark": "generalization",
    "mode": mode,
    "command": command,
    "seeds": seeds,
    "epochs": epochs,
    "batch_size": BATCH_SIZE,
    "hparams": {name: DEFAULTS[c.hparams] for name, c in CONTENDERS.items()},
    "gap_rho": GAP_RHO,
    "sharpness_labels": "training labels (noisy)",
    "machine": machine(),
    "code": code_version(),
    "rows": rows,
  }
  stem = "generalization" + ("" if mode == "full" else f"_{mode}")
  (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
  if not args.no_plot:
    plot(rows, args.out_dir / f"{stem}.png")
  return result


if __name__ == "__main__":
  main()
