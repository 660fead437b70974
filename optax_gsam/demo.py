"""Base optimizer vs SAM vs GSAM on scikit-learn's digits, with noisy labels.

Run with ``python -m optax_gsam.demo`` (needs the ``examples`` extra:
``pip install "optax_gsam[examples]"``). It trains the same Flax MLP three
times, shows progress, and prints a table of test accuracy, final training loss
and the step-time ratio to the base optimizer. About a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any
from typing import cast

import flax.linen as nn
import jax
import numpy as np
import optax

import optax_gsam

# A script (python -m optax_gsam.demo): its entry point is its only public name.
__all__ = ("main",)


class MLP(nn.Module):
  """A two-hidden-layer perceptron."""

  hidden: int = 256
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.gelu(nn.Dense(self.hidden)(x))
    x = nn.gelu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


@dataclasses.dataclass(frozen=True)
class Digits:
  x_train: np.ndarray
  y_train: np.ndarray  # possibly noisy
  x_test: np.ndarray
  y_test: np.ndarray  # always clean


def load_digits(label_noise: float, seed: int) -> Digits:
  """scikit-learn's 8x8 digits (shipped with the package), standardised, 80/20 split.

  A ``label_noise`` share of the training labels is replaced by a different
  random class; test labels stay clean.
  """
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  x, y = sklearn_digits(return_X_y=True)
  x = (x / 16.0 - 0.5).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
    x, y, test_size=0.2, random_state=0, stratify=y
  )
  rng = np.random.default_rng(seed)
  noisy = rng.random(len(y_train)) < label_noise
  y_train = y_train.copy()
  y_train[noisy] = (y_train[noisy] + rng.integers(1, 10, noisy.sum())) % 10
  return Digits(x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32))


@dataclasses.dataclass
class RunResult:
  name: str
  test_accuracy: float
  final_loss: float
  seconds_per_step: float
  surrogate_gap: float | None
  losses: list[float]


def make_optimizer(
  name: str, num_steps: int, *, lr: float, rho: float, alpha: float
) -> optax.GradientTransformation:
  """The base optimizer (AdamW, warmup + cosine), optionally behind SAM or GSAM."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, lr, max(1, num_steps // 20), num_steps, end_value=lr * 0.01
  )
  base = optax.adamw(schedule, weight_decay=1e-4)
  if name == "base":
    return base
  if name == "sam":
    return optax.chain(optax_gsam.sam(rho), base)
  if name == "gsam":
    rho_schedule = optax_gsam.rho_from_lr(schedule, rho, rho / 4, num_steps=num_steps)
    return optax.chain(optax_gsam.gsam(rho_schedule, alpha), base)
  raise ValueError(f"unknown optimizer {name!r}")


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(
  name: str,
  data: Digits,
  *,
  seed: int,
  epochs: int,
  batch_size: int,
  lr: float,
  rho: float,
  alpha: float,
  progress: Callable | None = None,
) -> RunResult:
  """Trains the MLP with one optimizer; returns test accuracy and timings."""
  model = MLP()
  steps_per_epoch = len(data.x_train) // batch_size
  num_steps = epochs * steps_per_epoch
  tx = make_optimizer(name, num_steps, lr=lr, rho=rho, alpha=alpha)
  params = model.init(jax.random.key(seed), data.x_train[:1])
  opt_state = tx.init(params)
  sharpness_aware = name != "base"

  @jax.jit
  def step(params, opt_state, x, y):
    loss_fn = lambda p: cross_entropy(model.apply(p, x), y)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if sharpness_aware:
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses, step_times = [], []
  for _ in range(epochs):
    order = rng.permutation(len(data.x_train))
    epoch_losses = []
    for i in range(steps_per_epoch):
      idx = order[i * batch_size : (i + 1) * batch_size]
      start = time.perf_counter()
      params, opt_state, loss = step(params, opt_state, data.x_train[idx], data.y_train[idx])
      loss.block_until_ready()
      step_times.append(time.perf_counter() - start)
      epoch_losses.append(float(loss))
    losses.append(float(np.mean(epoch_losses)))
    if progress is not None:
      progress(1)
  logits = cast(jax.Array, model.apply(params, data.x_test))  # no mutable collections
  accuracy = float(np.mean(np.argmax(logits, axis=-1) == data.y_test))
  gap = float(optax.tree.get(opt_state, "surrogate_gap")) if sharpness_aware else None
  # Drop the first epoch's steps: they include compilation.
  seconds_per_step = float(np.median(step_times[steps_per_epoch:]))
  return RunResult(name, accuracy, losses[-1], seconds_per_step, gap, losses)


def summarize(results: list[RunResult]) -> list[dict[str, Any]]:
  """Mean and standard deviation over seeds, per optimizer, in the order given."""
  names = list(dict.fromkeys(r.name for r in results))
  base_time = np.mean([r.seconds_per_step for r in results if r.name == names[0]])
  rows = []
  for name in names:
    runs = [r for r in results if r.name == name]
    accuracies = np.array([r.test_accuracy for r in runs])
    gaps = [r.surrogate_gap for r in runs if r.surrogate_gap is not None]
    rows.append(
      {
        "optimizer": name,
        "test_accuracy_mean": float(accuracies.mean()),
        "test_accuracy_std": float(accuracies.std()),
        "final_loss": float(np.mean([r.final_loss for r in runs])),
        "surrogate_gap": float(np.mean(gaps)) if gaps else None,
        "step_time_ratio": float(np.mean([r.seconds_per_step for r in runs]) / base_time),
        "seeds": len(runs),
      }
    )
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """A plain-text table of :func:`summarize`'s rows."""
  cells = [
    ("optimizer", "test acc (mean ± std)", "final loss", "surrogate gap", "step time / base")
  ]
  for row in rows:
    gap = "-" if row["surrogate_gap"] is None else f"{row['surrogate_gap']:.4f}"
    cells.append(
      (
        row["optimizer"],
        f"{100 * row['test_accuracy_mean']:.2f} ± {100 * row['test_accuracy_std']:.2f}%",
        f"{row['final_loss']:.4f}",
        gap,
        f"{row['step_time_ratio']:.2f}x",
      )
    )
  widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
  lines = [
    "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in cells
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--label-noise", type=float, default=0.2, help="share of noisy train labels")
  parser.add_argument("--epochs", type=int, default=40)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--rho", type=float, default=0.1, help="SAM rho; GSAM's rho_max")
  parser.add_argument("--alpha", type=float, default=0.3, help="GSAM alpha")
  parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)

  from tqdm.auto import tqdm

  names = ("base", "sam", "gsam")
  print(
    f"digits, {100 * args.label_noise:.0f}% noisy training labels: {args.epochs} epochs of "
    f"batch {args.batch_size}, {args.seeds} seed(s), AdamW(lr={args.lr}) with warmup + cosine"
  )
  results = []
  with tqdm(
    total=args.epochs * len(names) * args.seeds, disable=args.no_progress, unit="epoch"
  ) as bar:
    for seed in range(args.seeds):
      data = load_digits(args.label_noise, seed)
      for name in names:
        bar.set_description(f"seed {seed} {name}")
        results.append(
          train(
            name,
            data,
            seed=seed,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            rho=args.rho,
            alpha=args.alpha,
            progress=bar.update,
          )
        )
  rows = summarize(results)
  print(format_table(rows))
  return rows


if __name__ == "__main__":
  main()
