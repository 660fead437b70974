"""What the benchmark scripts share: contenders, vmapped training, tuning and timing.

A script imports it as ``from benchmarks import harness``: scripts run from the repository root
as ``python -m benchmarks.<group>.<script>``, and pytest adds the root through ``pythonpath``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam
from optax_gsam import demo

from benchmarks.reporting import (
  RESULTS_DIR as RESULTS_DIR,  # re-exported: scripts call harness.save & co.
)
from benchmarks.reporting import check as check
from benchmarks.reporting import code_version as code_version
from benchmarks.reporting import figure as figure
from benchmarks.reporting import machine as machine
from benchmarks.reporting import mean_std as mean_std
from benchmarks.reporting import parser as parser
from benchmarks.reporting import render_table as render_table
from benchmarks.reporting import save as save
from benchmarks.reporting import save_figure as save_figure
from benchmarks.timing import Timed as Timed  # re-exported, as reporting's names
from benchmarks.timing import hlo_stats as hlo_stats
from benchmarks.timing import interleaved as interleaved

WEIGHT_DECAY = 1e-4
# SGD with momentum as the SAM and Momentum-SAM papers run it (their CIFAR weight decay).
SGD_MOMENTUM = 0.9
SGD_WEIGHT_DECAY = 5e-4
BASES = ("adamw", "sgd")
# rho_min / rho_max of big_vision's ViT GSAM config (0.1 / 0.6, docs/big_vision_migration.md).
PAPER_RHO_MIN_RATIO = 0.1 / 0.6
cross_entropy = demo.cross_entropy


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass(frozen=True)
class HParams:
  """What a contender factory may read; under ``vmap`` lr, rho and alpha are traced.

  Attributes:
    lr: the peak learning rate.
    rho: the perturbation radius (for a rho schedule, its peak); SAF's and MESA's lambda.
    alpha: GSAM's surrogate-gap weight; MESA's EMA decay.
    num_steps: the steps of the run.
    key: a PRNG key for a policy that draws.
    unit_lr: the learning-rate schedule divided by its peak (``None``: constant).
  """

  lr: Any = 1e-3
  rho: Any = 0.05
  alpha: Any = 0.3
  num_steps: int = 1000
  key: jax.Array | None = None
  unit_lr: optax.Schedule | None = None


Protocol = Literal["loss_fn", "grad_fn", "no_clean", "plain"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """SAF's or MESA's trajectory term (docs/trajectory.md), added to the loss of a plain step.

  Its weight lambda is the run's ``rho``; MESA's EMA decay is its ``alpha`` (in the
  contender's ``make``). The rest is static.

  Attributes:
    kind: ``"saf"`` (a store of each example's logits, recorded ``lag_epochs`` epochs before,
      carried through the training scan and indexed by the batch's example ids) or
      ``"mesa"`` (the logits of the EMA weights: one extra forward pass a step).
    lag_epochs: SAF's Ẽ, static (the store's shape).
    start: E_start as a fraction of the epochs: the term applies from epoch
      ``int(start * epochs)`` on.
    temperature: tau (the authors: 5, untuned).
  """

  kind: Literal["saf", "mesa"]
  lag_epochs: int = 3
  start: float = 0.1
  temperature: float = 5.0


@dataclasses.dataclass(frozen=True)
class Contender:
  """An optimizer factory, how its ``update`` is called, and whose tuned values it uses.

  Attributes:
    make: ``(base_optimizer, hparams) -> optimizer``.
    hparams: the key of the tuned values it uses (``"base"``, ``"sam"``, ``"gsam"``, ...).
    protocol: ``"loss_fn"`` calls ``update(grads, state, params, loss_fn=loss_fn,
      value=loss)``; ``"grad_fn"`` passes ``grad_fn=lambda p, _: jax.grad(loss_fn)(p)``
      (``optax.contrib.sam``); ``"no_clean"`` is ``"loss_fn"`` with zeros for the clean
      gradient and no clean pass (momentum-SAM); ``"plain"`` passes nothing.
    branches: the static branches its steps take (``"full"``: ``perturb=True``, ``"cheap"``:
      ``perturb=False``; ``()`` for the base optimizer, ``(None,)`` for a transform without one).
    requires: names ``optax_gsam`` must export; without them the contender is left out.
    cheap_policy: whether it is a cheap-step policy (pareto.py's target (a)).
    evaluations: gradient evaluations of a full step (a cheap or base step takes one).
    forwards: extra forward passes a step (MESA's one); pareto.py counts each at its
      FLOPs' share of a gradient evaluation.
    trajectory: SAF's or MESA's term (``protocol="plain"``): its step also takes the
      batch's example ids and the epoch (:func:`trajectory_step`).
  """

  make: Callable[[optax.GradientTransformation, HParams], optax.GradientTransformation]
  hparams: str = "base"
  protocol: Protocol = "loss_fn"
  branches: tuple[str | None, ...] = ("full",)
  requires: tuple[str, ...] = ()
  cheap_policy: bool = False
  evaluations: int = 2
  forwards: int = 0
  trajectory: Trajectory | None = None


def before_base(transform: Callable[[HParams], optax.GradientTransformation]) -> Callable:
  """A contender factory that chains ``transform(hparams)`` before the base optimizer."""
  return lambda base, hp: optax.chain(transform(hp), base)


def paper_rho(hp: HParams) -> optax.ScalarOrSchedule:
  """GSAM's rho as its paper runs it: ``rho_from_lr`` from ``hp.rho`` down to a sixth of it.

  ``rho_from_lr`` is linear in the learning rate, so the schedule of the unit learning rate
  scaled by the (possibly traced) ``hp.rho`` is ``rho_from_lr(lr, rho, rho / 6)`` itself.
  """
  if hp.unit_lr is None:
    return hp.rho
  with jax.ensure_compile_time_eval():  # rho_from_lr reads the schedule's peak: not traced
    unit = optax_gsam.rho_from_lr(hp.unit_lr, 1.0, PAPER_RHO_MIN_RATIO, num_steps=hp.num_steps)
  return lambda count: hp.rho * unit(count)


CONTENDERS: dict[str, Contender] = {
  "base": Contender(lambda base, hp: base, "base", "plain", ()),
  "sam": Contender(before_base(lambda hp: optax_gsam.sam(hp.rho)), "sam"),
  "gsam": Contender(before_base(lambda hp: optax_gsam.gsam(hp.rho, hp.alpha)), "gsam"),
  "gsam-lr": Contender(before_base(lambda hp: optax_gsam.gsam(paper_rho(hp), hp.alpha)), "gsam-lr"),
}


def _trajectory_contender(trajectory: Trajectory) -> Contender:
  """SAF or MESA on the base optimizer (MESA's EMA chained last), at the tuned values of its kind."""
  if trajectory.kind == "mesa":
    make = lambda base, hp: optax.chain(base, optax_gsam.mesa_ema(hp.alpha))
  else:
    make = lambda base, hp: base
  mesa = trajectory.kind == "mesa"
  return Contender(
    make,
    trajectory.kind,
    "plain",
    (None,),  # timed as one step; base_steps: one gradient evaluation (+ MESA's forward)
    requires=("mesa_ema",) if mesa else ("saf_store",),
    cheap_policy=True,
    evaluations=1,
    forwards=int(mesa),
    trajectory=trajectory,
  )


# SAF and MESA (Du et al., 2022): the scripts add them to their own tables.
TRAJECTORY_CONTENDERS: dict[str, Contender] = {
  "saf": _trajectory_contender(Trajectory("saf")),
  "mesa": _trajectory_contender(Trajectory("mesa")),
}


def norm_layers(params: Any) -> Any:
  """SAM-ON's mask (Mueller et al., 2023): True on the leaves of Flax's ``LayerNorm`` modules."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: "LayerNorm" in jax.tree_util.keystr(path), params
  )


def available(contenders: dict[str, Contender]) -> dict[str, Contender]:
  """The contenders whose ``requires`` the installed ``optax_gsam`` exports."""
  return {
    name: c for name, c in contenders.items() if all(hasattr(optax_gsam, r) for r in c.requires)
  }


def base_optimizer(
  lr: optax.ScalarOrSchedule = 1e-3, kind: str = "adamw"
) -> optax.GradientTransformation:
  """The optimizer every contender wraps.

  ``"adamw"``: AdamW, weight decay 1e-4. ``"sgd"``: SGD with momentum 0.9 and weight
  decay 5e-4 added to the gradient before the momentum (PyTorch's ``SGD(weight_decay=)``).
  """
  if kind == "adamw":
    return optax.adamw(lr, weight_decay=WEIGHT_DECAY)
  if kind == "sgd":
    return optax.chain(
      optax.add_decayed_weights(SGD_WEIGHT_DECAY), optax.sgd(lr, momentum=SGD_MOMENTUM)
    )
  raise ValueError(f"base optimizer kind must be one of {BASES}, got {kind!r}")


def train_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  contender: Contender,
  perturb: bool | None = None,
) -> Callable:
  """``(params, opt_state, x, y) -> (params, opt_state, loss)``; ``perturb`` fixes the branch."""

  def step(params, opt_state, x, y):
    loss_fn = lambda p: cross_entropy(model.apply(p, x), y)
    if contender.protocol == "no_clean":  # the transform ignores the values: no clean pass
      loss, grads = jnp.zeros([], jnp.float32), optax.tree.zeros_like(params)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params)
    extra: dict[str, Any] = {}
    if contender.protocol == "grad_fn":
      extra = {"grad_fn": lambda p, _: jax.grad(loss_fn)(p)}
    elif contender.protocol != "plain":
      extra = {"loss_fn": loss_fn, "value": loss}
      if perturb is not None:
        extra["perturb"] = perturb
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def trajectory_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  trajectory: Trajectory,
  weight: Any,
  start_epoch: Any,
) -> Callable:
  """``(params, opt_state, store, x, y, ids, epoch) -> (params, opt_state, store, loss)``.

  The loss returned is the cross-entropy alone. SAF reads the batch's targets from ``store``
  (an ``optax_gsam.SAFStore``) and records the step's logits in it; MESA reads the EMA weights
  from ``opt_state`` (``store`` is ``()``, passed through) and adds one forward pass at them.
  """

  def step(params, opt_state, store, x, y, ids, epoch):
    if trajectory.kind == "saf":
      targets, valid = optax_gsam.saf_targets(store, ids, epoch, start_epoch=start_epoch)
    else:
      ema = optax.tree.get(opt_state, "ema_params")
      targets, valid = optax_gsam.mesa_targets(model.apply, ema, x), epoch >= start_epoch

    def loss_fn(p):
      logits = model.apply(p, x)
      ce = cross_entropy(logits, y)
      term = optax_gsam.trajectory_loss(
        logits, targets, temperature=trajectory.temperature, weight=weight, where=valid
      )
      return ce + term, (ce, logits)

    (_, (loss, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    if trajectory.kind == "saf":
      store = optax_gsam.saf_record(store, ids, logits, epoch)
    return optax.apply_updates(params, updates), opt_state, store, loss

  return step


def trajectory_store(trajectory: Trajectory, num_examples: int, num_classes: int) -> Any:
  """SAF's empty store of past logits; ``()`` for MESA, which keeps its EMA in ``opt_state``."""
  if trajectory.kind != "saf":
    return ()
  return optax_gsam.saf_store(num_examples, num_classes, lag_epochs=trajectory.lag_epochs)


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class Task:
  """A data set, the model trained on it and its training budget."""

  name: str
  model: nn.Module
  load: Callable[[float, int], demo.Digits]
  noise_levels: tuple[float, ...]
  batch_size: int
  epochs: int
  base: str = "adamw"  # the base optimizer's kind (base_optimizer)


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: its label noise, seed and hyperparameters."""

  noise: float
  seed: int
  lr: float
  rho: float
  alpha: float = 0.0


def _full_steps(opt_state: Any, contender: Contender, num_steps: int) -> jax.Array:
  if not contender.branches:
    return jnp.zeros([], jnp.int32)
  if contender.branches == (None,):
    return jnp.asarray(num_steps, jnp.int32)
  return optax.tree.get(opt_state, "full_steps")


def _tracked(track: Callable | None, batch_loss: Callable, key, train_set, track_every: int):
  """``track`` after every ``track_every``-th epoch under a ``lax.cond``, NaNs after the others.

  ``None`` without ``track``.
  """
  if track is None:
    return None

  def tracked(params, index):
    measure = lambda p: track(batch_loss, p, jax.random.fold_in(key, index), train_set)
    skip = lambda p: jax.tree.map(
      lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(measure, p)
    )
    return jax.lax.cond((index + 1) % track_every == 0, measure, skip, params)

  return tracked


def _noise_fitted(model, params, train_set, y_clean) -> jax.Array:
  """The share of the corrupted training labels that the model predicts."""
  x_train, y_train = train_set
  fitted = jnp.argmax(model.apply(params, x_train), axis=-1) == y_train
  corrupted = y_train != y_clean
  return jnp.sum(fitted & corrupted) / jnp.maximum(jnp.sum(corrupted), 1)


def _epoch(
  step: Callable, train_set, batch: int, evaluate, tracked, *, ids: bool = False
) -> Callable:
  """One epoch for ``lax.scan``: shuffled batches through ``step``, then the curves' points.

  With ``ids`` (SAF, MESA), ``step`` also takes the batch's example ids (its indices into the
  training set, the same in every epoch) and the epoch, and its carry the store (``carry[2]``).
  """
  x_train, y_train = train_set
  n = len(x_train)
  steps_per_epoch = n // batch

  def batch_step(carry, idx):
    params, opt_state, loss = step(*carry, x_train[idx], y_train[idx])
    return (params, opt_state), loss

  def batch_step_with_ids(index, carry, idx):
    params, opt_state, store, loss = step(*carry, x_train[idx], y_train[idx], idx, index)
    return (params, opt_state, store), loss

  def epoch(carry, inputs):
    epoch_key, index = inputs
    order = jax.random.permutation(epoch_key, n)[: steps_per_epoch * batch]
    body = functools.partial(batch_step_with_ids, index) if ids else batch_step
    carry, losses = jax.lax.scan(body, carry, order.reshape(steps_per_epoch, batch))
    out = evaluate(carry[0], losses) if evaluate is not None else ()
    return carry, (out, tracked(carry[0], index) if tracked is not None else {})

  return epoch


def make_train(
  contender: Contender,
  task: Task,
  x_train: np.ndarray,
  x_eval: np.ndarray,
  *,
  curves: bool = False,
  final_metrics: Callable | None = None,
  track: Callable | None = None,
  track_every: int = 10,
) -> tuple[Callable, int]:
  """A jitted, vmapped ``(lr, rho, alpha, key, y_train, y_eval, y_clean) -> metrics`` and its steps.

  The task's base optimizer (:func:`base_optimizer`) with a linear warmup (5% of the
  steps) and a cosine decay to 1% of the peak.
  ``final_metrics(loss_fn, params, key, train_set)`` adds entries measured after training,
  with ``loss_fn(params, (x, y))`` and ``train_set = (x_train, y_train)``;
  ``track`` (same arguments, a dict of scalars) is measured after every
  ``track_every``-th epoch, under a ``lax.cond`` (its predicate is not batched, so the
  other epochs skip it), into ``<name>_track`` curves with NaN at the epochs skipped.
  A contender with a ``trajectory`` (SAF, MESA) carries its store (per run) through the scan
  beside params and optimizer state, and its steps read the batch's example ids.
  """
  model, n, batch = task.model, len(x_train), task.batch_size
  steps_per_epoch = n // batch
  num_steps = task.epochs * steps_per_epoch
  unit_lr = optax.warmup_cosine_decay_schedule(
    0.0, 1.0, max(1, num_steps // 20), num_steps, end_value=0.01
  )
  x_train, x_eval = jnp.asarray(x_train), jnp.asarray(x_eval)

  def train_one(lr, rho, alpha, key, y_train, y_eval, y_clean):
    base = base_optimizer(lambda count: lr * unit_lr(count), task.base)
    init_key, data_key, extra_key = jax.random.split(key, 3)
    tx = contender.make(base, HParams(lr, rho, alpha, num_steps, extra_key, unit_lr))
    trajectory = contender.trajectory
    if trajectory is None:
      step = train_step(model, tx, contender)
    else:  # lambda is the run's rho
      step = trajectory_step(model, tx, trajectory, rho, int(trajectory.start * task.epochs))
    accuracy = lambda p: jnp.mean(jnp.argmax(model.apply(p, x_eval), axis=-1) == y_eval)
    batch_loss = lambda p, xy: cross_entropy(model.apply(p, xy[0]), xy[1])
    train_set = (x_train, y_train)
    full_loss = lambda p: batch_loss(p, train_set)
    tracked = _tracked(track, batch_loss, extra_key, train_set, track_every)
    evaluate = (lambda p, losses: (losses.mean(), accuracy(p))) if curves else None
    epoch = _epoch(step, train_set, batch, evaluate, tracked, ids=trajectory is not None)
    params = model.init(init_key, x_train[:1])
    epochs = (jax.random.split(data_key, task.epochs), jnp.arange(task.epochs))
    carry = (params, tx.init(params))
    if trajectory is not None:
      classes = jax.eval_shape(model.apply, params, x_train[:1]).shape[-1]
      carry += (trajectory_store(trajectory, n, classes),)
    carry, (curve, track_curves) = jax.lax.scan(epoch, carry, epochs)
    params, opt_state = carry[:2]
    out = {
      "accuracy": accuracy(params),
      "train_loss": full_loss(params),
      "noise_fitted": _noise_fitted(model, params, train_set, y_clean),
      "full_steps": _full_steps(opt_state, contender, num_steps),
    }
    if curves:
      out["train_loss_curve"], out["accuracy_curve"] = curve
    out.update({f"{name}_track": values for name, values in track_curves.items()})
    if final_metrics is not None:
      out.update(final_metrics(batch_loss, params, extra_key, train_set))
    return out

  return jax.jit(jax.vmap(train_one)), num_steps


def batch_inputs(task: Task, runs: list[Run], *, validation: bool) -> tuple[Any, Any, tuple]:
  """``x_train``, ``x_eval`` and the vmapped train function's inputs for ``runs`` (see run_batch)."""
  datasets = [task.load(r.noise, r.seed) for r in runs]
  first, clean = datasets[0], task.load(0.0, 0).y_train
  train_idx = eval_idx = slice(None)
  if validation:
    order = np.random.default_rng(0).permutation(len(clean))
    train_idx, eval_idx = order[: int(0.8 * len(order))], order[int(0.8 * len(order)) :]
  x_train = first.x_train[train_idx]
  x_eval = first.x_train[eval_idx] if validation else first.x_test
  y_eval = [d.y_train[eval_idx] if validation else d.y_test for d in datasets]
  as_array = lambda field: jnp.asarray([getattr(r, field) for r in runs], jnp.float32)
  inputs = (
    as_array("lr"),
    as_array("rho"),
    as_array("alpha"),
    jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in runs])),
    np.stack([d.y_train[train_idx] for d in datasets]),
    np.stack(y_eval),
    np.stack([clean[train_idx]] * len(runs)),
  )
  return x_train, x_eval, inputs


