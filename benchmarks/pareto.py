"""Accuracy against step cost: cheap sharpness-aware policies vs SAM, GSAM and the base optimizer.

Every contender trains the same model for the same number of steps on two data
sets, over several seeds:

* scikit-learn digits (the demo's MLP and 80/20 split, :mod:`optax_gsam.demo`)
  with 20% and 40% of the training labels replaced by a wrong class (test
  labels clean), batch 64;
* MNIST-1D (Greydanus, 2020), made locally with the ``mnist1d`` package
  (``make_dataset(get_dataset_args())``: 4000 training and 1000 test series of
  length 40; nothing is downloaded), with Greydanus's small 1-D CNN (three
  convolutions of 25 channels, kernels 5/3/3, stride 2, ReLU, and a linear
  classifier), batch 100. His reference test accuracies: MLP 68%, CNN 94%,
  human 96%.

Contenders (the policies are SAM with a cheap-step policy, ``optax_gsam.sam(rho,
policy=...)``, at SAM's tuned rho):

* ``base``: AdamW alone;  ``sam``: ``optax_gsam.sam(rho)``;  ``gsam``:
  ``optax_gsam.gsam(rho, alpha)``;
* ``every-k`` (k = 2, 5, 10): the full step every k-th step, the stored
  orthogonal direction reused in between (LookSAM, ``every_k_policy(k)``,
  reuse weight 0.7);
* ``adaptive``: AE-SAM (``gradient_norm_policy``): the full step when
  :math:`\\|g_c\\|^2 \\ge \\mu_t + c_t \\sigma_t`, with the paper's :math:`c_t`
  rising linearly from -1 to 1 over training; a plain base step otherwise;
* ``random``: RST (``random_policy(0.5)``): the full step with probability 0.5;
* ``late-phase``: rho = 0 for the first 75% of the steps, then SAM's rho, with
  ``every_step_policy(skip_zero_rho=True)`` so the zero-rho steps skip the
  perturbed pass;
* ``momentum-sam``: ``optax_gsam.momentum_sam`` where the installed package has
  it (one gradient evaluation a step, at weights perturbed along the running
  average of past gradients); otherwise left out.

Training: AdamW (weight decay 1e-4) with a linear warmup (5% of the steps) and a
cosine decay to 1% of the peak; all the runs of one contender (seeds x noise
levels x grid points) train together under ``jax.vmap`` in one compiled
``lax.scan``. Under ``vmap`` a policy's ``lax.cond`` becomes a select that
computes both branches but keeps, per run, the one the policy chose, so the
accuracies are those of the policy; the time is measured separately (below).
The CNN's convolutions are written as patch extraction + matmul
(:class:`PatchConv1D`, the same function as ``nn.Conv``): XLA's CPU backend runs
real convolutions inside loops and conditionals through a slow path
(jax-ml/jax#12868) and ``vmap`` over parameters turns them into grouped
convolutions, which together made a vmapped, scanned CNN ~7x slower per step.

Hyperparameters are tuned on a validation split (the last 20% of a fixed
permutation of the training set; for digits its labels are as noisy as the
training labels), 3 seeds, the same number of epochs, separately for each data
set and noise level: first the base learning rate; then, at that learning rate,
SAM's rho and GSAM's rho (alpha fixed at 0.3, generalization.py's choice);
momentum-SAM's rho gets its own grid. The policies reuse SAM's learning rate and
rho; their own knobs keep the papers' values (k, reuse weight 0.7, AE-SAM's c_t
schedule and decay 0.9, RST's p = 0.5, SAM over the last 25%). The full run
chose, for digits at 20% / digits at 40% / MNIST-1D: lr 5e-4 / 2.5e-4 / 4e-2; SAM
rho 0.2 / 0.1 / 0.1; GSAM rho 0.2 / 0.1 / 0.05; momentum-SAM rho 1.0 / 0.1 / 1.0
(:data:`DEFAULTS`, which ``--no-tune`` uses; the whole sweep is in the JSON).
Validation labels are as noisy as the training labels, which rewards fitting the
noise less: the lower learning rates won on digits, and SAM's rho barely moved
the validation accuracy there (within 0.5 points over the grid).

Step cost, the static-branch protocol of ``step_cost.py``: in one process, on a
fixed batch, each contender's jitted full-branch step (``update(...,
perturb=True)``) and jitted cheap-branch step (``perturb=False``) are timed
interleaved, in a fresh random order every round, each run paired with a run of
the base step right next to it; each is reduced to the median over rounds of its
ratio to the base step, and

  step_cost = (n_full * t_full + n_cheap * t_cheap) / (N * t_base)

with ``n_full`` the full steps the contender took in training
(``GSAMState.full_steps``, averaged over seeds) and ``N`` the steps of the run.
``flops_cost`` is the same sum with XLA's FLOP counts of the compiled steps
(deterministic). On these small models a step is short, so Python dispatch is a
visible part of every step, and all ratios (SAM's too) sit closer to 1 than the
FLOP ratios.

The third target of issue 12 is measured on ``step_cost.py``'s ViT-tiny: each
``cheap="clean"`` policy's cheap step (``perturb=False``) against the base step,
interleaved the same way but one step per sample and 100 rounds: with 3-step
samples the ratios of identical programs still spread by 5% (``--no-vit`` skips it).

Targets (issue 12): (a) on each data set and noise level some cheap policy
reaches SAM's mean test accuracy minus SAM's std at step_cost <= 1.15;
(b) late-phase SAM costs <= 1.05x base over the whole run; (c) each
``cheap="clean"`` policy's cheap step is within 3% of a base step on the ViT.

Run ``python benchmarks/pareto.py`` (18 to 30 minutes on 2 CPU cores shared with
other jobs; tuning is about 40% of it) or
``--quick`` (a smoke run: a small MNIST-1D, 2 seeds, 2 epochs, no tuning). A
table goes to stdout, JSON (``rows``: dataset, noise, contender, acc_mean,
acc_std, seeds, step_cost, ...) and a PNG to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam
from optax_gsam import demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_cost
from _common import code_version
from _common import machine
from _common import render_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WEIGHT_DECAY = 1e-4
GSAM_ALPHA = 0.3
LATE_START = 0.75  # late-phase SAM: rho = 0 before this fraction of the steps
RANDOM_PROBABILITY = 0.5
TUNE_SEEDS = 3
COST_LIMIT = 1.15  # target (a)
LATE_LIMIT = 1.05  # target (b)
OVERHEAD_LIMIT = 1.03  # target (c)
# --quick compiles with LLVM's optimizations off: half the compile time, slower steps.
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


# ----------------------------------------------------------------------------- models and data


class PatchConv1D(nn.Module):
  """A 1-D convolution as patch extraction + ``nn.Dense``: ``nn.Conv``'s function, matmuls only.

  Input ``(batch, length, channels)``; zero padding ``padding`` on both sides. With
  ``kernel = conv_kernel.reshape(kernel_size * channels, features)`` it equals
  ``nn.Conv(features, (kernel_size,), strides=stride, padding=padding)``.
  """

  features: int
  kernel_size: int
  stride: int = 1
  padding: int = 0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    length = x.shape[1]
    x = jnp.pad(x, ((0, 0), (self.padding, self.padding), (0, 0)))
    out = (length + 2 * self.padding - self.kernel_size) // self.stride + 1
    span = self.stride * (out - 1) + 1
    # Strided slices, not a gather: a gather's gradient is a scatter, slow on CPU.
    patches = jnp.concatenate(
      [x[:, j : j + span : self.stride] for j in range(self.kernel_size)], axis=-1
    )  # (batch, out, kernel_size * channels), kernel-offset major like nn.Conv's kernel
    return nn.Dense(self.features)(patches)


class CNN1D(nn.Module):
  """Greydanus's MNIST-1D CNN: three stride-2 convolutions (25 channels), ReLU, a linear head."""

  channels: int = 25
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim == 2:
      x = x[..., None]
    x = nn.relu(PatchConv1D(self.channels, 5, stride=2, padding=1)(x))
    x = nn.relu(PatchConv1D(self.channels, 3, stride=2, padding=1)(x))
    x = nn.relu(PatchConv1D(self.channels, 3, stride=2, padding=1)(x))
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


