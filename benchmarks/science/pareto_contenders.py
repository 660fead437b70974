"""pareto.py's contenders, data sets, tuning grids and the tuned values its runs train with.

``CONTENDERS`` is the table of everything pareto.py can train: SAM and GSAM from the
harness, the cheap-step policies, momentum-SAM, the ascent directions, and SAF and MESA. ``DEFAULTS``
and ``JOINT_DEFAULTS`` are what the last tuning runs chose (``--no-tune`` trains with
them).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam
from optax_gsam import demo

from benchmarks import harness
from benchmarks.harness import Contender
from benchmarks.harness import before_base
from benchmarks.models import CNN1D
from benchmarks.models import load_mnist1d

GSAM_ALPHA = 0.3
LATE_START = 0.75  # late-phase SAM: rho = 0 before this fraction of the steps
RANDOM_PROBABILITY = 0.5
TUNE_SEEDS = 3
COST_LIMIT = 1.15  # target (a)
LATE_LIMIT = 1.05  # target (b)
OVERHEAD_LIMIT = 1.03  # target (c)
GAIN_COST_LIMIT = 1.05  # target (e): gradient evaluations per base step
GAIN_SHARE = 0.9  # target (e): the share of SAM's gain over the base kept
# --quick compiles with LLVM's optimizations off: half the compile time, slower steps.
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
MSAM_RHO_GRID = (0.03, 0.1, 0.3, 1.0, 2.0)  # momentum-SAM's rho lives on its own scale
# SAF and MESA (harness.Trajectory: tau = 5, SAF's lag 3 epochs, the term from 10% of the epochs
# on, all static): the rho slot carries lambda, MESA's alpha slot its EMA decay. Three points
# each, as every key's rho grid, so that --joint gives them the same 3 x 3 budget: SAF tunes
# lambda around the authors' 0.3; MESA keeps their lambda 0.8 and tunes the decay, whose
# ImageNet 0.9998 (a 5000-step horizon) would barely move in a 2000-step run: 0.99 averages
# over 100 steps (2.5 epochs, SAF's lag), 0.999 over 1000.
TRAJECTORY_GRIDS = {
  "saf": ((0.1, 0.3, 1.0), (0.0,)),
  "mesa": ((0.8,), (0.99, 0.995, 0.999)),
}


def tasks(mode: str, base: str = "adamw") -> dict[str, harness.Task]:
  """The data sets; ``"quick"`` shrinks MNIST-1D and the epochs.

  ``mnist1d-ln`` is MNIST-1D with a LayerNorm after each convolution (``CNN1D(norm=True)``),
  the model of the joint-tuning run: SAM-ON needs normalization layers to perturb.
  """
  quick = mode == "quick"
  mnist1d = functools.partial(load_mnist1d, num_samples=500 if quick else 5000)
  epochs = 2 if quick else 50
  return {
    "digits": harness.Task(
      "digits", demo.MLP(), demo.load_digits, (0.2, 0.4), 64, 2 if quick else 60, base
    ),
    "mnist1d": harness.Task("mnist1d", CNN1D(), mnist1d, (0.0, 0.2, 0.4), 100, epochs, base),
    "mnist1d-ln": harness.Task(
      "mnist1d-ln", CNN1D(norm=True), mnist1d, (0.0, 0.2, 0.4), 100, epochs, base
    ),
  }


LR_GRIDS = {"digits": (1.25e-4, 2.5e-4, 5e-4, 1e-3), "mnist1d": (1e-2, 2e-2, 4e-2, 8e-2)}
RHO_GRIDS = {"digits": (0.1, 0.2, 0.4, 0.8), "mnist1d": (0.05, 0.1, 0.2, 0.4)}
# --joint: every key tunes (lr, rho) over 3 x 3 points; the base gets 9 learning rates.
JOINT_LR_GRIDS = {"adamw": (1e-2, 2.8e-2, 8e-2), "sgd": (2.5e-2, 7.5e-2, 0.225)}
JOINT_RHO_GRIDS = {
  "sam": (0.05, 0.1, 0.2),
  # SAM-ON perturbs the 150 LayerNorm parameters alone; its paper's radii are larger.
  "sam-on": (0.2, 0.5, 1.0),
  "msam": (0.1, 0.3, 1.0),  # docs/policies.md: start at 0.3, then try 0.1 and 1
}


def late_rho(rho: Any, num_steps: int, start: float = LATE_START) -> optax.Schedule:
  """0 for the first ``start`` share of the steps, ``rho`` after."""
  first = int(start * num_steps)
  return lambda count: jnp.where(count >= first, rho, 0.0)


def _policy(policy, rho=lambda hp: hp.rho, requires: str = "", key: str = "sam") -> Contender:
  """SAM with the cheap-step policy ``policy(hparams)``, at the tuned values of ``key``."""
  return Contender(
    before_base(lambda hp: optax_gsam.sam(rho(hp), policy=policy(hp))),
    key,
    branches=("full", "cheap"),
    requires=(requires,) if requires else (),
    cheap_policy=True,
  )


def _sam(key: str, evaluations: int = 2, **options) -> Contender:
  """``optax_gsam.sam(rho, **options)`` at the tuned values of ``key``."""
  return Contender(
    before_base(lambda hp: optax_gsam.sam(hp.rho, **options)), key, evaluations=evaluations
  )


CONTENDERS: dict[str, Contender] = {
  **harness.CONTENDERS,
  **{f"every-{k}": _policy(lambda hp, k=k: optax_gsam.every_k_policy(k)) for k in (2, 5, 10)},
  # LookSAM's own rescaling, to a fixed share of the gradient (globally, per leaf), with the guard.
  **{
    f"every-5-{scale}": _policy(
      lambda hp, scale=scale: optax_gsam.every_k_policy(5, reuse_scale=scale)
    )
    for scale in ("global", "per_leaf")
  },
  # Every 10 without reuse, and with reuse only on the two steps after each full step.
  "every-10-clean": _policy(lambda hp: optax_gsam.every_k_policy(10, cheap="clean")),
  "every-10-reuse-2": _policy(
    lambda hp: optax_gsam.every_k_policy(
      10, reuse_weight=lambda count: jnp.where(count % 10 <= 2, 0.7, 0.0)
    )
  ),
  "adaptive": _policy(
    lambda hp: optax_gsam.gradient_norm_policy(optax.linear_schedule(-1.0, 1.0, hp.num_steps))
  ),
  "random": _policy(lambda hp: optax_gsam.random_policy(RANDOM_PROBABILITY, key=hp.key)),
  "late-phase": _policy(
    lambda hp: optax_gsam.every_step_policy(skip_zero_rho=True),
    rho=lambda hp: late_rho(hp.rho, hp.num_steps),
  ),
  "momentum-sam": Contender(
    before_base(lambda hp: optax_gsam.momentum_sam(hp.rho)),
    "msam",
    "no_clean",
    (None,),
    requires=("momentum_sam",),
    cheap_policy=True,
    evaluations=1,
  ),
  # Directions, each at its own tuned values.
  "friendly-sam": _sam("friendly-sam", ascent=optax_gsam.friendly_ascent()),
  "vasso": _sam("vasso", ascent=optax_gsam.vasso_ascent()),
  "sam-2step": _sam("sam-2step", evaluations=3, ascent_steps=2),
  "sam-on": _sam("sam-on", mask=harness.norm_layers),
  # Policies at <= 1.05 gradient evaluations per base step, each tuned on its own.
  "every-20": _policy(lambda hp: optax_gsam.every_k_policy(20), key="every-20"),
  "late-phase-5": _policy(
    lambda hp: optax_gsam.every_step_policy(skip_zero_rho=True),
    rho=lambda hp: late_rho(hp.rho, hp.num_steps, start=0.95),
    key="late-5",
  ),
  # SAF (1 base step) and MESA (one extra forward pass a step), at their own tuned values.
  **harness.TRAJECTORY_CONTENDERS,
}
# Each of SAF and MESA beside the cheap sharpness-aware contenders at <= 1.05 gradient
# evaluations a step: "saf+momentum-sam", ..., "mesa+every-20", each at values of its own.
PAIRED_WITH = ("momentum-sam", "every-20")
TRAJECTORY_PAIRS: dict[str, Contender] = {
  f"{kind}+{name}": harness.with_trajectory(kind, CONTENDERS[name], key=f"{kind}+{name}")
  for kind in ("saf", "mesa")
  for name in PAIRED_WITH
}
CONTENDERS.update(TRAJECTORY_PAIRS)
# The trajectory knob each pair runs with, per base and noise level: what SAF's (lambda) and
# MESA's (EMA decay) own --joint tuning chose there (results/trajectory/pareto_joint[_sgd].json).
# A pair tunes its learning rate with its radius on the same 3 x 3 budget as everyone else.
TRAJECTORY_KNOBS: dict[str, dict[float, dict[str, float]]] = {
  "adamw": {
    0.0: {"saf": 0.3, "mesa": 0.995},
    0.2: {"saf": 0.3, "mesa": 0.999},
    0.4: {"saf": 1.0, "mesa": 0.999},
  },
  "sgd": {
    0.0: {"saf": 0.1, "mesa": 0.999},
    0.2: {"saf": 1.0, "mesa": 0.999},
    0.4: {"saf": 0.3, "mesa": 0.99},
  },
}
# --joint's contenders (on mnist1d-ln, whose LayerNorms SAM-ON perturbs); the rest of the
# policies reuse SAM's tuned values, as in the default run.
JOINT_CONTENDERS = (
  "base",
  "sam",
  "gsam",
  "friendly-sam",
  "vasso",
  "sam-2step",
  "sam-on",
  "momentum-sam",
  "every-20",
  "late-phase-5",
  "every-5",
  "every-5-per_leaf",
  "late-phase",
  "random",
)
# What the default run trains: every contender but the joint run's additions (and SAF and MESA,
# which have no tuned values yet: --contenders saf mesa, tuning on).
DEFAULT_CONTENDERS = tuple(
  name
  for name in CONTENDERS
  if name
  not in {"friendly-sam", "vasso", "sam-2step", "sam-on", "every-20", "late-phase-5"}
  | set(harness.TRAJECTORY_CONTENDERS)
  | set(TRAJECTORY_PAIRS)
)
# The contender each hyperparameter key is tuned with, and its (rho, alpha) grids per data set.
TUNED_WITH = {
  "base": "base",
  "sam": "sam",
  "gsam": "gsam",
  "gsam-lr": "gsam-lr",
  "msam": "momentum-sam",
  "friendly-sam": "friendly-sam",
  "vasso": "vasso",
  "sam-2step": "sam-2step",
  "sam-on": "sam-on",
  "every-20": "every-20",
  "late-5": "late-phase-5",
  "saf": "saf",
  "mesa": "mesa",
  **{name: name for name in TRAJECTORY_PAIRS},
}


def _chosen(**points: tuple[float, float]) -> dict[str, dict[str, float]]:
  """One noise level's jointly tuned values, ``key=(lr, rho)`` (``late_5`` for ``late-5``...)."""
  out = {}
  for name, (lr, rho) in points.items():
    key = name.replace("_", "-")
    out[key] = {"lr": lr, "rho": rho, "alpha": GSAM_ALPHA if key.startswith("gsam") else 0.0}
  return out


