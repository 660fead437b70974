"""What the benchmark scripts share: contenders, vmapped training, tuning and timing.

A script imports it as ``from benchmarks import harness``: scripts run from the repository root
as ``python -m benchmarks.<group>.<script>``, and pytest adds the root through ``pythonpath``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
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
from benchmarks.trajectory import Trajectory as Trajectory  # re-exported: contenders name it
from benchmarks.trajectory import timed_trajectory
from benchmarks.trajectory import trajectory_step
from benchmarks.trajectory import trajectory_store

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
    trajectory: SAF's or MESA's term (:func:`with_trajectory`): its step also takes the
      batch's example ids and the epoch, and a ``loss_fn`` it passes holds the term
      (``benchmarks.trajectory.trajectory_step``).
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


# MESA's lambda, the authors' (0.8): its own rows tune the EMA decay in the alpha slot.
MESA_WEIGHT = 0.8


def with_trajectory(
  kind: Literal["saf", "mesa"], beside: Contender | None = None, key: str | None = None
) -> Contender:
  """SAF or MESA on the base optimizer, or beside the sharpness-aware contender ``beside``.

  MESA's EMA is chained last, after everything (``optax_gsam.mesa_ema`` must be). Alone,
  lambda is the run's ``rho`` and MESA's decay its ``alpha``. Beside ``beside``, whose
  transform goes first and takes ``rho`` as its radius, SAF's lambda is ``alpha`` and MESA's
  is :data:`MESA_WEIGHT`, its decay still ``alpha``. The step keeps ``beside``'s protocol and
  branches; SAF beside a transform without a clean pass (momentum-SAM) records the logits of
  one extra forward pass, which counts as MESA's does.

  Args:
    kind: ``"saf"`` or ``"mesa"``.
    beside: the sharpness-aware contender, or ``None``.
    key: the tuned values it uses (default: ``kind``).
  """
  mesa = kind == "mesa"
  requires = ("mesa_ema",) if mesa else ("saf_store",)
  inner: Callable = lambda base, hp: base
  weight: Literal["rho", "alpha"] | float = "rho"
  protocol: Protocol = "plain"
  branches: tuple[str | None, ...] = (None,)  # timed as one step
  evaluations, forwards = 1, int(mesa)
  if beside is not None:
    if beside.protocol not in ("loss_fn", "no_clean"):
      raise ValueError(
        f"beside must take loss_fn (protocol 'loss_fn' or 'no_clean'), got {beside.protocol!r}:"
        " the trajectory term reaches the perturbed pass through loss_fn."
      )
    inner, weight = beside.make, MESA_WEIGHT if mesa else "alpha"
    protocol, branches, evaluations = beside.protocol, beside.branches, beside.evaluations
    forwards = int(mesa or beside.protocol == "no_clean")
    requires += beside.requires
  make = inner
  if mesa:
    make = lambda base, hp: optax.chain(inner(base, hp), optax_gsam.mesa_ema(hp.alpha))
  return Contender(
    make,
    key or kind,
    protocol,
    branches,
    requires=requires,
    cheap_policy=True,
    evaluations=evaluations,
    forwards=forwards,
    trajectory=Trajectory(kind, weight),
  )


# SAF and MESA (Du et al., 2022): the scripts add them to their own tables.
TRAJECTORY_CONTENDERS: dict[str, Contender] = {
  "saf": with_trajectory("saf"),
  "mesa": with_trajectory("mesa"),
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
    else:
      start_epoch = int(trajectory.start * task.epochs)
      weight = trajectory.weight_of(rho, alpha)
      step = trajectory_step(model, tx, trajectory, weight, start_epoch, contender.protocol)
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


# ----------------------------------------------------------------------------- timing


def _advance(compiled: Callable, x: jax.Array, y: jax.Array, state: tuple) -> tuple:
  return compiled(state[0], state[1], x, y)


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
    make_step, opt_state = timed_trajectory(
      model, tx, contender.trajectory, contender.protocol, params, opt_state, x
    )
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