@functools.lru_cache(maxsize=2)
def _mnist1d(num_samples: int) -> dict:
  from mnist1d.data import get_dataset_args
  from mnist1d.data import make_dataset

  args = get_dataset_args()
  args.num_samples = num_samples
  return make_dataset(args)  # generated locally; never mnist1d's downloading get_dataset


def load_mnist1d(label_noise: float, seed: int, num_samples: int = 5000) -> demo.Digits:
  """MNIST-1D made locally (80/20 split), optionally with the demo's label noise."""
  data = _mnist1d(num_samples)
  rng = np.random.default_rng(seed)
  y_train = np.asarray(data["y"], np.int32).copy()
  noisy = rng.random(len(y_train)) < label_noise
  y_train[noisy] = (y_train[noisy] + rng.integers(1, 10, noisy.sum())) % 10
  return demo.Digits(
    np.asarray(data["x"], np.float32),
    y_train,
    np.asarray(data["x_test"], np.float32),
    np.asarray(data["y_test"], np.int32),
  )


@dataclasses.dataclass(frozen=True)
class Task:
  """A data set, its model, its training budget and its tuning grids."""

  name: str
  model: nn.Module
  load: Callable[[float, int], demo.Digits]
  noise_levels: tuple[float, ...]
  batch_size: int
  epochs: int
  lr_grid: tuple[float, ...]
  rho_grid: tuple[float, ...]
  msam_rho_grid: tuple[float, ...]


def tasks(mode: Literal["full", "quick"]) -> dict[str, Task]:
  """The benchmark's data sets; ``"quick"`` shrinks MNIST-1D and the epochs."""
  quick = mode == "quick"
  return {
    "digits": Task(
      "digits",
      demo.MLP(),
      demo.load_digits,
      (0.2, 0.4),
      batch_size=64,
      epochs=2 if quick else 60,
      lr_grid=(1.25e-4, 2.5e-4, 5e-4, 1e-3),
      rho_grid=(0.1, 0.2, 0.4, 0.8),
      msam_rho_grid=(0.1, 0.3, 1.0, 3.0),
    ),
    "mnist1d": Task(
      "mnist1d",
      CNN1D(),
      functools.partial(load_mnist1d, num_samples=500 if quick else 5000),
      (0.0,),
      batch_size=100,
      epochs=2 if quick else 50,
      lr_grid=(1e-2, 2e-2, 4e-2, 8e-2),
      rho_grid=(0.05, 0.1, 0.2, 0.4),
      msam_rho_grid=(0.1, 0.3, 1.0, 3.0),
    ),
  }


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass(frozen=True)
class HParams:
  """What a contender factory may read; lr and rho may be traced (runs are vmapped)."""

  lr: Any
  rho: Any
  alpha: Any
  num_steps: int
  key: jax.Array