_BASE_LRS = np.geomspace(1e-2, 8e-2, 9).tolist()  # AdamW's 9 base learning rates under --joint
# What the last --joint run chose per base and noise level; --joint --no-tune trains with them.
JOINT_DEFAULTS: dict[str, dict[float, dict[str, dict[str, float]]]] = {
  "adamw": {
    0.0: _chosen(
      base=(_BASE_LRS[6], 0.0),
      sam=(0.028, 0.05),
      gsam=(0.028, 0.1),
      msam=(0.028, 0.1),
      friendly_sam=(0.028, 0.05),
      vasso=(0.01, 0.05),
      sam_2step=(0.028, 0.05),
      sam_on=(0.028, 0.2),
      every_20=(0.028, 0.05),
      late_5=(0.028, 0.05),
    ),
    0.2: _chosen(
      base=(0.08, 0.0),
      sam=(0.028, 0.2),
      gsam=(0.028, 0.2),
      msam=(0.08, 0.1),
      friendly_sam=(0.028, 0.2),
      vasso=(0.028, 0.1),
      sam_2step=(0.028, 0.2),
      sam_on=(0.01, 1.0),
      every_20=(0.08, 0.05),
      late_5=(0.08, 0.05),
    ),
    0.4: _chosen(
      base=(_BASE_LRS[7], 0.0),
      sam=(0.028, 0.2),
      gsam=(0.028, 0.1),
      msam=(0.08, 0.3),
      friendly_sam=(0.028, 0.2),
      vasso=(0.028, 0.1),
      sam_2step=(0.028, 0.2),
      sam_on=(0.028, 0.5),
      every_20=(0.08, 0.2),
      late_5=(0.028, 0.2),
    ),
  },
}