def run_batch(
  contender: Contender,
  task: Task,
  runs: list[Run],
  *,
  validation: bool,
  curves: bool = False,
  final_metrics: Callable | None = None,
  track: Callable | None = None,
  track_every: int = 10,
  compiler_options: dict | None = None,
  timings: dict | None = None,
) -> tuple[list[dict], int]:
  """Trains every run of one contender together; one metrics dict per run, and the steps.

  ``track``/``track_every``: see :func:`make_train`. ``timings``, when given, receives
  ``compile_s`` and ``run_s`` (the compiled program's execution alone).

  With ``validation``, the model trains on 80% of the training set (a fixed
  permutation) and is evaluated on the other 20%, whose labels are as noisy as the
  training labels; otherwise it trains on the whole training set and is evaluated
  on the clean test set.
  """
  x_train, x_eval, inputs = batch_inputs(task, runs, validation=validation)
  train, num_steps = make_train(
    contender,
    task,
    x_train,
    x_eval,
    curves=curves,
    final_metrics=final_metrics,
    track=track,
    track_every=track_every,
  )
  start = time.perf_counter()
  compiled = train.lower(*inputs).compile(compiler_options)
  compiled_at = time.perf_counter()
  out = jax.tree.map(np.asarray, jax.block_until_ready(compiled(*inputs)))
  if timings is not None:
    timings.update(compile_s=compiled_at - start, run_s=time.perf_counter() - compiled_at)
  return [{k: v[i].tolist() for k, v in out.items()} for i in range(len(runs))], num_steps


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
  grids: dict[str, tuple[Sequence[float], Sequence[float]]],
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
    grids: per key, its grid of rho values and its grid of alpha values.
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
  if joint and grids:
    sizes = {len(lr_grid) * len(rhos) * len(alphas) for rhos, alphas in grids.values()}
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
    points = {n: [(lr, r, a) for lr in lrs(n) for r in rhos for a in alphas] for n in noises}
    for n, point in evaluate(key, points).items():
      chosen[n][key] = point
  return chosen, sweep