@dataclasses.dataclass(frozen=True)
class Contender:
  """An optimizer factory, how its ``update`` is called, and whose tuned values it uses.

  Attributes:
    make: ``(base_optimizer, hparams) -> optimizer``.
    hparams: the tuned values it uses: ``"base"``, ``"sam"``, ``"gsam"`` or ``"msam"``.
    protocol: ``"loss_fn"`` calls ``update(grads, state, params, loss_fn=loss_fn,
      value=loss)``; ``"no_clean"`` passes zeros instead of a clean gradient (and
      skips the clean pass); ``"plain"`` calls ``update(grads, state, params)``.
    branches: the static branches its steps take (``"full"``: ``perturb=True``,
      ``"cheap"``: ``perturb=False``; ``()`` for the base optimizer, ``(None,)``
      for a transform without a branch).
    requires: names ``optax_gsam`` must export; without them the contender is left out.
    cheap_policy: counts for target (a).
  """

  make: Callable[[optax.GradientTransformation, HParams], optax.GradientTransformation]
  hparams: str
  protocol: Literal["loss_fn", "no_clean", "plain"] = "loss_fn"
  branches: tuple[str | None, ...] = ("full",)
  requires: tuple[str, ...] = ()
  cheap_policy: bool = True


def late_rho(rho: Any, num_steps: int) -> optax.Schedule:
  """0 for the first :data:`LATE_START` of the steps, ``rho`` after."""
  start = int(LATE_START * num_steps)
  return lambda count: jnp.where(count >= start, rho, 0.0)


def _sam_with(policy: Callable[[HParams], Any], rho=lambda hp: hp.rho) -> Callable:
  return lambda base, hp: optax.chain(optax_gsam.sam(rho(hp), policy=policy(hp)), base)


def _every_k(k: int) -> Contender:
  return Contender(
    _sam_with(lambda hp: optax_gsam.every_k_policy(k)),
    "sam",
    branches=("full", "cheap"),
    requires=("every_k_policy",),
  )


CONTENDERS: dict[str, Contender] = {
  "base": Contender(lambda base, hp: base, "base", "plain", (), cheap_policy=False),
  "sam": Contender(
    lambda base, hp: optax.chain(optax_gsam.sam(hp.rho), base), "sam", cheap_policy=False
  ),
  "gsam": Contender(
    lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha), base),
    "gsam",
    cheap_policy=False,
  ),
  "every-2": _every_k(2),
  "every-5": _every_k(5),
  "every-10": _every_k(10),
  "adaptive": Contender(
    _sam_with(
      lambda hp: optax_gsam.gradient_norm_policy(optax.linear_schedule(-1.0, 1.0, hp.num_steps))
    ),
    "sam",
    branches=("full", "cheap"),
    requires=("gradient_norm_policy",),
  ),
  "random": Contender(
    _sam_with(lambda hp: optax_gsam.random_policy(RANDOM_PROBABILITY, key=hp.key)),
    "sam",
    branches=("full", "cheap"),
    requires=("random_policy",),
  ),
  "late-phase": Contender(
    _sam_with(
      lambda hp: optax_gsam.every_step_policy(skip_zero_rho=True),
      rho=lambda hp: late_rho(hp.rho, hp.num_steps),
    ),
    "sam",
    branches=("full", "cheap"),
    requires=("every_step_policy",),
  ),
  "momentum-sam": Contender(
    lambda base, hp: optax.chain(optax_gsam.momentum_sam(hp.rho), base),
    "msam",
    "no_clean",
    (None,),
    requires=("momentum_sam",),
  ),
}

# Chosen on the validation split by the last full run (pareto.json's "tuned"); --no-tune uses them.
DEFAULTS: dict[str, dict[float, dict[str, dict[str, float]]]] = {
  "digits": {
    0.2: {
      "base": {"lr": 5e-4, "rho": 0.0},
      "sam": {"lr": 5e-4, "rho": 0.2},
      "gsam": {"lr": 5e-4, "rho": 0.2},
      "msam": {"lr": 5e-4, "rho": 1.0},
    },
    0.4: {
      "base": {"lr": 2.5e-4, "rho": 0.0},
      "sam": {"lr": 2.5e-4, "rho": 0.1},
      "gsam": {"lr": 2.5e-4, "rho": 0.1},
      "msam": {"lr": 2.5e-4, "rho": 0.1},
    },
  },
  "mnist1d": {
    0.0: {
      "base": {"lr": 4e-2, "rho": 0.0},
      "sam": {"lr": 4e-2, "rho": 0.1},
      "gsam": {"lr": 4e-2, "rho": 0.05},
      "msam": {"lr": 4e-2, "rho": 1.0},
    },
  },
}