def joint_grids(base: str = "adamw") -> dict[str, tuple[tuple[float, ...], Any]]:
  """Per key, the rho (and alpha) grid of --joint; the learning rate is JOINT_LR_GRIDS'.

  SAF's and MESA's are their knobs' (``TRAJECTORY_GRIDS``), as many points. A pair's rho grid
  is its sharpness-aware contender's; its alpha, per noise level, is ``TRAJECTORY_KNOBS``'.
  """
  others = (
    k for k in TUNED_WITH if k != "base" and k not in TRAJECTORY_GRIDS and k not in TRAJECTORY_PAIRS
  )
  keyed = {k: JOINT_RHO_GRIDS.get(k, JOINT_RHO_GRIDS["sam"]) for k in others}
  alpha = lambda k: (GSAM_ALPHA,) if k.startswith("gsam") else (0.0,)
  paired = {}
  for name in TRAJECTORY_PAIRS:
    kind, beside = name.split("+")
    knobs = {noise: (values[kind],) for noise, values in TRAJECTORY_KNOBS[base].items()}
    paired[name] = (keyed[CONTENDERS[beside].hparams], knobs)
  return {**{k: (rho, alpha(k)) for k, rho in keyed.items()}, **TRAJECTORY_GRIDS, **paired}


def grids(dataset: str) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
  rho = RHO_GRIDS[dataset]
  return {
    "sam": (rho, (0.0,)),
    "gsam": (rho, (GSAM_ALPHA,)),
    "gsam-lr": (rho, (GSAM_ALPHA,)),
    "msam": (MSAM_RHO_GRID, (0.0,)),
    **TRAJECTORY_GRIDS,
  }