# ----------------------------------------------------------------------------- timing


def _advance(compiled: Callable, x: jax.Array, y: jax.Array, state: tuple) -> tuple:
  return compiled(state[0], state[1], x, y)


def _timed_trajectory(model, tx, trajectory: Trajectory, params, opt_state, x) -> tuple:
  """SAF's or MESA's step as ``(params, state, x, y) -> (params, state, loss)`` for timing.

  ``state`` holds the optimizer state, the store (examples: the batch), the ids and the
  epoch, all traced as in training; the epoch (past ``start``) keeps the term on.
  """
  classes = jax.eval_shape(model.apply, params, x[:1]).shape[-1]
  store = trajectory_store(trajectory, len(x), classes)
  ids = jnp.arange(len(x), dtype=jnp.int32)
  state = (opt_state, store, ids, jnp.asarray(trajectory.lag_epochs, jnp.int32))
  inner = trajectory_step(model, tx, trajectory, 0.3, 0)

  def make_step(branch):
    def step(params, state, x, y):
      opt_state, store, ids, epoch = state
      params, opt_state, store, loss = inner(params, opt_state, store, x, y, ids, epoch)
      return params, (opt_state, store, ids, epoch), loss

    return step

  return make_step, state


def compile_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  contender: Contender,
  params: Any,
  x: jax.Array,
  y: jax.Array,
  *,
  perturb: bool | None = None,
  static_every: int = 0,
  donate: bool = False,
  compiler_options: dict | None = None,
) -> Timed:
  """One contender's train step on a fixed batch, compiled and warmed up.

  With ``static_every=k`` the cycle is one full step (``perturb=True``) and ``k - 1`` cheap
  ones (``perturb=False``), each a jitted step of its own; otherwise ``perturb`` fixes the
  branch of every step (``None``: the transform decides).
  """
  branches = [True] + [False] * (static_every - 1) if static_every else [perturb]
  params = jax.tree.map(jnp.copy, params)
  opt_state = tx.init(params)
  make_step = functools.partial(train_step, model, tx, contender)
  if contender.trajectory is not None:
    make_step, opt_state = _timed_trajectory(model, tx, contender.trajectory, params, opt_state, x)
  start = time.perf_counter()
  compiled = {}
  for branch in dict.fromkeys(branches):
    step = jax.jit(make_step(branch), donate_argnums=(0, 1) if donate else ())
    compiled[branch] = step.lower(params, opt_state, x, y).compile(compiler_options)
  compile_s = time.perf_counter() - start
  per_branch = {branch: hlo_stats(c) for branch, c in compiled.items()}
  stats = {k: float(np.mean([per_branch[b][k] for b in branches])) for k in per_branch[branches[0]]}
  cycle = tuple(functools.partial(_advance, compiled[b], x, y) for b in branches)
  timed = Timed(cycle, (params, opt_state, None), stats, compile_s)
  timed.run(2)  # warm up
  return timed