def available(contenders: dict[str, Contender]) -> dict[str, Contender]:
  """The contenders whose ``requires`` the installed ``optax_gsam`` exports."""
  return {
    name: c for name, c in contenders.items() if all(hasattr(optax_gsam, r) for r in c.requires)
  }


# ----------------------------------------------------------------------------- training


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _update(tx, contender: Contender, grads, opt_state, params, loss_fn, loss, perturb=None):
  if contender.protocol == "plain":
    return tx.update(grads, opt_state, params)
  extra = {"loss_fn": loss_fn, "value": loss}
  if perturb is not None:
    extra["perturb"] = perturb
  return tx.update(grads, opt_state, params, **extra)


def _value_and_grad(contender: Contender, loss_fn: Callable, params: Any):
  if contender.protocol == "no_clean":  # the transform ignores the values: no clean pass
    return jnp.zeros([], jnp.float32), optax.tree.zeros_like(params)
  return jax.value_and_grad(loss_fn)(params)


def full_steps(opt_state: Any, contender: Contender, num_steps: int) -> jax.Array:
  """Full (perturbed) steps taken: ``GSAMState.full_steps``; every step for a branchless transform."""
  if not contender.branches:
    return jnp.zeros([], jnp.int32)
  if contender.branches == (None,):
    return jnp.asarray(num_steps, jnp.int32)
  return optax.tree.get(opt_state, "full_steps")