def _tuned(lr: float, sam: float, gsam: float, gsam_lr: float, msam: float) -> dict:
  """One noise level's tuned values: the shared learning rate and each key's rho."""
  rhos = {"base": 0.0, "sam": sam, "gsam": gsam, "gsam-lr": gsam_lr, "msam": msam}
  alpha = {"gsam": GSAM_ALPHA, "gsam-lr": GSAM_ALPHA}
  return {k: {"lr": lr, "rho": rho, "alpha": alpha.get(k, 0.0)} for k, rho in rhos.items()}


# Chosen on the validation split by an earlier full run (lr first, then rho); --no-tune uses them.
DEFAULTS: dict[str, dict[float, dict[str, dict[str, float]]]] = {
  "digits": {
    0.2: _tuned(1.25e-4, sam=0.1, gsam=0.1, gsam_lr=0.1, msam=0.03),
    0.4: _tuned(2.5e-4, sam=0.1, gsam=0.1, gsam_lr=0.1, msam=0.1),
  },
  "mnist1d": {
    0.0: _tuned(4e-2, sam=0.1, gsam=0.05, gsam_lr=0.05, msam=0.3),
    0.2: _tuned(8e-2, sam=0.05, gsam=0.05, gsam_lr=0.05, msam=0.1),
    0.4: _tuned(4e-2, sam=0.1, gsam=0.05, gsam_lr=0.05, msam=0.1),
  },
}