def make_train(
  contender: Contender, task: Task, x_train: np.ndarray, x_eval: np.ndarray
) -> tuple[Callable, int]:
  """A jitted, vmapped ``(lr, rho, alpha, key, y_train, y_eval) -> metrics``, and its steps."""
  model = task.model
  n = len(x_train)
  steps_per_epoch = n // task.batch_size
  num_steps = task.epochs * steps_per_epoch
  unit_schedule = optax.warmup_cosine_decay_schedule(
    0.0, 1.0, max(1, num_steps // 20), num_steps, end_value=0.01
  )
  x_train, x_eval = jnp.asarray(x_train), jnp.asarray(x_eval)

  def train_one(lr, rho, alpha, key, y_train, y_eval):
    base = optax.adamw(lambda count: lr * unit_schedule(count), weight_decay=WEIGHT_DECAY)
    init_key, data_key, policy_key = jax.random.split(key, 3)
    tx = contender.make(base, HParams(lr, rho, alpha, num_steps, policy_key))
    params = model.init(init_key, x_train[:1])
    opt_state = tx.init(params)

    def step(carry, idx):
      params, opt_state = carry
      x, y = x_train[idx], y_train[idx]
      loss_fn = lambda p: cross_entropy(model.apply(p, x), y)
      loss, grads = _value_and_grad(contender, loss_fn, params)
      updates, opt_state = _update(tx, contender, grads, opt_state, params, loss_fn, loss)
      return (optax.apply_updates(params, updates), opt_state), None

    def epoch(carry, epoch_key):
      order = jax.random.permutation(epoch_key, n)[: steps_per_epoch * task.batch_size]
      carry, _ = jax.lax.scan(step, carry, order.reshape(steps_per_epoch, task.batch_size))
      return carry, None

    (params, opt_state), _ = jax.lax.scan(
      epoch, (params, opt_state), jax.random.split(data_key, task.epochs)
    )
    predictions = jnp.argmax(model.apply(params, x_eval), axis=-1)
    return {
      "accuracy": jnp.mean(predictions == y_eval),
      "train_loss": cross_entropy(model.apply(params, x_train), y_train),
      "full_steps": full_steps(opt_state, contender, num_steps),
    }

  return jax.jit(jax.vmap(train_one)), num_steps


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: its data, seed and hyperparameters."""

  noise: float
  seed: int
  lr: float
  rho: float
  alpha: float = 0.0


def run_batch(
  contender: Contender,
  task: Task,
  runs: list[Run],
  *,
  validation: bool,
  compiler_options: dict | None = None,
) -> tuple[list[dict], int]:
  """Trains every run of one contender together; one metrics dict per run, and the steps.

  With ``validation``, the model trains on 80% of the training set and is
  evaluated on the other 20% (labels as noisy as the training labels);
  otherwise it trains on the whole training set and is evaluated on the test set.
  """
  datasets = [task.load(r.noise, r.seed) for r in runs]
  first = datasets[0]
  if validation:
    order = np.random.default_rng(0).permutation(len(first.y_train))
    cut = int(0.8 * len(order))
    train_idx, eval_idx = order[:cut], order[cut:]
    x_train, x_eval = first.x_train[train_idx], first.x_train[eval_idx]
    y_train = np.stack([d.y_train[train_idx] for d in datasets])
    y_eval = np.stack([d.y_train[eval_idx] for d in datasets])
  else:
    x_train, x_eval = first.x_train, first.x_test
    y_train = np.stack([d.y_train for d in datasets])
    y_eval = np.stack([d.y_test for d in datasets])
  train, num_steps = make_train(contender, task, x_train, x_eval)
  as_array = lambda field: jnp.asarray([getattr(r, field) for r in runs], jnp.float32)
  keys = jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in runs]))
  inputs = (as_array("lr"), as_array("rho"), as_array("alpha"), keys, y_train, y_eval)
  out = train.lower(*inputs).compile(compiler_options)(*inputs)
  out = jax.tree.map(np.asarray, out)
  return [{k: v[i].item() for k, v in out.items()} for i in range(len(runs))], num_steps


# ----------------------------------------------------------------------------- tuning


def tune(
  task: Task, contenders: dict[str, Contender], seeds: int, compiler_options: dict | None = None
) -> tuple[dict, dict]:
  """Per noise level: the base lr, then SAM's, GSAM's (and momentum-SAM's) rho at that lr.

  Returns the chosen values (``{noise: {"base"|"sam"|"gsam"|"msam": {"lr", "rho"}}}``) and
  the whole sweep.
  """
  sweep: dict[str, list[dict]] = {}

  def evaluate(name: str, grid: dict[float, list[tuple[float, float]]]) -> dict[float, dict]:
    runs = [
      Run(noise, s, lr, rho, GSAM_ALPHA if name == "gsam" else 0.0)
      for noise, points in grid.items()
      for lr, rho in points
      for s in range(seeds)
    ]
    metrics, _ = run_batch(
      contenders[name], task, runs, validation=True, compiler_options=compiler_options
    )
    best: dict[float, dict] = {}
    for i in range(0, len(runs), seeds):
      run = runs[i]
      acc = float(np.mean([m["accuracy"] for m in metrics[i : i + seeds]]))
      point = {"noise": run.noise, "lr": run.lr, "rho": run.rho, "val_accuracy": acc}
      sweep.setdefault(name, []).append(point)
      print(
        f"  tune {task.name} noise={run.noise:g} {name:12s} lr={run.lr:g} rho={run.rho:g}: "
        f"val acc {100 * acc:.2f}%"
      )
      if run.noise not in best or acc > best[run.noise]["val_accuracy"]:
        best[run.noise] = point
    return best

  noises = task.noise_levels
  lr = evaluate("base", {n: [(lr, 0.0) for lr in task.lr_grid] for n in noises})
  chosen = {n: {"base": {"lr": lr[n]["lr"], "rho": 0.0}} for n in noises}
  grids = {"sam": ("sam", task.rho_grid), "gsam": ("gsam", task.rho_grid)}
  if "momentum-sam" in contenders:
    grids["msam"] = ("momentum-sam", task.msam_rho_grid)
  for key, (name, rho_grid) in grids.items():
    best = evaluate(name, {n: [(lr[n]["lr"], rho) for rho in rho_grid] for n in noises})
    for n in noises:
      chosen[n][key] = {"lr": best[n]["lr"], "rho": best[n]["rho"]}
  return chosen, sweep


# ----------------------------------------------------------------------------- step cost


@dataclasses.dataclass
class Timed:
  """One jitted step and its live state, for interleaved timing."""

  compiled: Any
  params: Any
  opt_state: Any
  flops: float

  def run(self, x: jax.Array, y: jax.Array, steps: int) -> float:
    """Runs ``steps`` steps; returns seconds per step."""
    start = time.perf_counter()
    for _ in range(steps):
      self.params, self.opt_state, loss = self.compiled(self.params, self.opt_state, x, y)
    loss.block_until_ready()
    jax.block_until_ready(self.params)
    return (time.perf_counter() - start) / steps


def compile_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  contender: Contender,
  params: Any,
  x: jax.Array,
  y: jax.Array,
  perturb: bool | None,
  compiler_options: dict | None = None,
) -> Timed:
  """One contender's train step with its branch fixed statically, compiled and warmed up."""

  def step(params, opt_state, x, y):
    loss_fn = lambda p: cross_entropy(model.apply(p, x), y)
    loss, grads = _value_and_grad(contender, loss_fn, params)
    updates, opt_state = _update(tx, contender, grads, opt_state, params, loss_fn, loss, perturb)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.copy, params)
  opt_state = tx.init(params)
  compiled = jax.jit(step).lower(params, opt_state, x, y).compile(compiler_options)
  timed = Timed(compiled, params, opt_state, step_cost.hlo_stats(compiled)["flops"])
  timed.run(x, y, 2)
  return timed


def interleaved_ratios(
  timed: dict[str, Timed], base: str, x: jax.Array, y: jax.Array, *, rounds: int, steps: int
) -> dict[str, dict[str, float]]:
  """Median ms per step and median ratio to the base step, each sample paired with a base run.

  Every round visits the steps in a fresh random order and times each right next to
  a run of the base step (before it on even rounds, after it on odd ones), so a
  ratio compares two runs a few milliseconds apart: the load of a shared machine
  changes faster than a whole round.
  """
  others = [name for name in timed if name != base]
  times: dict[str, list[float]] = {name: [] for name in timed}
  ratios: dict[str, list[float]] = {name: [] for name in others}
  shuffle = random.Random(0)
  for i in range(rounds):
    shuffle.shuffle(others)
    for name in others:
      if i % 2 == 0:
        base_time = timed[base].run(x, y, steps)
        time_ = timed[name].run(x, y, steps)
      else:
        time_ = timed[name].run(x, y, steps)
        base_time = timed[base].run(x, y, steps)
      times[base].append(base_time)
      times[name].append(time_)
      ratios[name].append(time_ / base_time)
  out = {base: {"ms": 1e3 * float(np.median(times[base])), "ratio": 1.0, "flops_ratio": 1.0}}
  for name in others:
    out[name] = {
      "ms": 1e3 * float(np.median(times[name])),
      "ratio": float(np.median(ratios[name])),
      "flops_ratio": timed[name].flops / timed[base].flops,
    }
  return out


def branch_costs(
  task: Task,
  contenders: dict[str, Contender],
  hparams: dict[str, dict[str, float]],
  num_steps: int,
  *,
  rounds: int,
  steps: int,
  compiler_options: dict | None = None,
) -> dict[str, dict[str, float]]:
  """Per ``"contender/branch"``: the static step's median ratio to the base step (and ms, flops)."""
  data = task.load(0.0, 0)
  x = jnp.asarray(data.x_train[: task.batch_size])
  y = jnp.asarray(data.y_train[: task.batch_size])
  params = task.model.init(jax.random.key(0), x[:1])
  base = optax.adamw(1e-3, weight_decay=WEIGHT_DECAY)
  compile_ = functools.partial(compile_step, compiler_options=compiler_options)
  timed = {"base": compile_(task.model, base, CONTENDERS["base"], params, x, y, None)}
  for name, contender in contenders.items():
    hp = hparams[contender.hparams]
    tx = contender.make(
      base, HParams(hp["lr"], hp["rho"], GSAM_ALPHA, num_steps, jax.random.key(0))
    )
    for branch in contender.branches:
      perturb = None if branch is None else branch == "full"
      timed[f"{name}/{branch}"] = compile_(task.model, tx, contender, params, x, y, perturb)
  return interleaved_ratios(timed, "base", x, y, rounds=rounds, steps=steps)


def step_cost_of(
  contender: Contender, costs: dict[str, dict[str, float]], name: str, n_full: float, n: int
) -> dict[str, float]:
  """``(n_full t_full + n_cheap t_cheap) / (N t_base)``, in time and in FLOPs."""
  if not contender.branches:
    return {"step_cost": 1.0, "flops_cost": 1.0}
  if contender.branches == (None,):
    only = costs[f"{name}/None"]
    return {"step_cost": only["ratio"], "flops_cost": only["flops_ratio"]}
  full = costs[f"{name}/full"]
  cheap = costs.get(f"{name}/cheap", full)  # no cheap branch: every step is full
  n_cheap = n - n_full
  return {
    "step_cost": (n_full * full["ratio"] + n_cheap * cheap["ratio"]) / n,
    "flops_cost": (n_full * full["flops_ratio"] + n_cheap * cheap["flops_ratio"]) / n,
    "full_ratio": full["ratio"],
    "cheap_ratio": cheap["ratio"],
    "full_ms": full["ms"],
    "cheap_ms": cheap["ms"],
    "base_ms": costs["base"]["ms"],
  }


# ----------------------------------------------------------------------------- ViT overhead


def vit_overhead(
  contenders: dict[str, Contender],
  *,
  smoke: bool,
  rounds: int,
  steps: int,
  compiler_options: dict | None = None,
) -> list[dict]:
  """On step_cost.py's ViT-tiny: each policy's cheap step (``perturb=False``) vs the base step."""
  workload = next(
    w for w in step_cost.workloads("smoke" if smoke else "full") if w.name == "vit-tiny"
  )
  key_x, key_y, key_init = jax.random.split(jax.random.key(0), 3)
  shape = (workload.batch_size, workload.image_size, workload.image_size, 3)
  x = jax.random.normal(key_x, shape)
  y = jax.random.randint(key_y, (workload.batch_size,), 0, 10)
  params = workload.model.init(key_init, x[:1])
  base = step_cost.base_optimizer()
  hp = HParams(1e-3, step_cost.HParams.rho, 0.0, 1000, jax.random.key(0))
  compile_ = functools.partial(compile_step, compiler_options=compiler_options)
  timed = {"base": compile_(workload.model, base, CONTENDERS["base"], params, x, y, None)}
  cheap_kind = {}
  for name, contender in contenders.items():
    if "cheap" not in contender.branches:
      continue
    tx = contender.make(base, hp)
    timed[name] = compile_(workload.model, tx, contender, params, x, y, False)
    cheap_kind[name] = "reuse" if name.startswith("every-") else "clean"
  ratios = interleaved_ratios(timed, "base", x, y, rounds=rounds, steps=steps)
  return [
    {
      "model": workload.name,
      "contender": name,
      "cheap": cheap_kind[name],
      "ms_per_step": ratios[name]["ms"],
      "base_ms_per_step": ratios["base"]["ms"],
      "ratio_to_base": ratios[name]["ratio"],
      "flops_ratio_to_base": ratios[name]["flops_ratio"],
    }
    for name in cheap_kind
  ]


# ----------------------------------------------------------------------------- reporting


def summarize(
  task: Task,
  noise: float,
  contenders: dict[str, Contender],
  metrics: dict[str, list[dict]],
  costs: dict[str, dict[str, float]],
  num_steps: int,
  hparams: dict[str, dict[str, float]],
) -> list[dict]:
  """One row per contender at one (data set, noise level)."""
  rows = []
  for name, contender in contenders.items():
    runs = metrics[name]
    acc = np.array([m["accuracy"] for m in runs], np.float64)
    n_full = float(np.mean([m["full_steps"] for m in runs]))
    rows.append(
      {
        "dataset": task.name,
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
        "lr": hparams[contender.hparams]["lr"],
        "rho": hparams[contender.hparams]["rho"],
        "accuracies": acc.tolist(),
      }
    )
  return rows


def check_targets(
  rows: list[dict], contenders: dict[str, Contender], overhead: list[dict]
) -> list[dict]:
  """Targets (a), (b) and (c) of issue 12."""
  checks = []
  for dataset, noise in dict.fromkeys((r["dataset"], r["noise"]) for r in rows):
    here = {r["contender"]: r for r in rows if (r["dataset"], r["noise"]) == (dataset, noise)}
    where = f"{dataset} {100 * noise:.0f}% noise"
    if "sam" in here:
      bar = here["sam"]["acc_mean"] - here["sam"]["acc_std"]
      winners = [
        name
        for name, r in here.items()
        if contenders[name].cheap_policy and r["acc_mean"] >= bar and r["step_cost"] <= COST_LIMIT
      ]
      checks.append(
        {
          "target": f"(a) {where}: a cheap policy with acc >= SAM mean - std "
          f"({100 * bar:.2f}%) at step cost <= {COST_LIMIT}",
          "value": ", ".join(winners) or "none",
          "met": bool(winners),
        }
      )
    if "late-phase" in here:
      value = here["late-phase"]["step_cost"]
      checks.append(
        {
          "target": f"(b) {where}: late-phase step cost <= {LATE_LIMIT}",
          "value": f"{value:.3f}",
          "met": bool(value <= LATE_LIMIT),
        }
      )
  for row in overhead:
    if row["cheap"] == "clean":
      checks.append(
        {
          "target": f"(c) {row['model']}: {row['contender']} cheap step / base <= {OVERHEAD_LIMIT}",
          "value": f"{row['ratio_to_base']:.3f}",
          "met": bool(row["ratio_to_base"] <= OVERHEAD_LIMIT),
        }
      )
  return checks


def format_table(rows: list[dict]) -> str:
  """A plain-text table of :func:`summarize`'s rows."""
  cells = [("dataset", "noise", "contender", "test acc %", "step cost", "full %", "flops cost")]
  for r in rows:
    cells.append(
      (
        r["dataset"],
        f"{100 * r['noise']:.0f}%",
        r["contender"],
        f"{100 * r['acc_mean']:.2f} ± {100 * r['acc_std']:.2f}",
        f"{r['step_cost']:.3f}",
        "-" if r["full_fraction"] is None else f"{100 * r['full_fraction']:.1f}",
        f"{r['flops_cost']:.3f}",
      )
    )
  return render_table(cells)


def format_overhead(rows: list[dict]) -> str:
  cells = [("model", "cheap step of", "cheap", "ms/step", "base ms/step", "/ base", "flops / base")]
  for r in rows:
    cells.append(
      (
        r["model"],
        r["contender"],
        r["cheap"],
        f"{r['ms_per_step']:.2f}",
        f"{r['base_ms_per_step']:.2f}",
        f"{r['ratio_to_base']:.3f}",
        f"{r['flops_ratio_to_base']:.3f}",
      )
    )
  return render_table(cells)


def plot(rows: list[dict], path: Path) -> None:
  """Test accuracy (mean ± std) against step cost, one panel per data set and noise level."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = list(dict.fromkeys((r["dataset"], r["noise"]) for r in rows))
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0), squeeze=False)
  for ax, (dataset, noise) in zip(axes[0], panels, strict=True):
    here = [r for r in rows if (r["dataset"], r["noise"]) == (dataset, noise)]
    sam = next((r for r in here if r["contender"] == "sam"), None)
    if sam is not None:
      ax.axhspan(
        100 * (sam["acc_mean"] - sam["acc_std"]),
        100 * (sam["acc_mean"] + sam["acc_std"]),
        color="tab:orange",
        alpha=0.12,
        label="SAM ± std",
      )
    ax.axvline(COST_LIMIT, color="k", ls="--", lw=0.8, label=f"{COST_LIMIT}x base")
    # A contender far below the rest is drawn on the bottom edge, its accuracy in the label.
    top = max(100 * r["acc_mean"] for r in here)
    near = [r for r in here if 100 * r["acc_mean"] >= top - 8]
    floor = min(100 * (r["acc_mean"] - r["acc_std"]) for r in near) - 0.5
    for r in here:
      acc, label, marker = 100 * r["acc_mean"], r["contender"], "o"
      if acc < floor:
        acc, label, marker = floor, f"{label} ({acc:.1f}%, off scale)", "v"
        ax.plot(r["step_cost"], acc, marker, ms=6)
      else:
        ax.errorbar(r["step_cost"], acc, yerr=100 * r["acc_std"], fmt=marker, capsize=3, ms=5)
      ax.annotate(
        label, (r["step_cost"], acc), textcoords="offset points", xytext=(4, 4), fontsize=7
      )
    ax.set_ylim(floor - 0.3, None)
    ax.set_xlabel("step cost / base step")
    ax.set_ylabel("test accuracy % (mean ± std over seeds)")
    ax.set_title(f"{dataset}, {100 * noise:.0f}% label noise")
    ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the tables, writes JSON (and a PNG unless ``--no-plot``)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smoke run: small data, 2 epochs")
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=None, help="override every data set's epochs")
  parser.add_argument("--datasets", nargs="*", default=None, help="subset of digits, mnist1d")
  parser.add_argument("--noise", type=float, nargs="*", default=None, help="subset of noise levels")
  parser.add_argument("--contenders", nargs="*", default=None, help=f"subset of {list(CONTENDERS)}")
  parser.add_argument("--no-tune", action="store_true", help="use DEFAULTS (always in --quick)")
  parser.add_argument("--no-vit", action="store_true", help="skip the ViT cheap-step overhead")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
  parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else argv
  mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 5)
  rounds = args.rounds or (2 if args.quick else 60)
  tune_enabled = not (args.quick or args.no_tune)
  options = QUICK_COMPILER_OPTIONS if args.quick else None
  start = time.perf_counter()

  wanted = {n: c for n, c in CONTENDERS.items() if not args.contenders or n in args.contenders}
  contenders = available(wanted)
  missing = sorted(set(wanted) - set(contenders))
  if missing:
    print(f"left out (not in this optax_gsam): {missing}")
  selected = [t for name, t in tasks(mode).items() if not args.datasets or name in args.datasets]
  if args.epochs:
    selected = [dataclasses.replace(t, epochs=args.epochs) for t in selected]
  print(
    f"pareto, {mode} mode: {seeds} seeds; tuning {'on validation' if tune_enabled else 'off'}; "
    f"contenders {list(contenders)}"
  )

  rows: list[dict] = []
  tuned: dict[str, dict] = {}
  sweeps: dict[str, dict] = {}
  for task in selected:
    noises = tuple(n for n in task.noise_levels if args.noise is None or n in args.noise)
    if not noises:
      continue
    task = dataclasses.replace(task, noise_levels=noises)
    if tune_enabled:
      tuning = {**contenders, **{k: CONTENDERS[k] for k in ("base", "sam", "gsam")}}
      chosen, sweeps[task.name] = tune(task, tuning, TUNE_SEEDS, options)
    else:
      chosen = {n: DEFAULTS[task.name][n] for n in noises}
    tuned[task.name] = {str(n): v for n, v in chosen.items()}
    metrics: dict[float, dict[str, list[dict]]] = {n: {} for n in noises}
    num_steps = 0
    for name, contender in contenders.items():
      t0 = time.perf_counter()
      runs = []
      for n in noises:
        hp = chosen[n][contender.hparams]
        alpha = GSAM_ALPHA if contender.hparams == "gsam" else 0.0
        runs += [Run(n, s, hp["lr"], hp["rho"], alpha) for s in range(seeds)]
      out, num_steps = run_batch(contender, task, runs, validation=False, compiler_options=options)
      for run, m in zip(runs, out, strict=True):
        metrics[run.noise].setdefault(name, []).append(m)
      print(
        f"  {task.name} {name}: {len(runs)} runs of {num_steps} steps, {time.perf_counter() - t0:.0f} s"
      )
    # Step cost of each branch, once per model (the timed steps do not depend on the noise).
    costs = branch_costs(
      task,
      contenders,
      chosen[noises[0]],
      num_steps,
      rounds=rounds,
      steps=5 if args.quick else 20,
      compiler_options=options,
    )
    for n in noises:
      rows += summarize(task, n, contenders, metrics[n], costs, num_steps, chosen[n])

  overhead = []
  if not args.no_vit:
    overhead = vit_overhead(
      contenders,
      smoke=args.quick,
      rounds=2 if args.quick else 100,  # single-step pairs: their ratios agree within 1.2%
      steps=1,
      compiler_options=options,
    )
  checks = check_targets(rows, contenders, overhead)
  print(format_table(rows))
  if overhead:
    print(format_overhead(overhead))
  for check in checks:
    print(f"{check['target']}: {check['value']} -> {'met' if check['met'] else 'MISSED'}")
  seconds = time.perf_counter() - start
  print(f"{seconds:.0f} s")

  result = {
    "benchmark": "pareto",
    "mode": mode,
    "command": " ".join(["python", "benchmarks/pareto.py", *argv]),
    "seconds": seconds,
    "seeds": seeds,
    "timing_rounds": rounds,
    "tuned": tuned,
    "tuning": {"validation": tune_enabled, "seeds": TUNE_SEEDS, "sweep": sweeps},
    "left_out": missing,
    "machine": machine(),
    "code": code_version(),
    "rows": rows,
    "vit_cheap_step": overhead,
    "targets": checks,
  }
  args.out_dir.mkdir(parents=True, exist_ok=True)
  stem = "pareto" + ("" if mode == "full" else f"_{mode}")
  (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
  if not args.no_plot and rows:
    plot(rows, args.out_dir / f"{stem}.png")
  return result


if __name__ == "__main__":
  main()
