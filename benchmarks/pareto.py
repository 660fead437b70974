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
each contender keeps. ``--base sgd`` swaps AdamW for SGD with momentum.

    python benchmarks/pareto.py                     # full: tuning, 5 seeds (~60 min, 2 cores)
    python benchmarks/pareto.py --quick             # smoke run: small MNIST-1D, 2 epochs, DEFAULTS
    python benchmarks/pareto.py --no-tune --seeds 3 # the full run without tuning
    python benchmarks/pareto.py --joint --base sgd --tune-seeds 2 --no-vit   # ~60 min, 2 cores

Writes ``results/pareto[_quick][_joint][_sgd].json`` (``rows``: base_optimizer,
dataset, noise, contender, acc_mean, acc_std, seeds, step_cost, base_steps, ...;
``gain_shares``) and a PNG.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam
from optax_gsam import demo

import harness
from harness import Contender
from harness import before_base
from models import CNN1D
from models import ViT
from models import load_mnist1d

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
  # Directions (issue 27), each at its own tuned values.
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
# What the default run trains: every contender but the joint run's additions.
DEFAULT_CONTENDERS = tuple(
  name
  for name in CONTENDERS
  if name not in {"friendly-sam", "vasso", "sam-2step", "sam-on", "every-20", "late-phase-5"}
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


def joint_grids() -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
  """Per key, the rho (and alpha) grid of --joint; the learning rate is JOINT_LR_GRIDS'."""
  keyed = {k: JOINT_RHO_GRIDS.get(k, JOINT_RHO_GRIDS["sam"]) for k in TUNED_WITH if k != "base"}
  return {k: (rho, (GSAM_ALPHA,) if k.startswith("gsam") else (0.0,)) for k, rho in keyed.items()}


def grids(dataset: str) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
  rho = RHO_GRIDS[dataset]
  return {
    "sam": (rho, (0.0,)),
    "gsam": (rho, (GSAM_ALPHA,)),
    "gsam-lr": (rho, (GSAM_ALPHA,)),
    "msam": (MSAM_RHO_GRID, (0.0,)),
  }


def _tuned(lr: float, sam: float, gsam: float, gsam_lr: float, msam: float) -> dict:
  """One noise level's tuned values: the shared learning rate and each key's rho."""
  rhos = {"base": 0.0, "sam": sam, "gsam": gsam, "gsam-lr": gsam_lr, "msam": msam}
  alpha = {"gsam": GSAM_ALPHA, "gsam-lr": GSAM_ALPHA}
  return {k: {"lr": lr, "rho": rho, "alpha": alpha.get(k, 0.0)} for k, rho in rhos.items()}


# Chosen on the validation split by the last full run (pareto.json's "tuned"); --no-tune uses them.
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
  """Per ``"contender/branch"``: its static step's median ratio to the base step (and ms, flops)."""
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
  return harness.interleaved(timed, "base", paired=True, **timing)


def step_cost_of(
  contender: Contender, costs: dict[str, dict[str, float]], name: str, n_full: float, n: int
) -> dict[str, float]:
  """``(n_full t_full + n_cheap t_cheap) / (N t_base)``, in time, FLOPs and gradient evaluations.

  ``base_steps`` counts gradient evaluations per step against the base's one: a full step
  takes ``contender.evaluations``, a cheap step one.
  """
  if not contender.branches:
    return {"step_cost": 1.0, "flops_cost": 1.0, "base_steps": 1.0}
  if contender.branches == (None,):
    only = costs[f"{name}/None"]
    return {
      "step_cost": only["ratio"],
      "flops_cost": only["flops_ratio"],
      "base_steps": float(contender.evaluations),
    }
  full = costs[f"{name}/full"]
  cheap = costs.get(f"{name}/cheap", full)  # no cheap branch: every step is full
  weigh = lambda key: (n_full * full[key] + (n - n_full) * cheap[key]) / n
  return {
    "step_cost": weigh("ratio"),
    "flops_cost": weigh("flops_ratio"),
    "base_steps": (n_full * contender.evaluations + (n - n_full)) / n,
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


def check_targets(
  rows: list[dict], contenders: dict[str, Contender], overhead: list[dict]
) -> list[dict]:
  """Targets (a) to (d) (benchmarks/README.md)."""
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
      target = f"(a) {where}: a cheap policy with acc >= SAM mean - std ({100 * bar:.2f}%) at step cost <= {COST_LIMIT}"
      checks.append(harness.check(target, ", ".join(winners) or "none", bool(winners)))
    if "base" in here:  # (d): no cheap policy may end below base - 2 std (issue 27)
      floor = here["base"]["acc_mean"] - 2 * here["base"]["acc_std"]
      low = [
        f"{name} {100 * r['acc_mean']:.2f}%"
        for name, r in here.items()
        if contenders[name].cheap_policy and r["acc_mean"] < floor
      ]
      target = f"(d) {where}: every cheap policy's acc >= base mean - 2 std ({100 * floor:.2f}%)"
      checks.append(harness.check(target, ", ".join(low) or "all", not low))
    if "late-phase" in here:
      value = here["late-phase"]["step_cost"]
      checks.append(
        harness.check(
          f"(b) {where}: late-phase step cost <= {LATE_LIMIT}", value, value <= LATE_LIMIT
        )
      )
  for row in overhead:
    if row["cheap"] == "clean":
      value = row["ratio_to_base"]
      target = f"(c) {row['model']}: {row['contender']} cheap step / base <= {OVERHEAD_LIMIT}"
      checks.append(harness.check(target, value, value <= OVERHEAD_LIMIT))
  return checks


def gain_shares(rows: list[dict]) -> list[dict]:
  """Per (base, data set, noise): SAM's gain over the base, and the share each policy keeps.

  The share is ``(acc_policy - acc_base) / (acc_sam - acc_base)`` (mean accuracies); SAM's
  gain counts as real when it exceeds the larger of the two standard deviations.
  """
  out = []
  settings = dict.fromkeys((r["base_optimizer"], r["dataset"], r["noise"]) for r in rows)
  for setting in settings:
    here = {
      r["contender"]: r for r in rows if (r["base_optimizer"], r["dataset"], r["noise"]) == setting
    }
    if not {"base", "sam"} <= set(here):
      continue
    base, sam = here["base"], here["sam"]
    gain = sam["acc_mean"] - base["acc_mean"]
    shares = {
      name: {
        # No gain to keep: no share (a negative gain would flip its sign).
        "share": (r["acc_mean"] - base["acc_mean"]) / gain if gain > 0 else None,
        "base_steps": r["base_steps"],
      }
      for name, r in here.items()
      if name not in ("base", "sam")
    }
    out.append(
      {
        "base_optimizer": setting[0],
        "dataset": setting[1],
        "noise": setting[2],
        "sam_gain": gain,
        "gain_std": max(base["acc_std"], sam["acc_std"]),
        "seeds": min(base["seeds"], sam["seeds"]),
        "shares": shares,
      }
    )
  return out


def check_gain_shares(shares: list[dict], contenders: dict[str, Contender]) -> list[dict]:
  """Target (e): where SAM beats the base by > 1 std, a policy at <= 1.05 base steps keeps 90%."""
  kept = []
  for s in shares:
    if s["sam_gain"] <= s["gain_std"] or s.get("seeds", 2) < 2:  # one seed has no std
      continue
    winners = [
      f"{name} {100 * v['share']:.0f}%"
      for name, v in s["shares"].items()
      if contenders[name].cheap_policy
      and v["base_steps"] <= GAIN_COST_LIMIT + 1e-9
      and v["share"] is not None
      and v["share"] >= GAIN_SHARE
    ]
    kept.append((f"{s['base_optimizer']} {s['dataset']} {100 * s['noise']:.0f}%", winners))
  target = (
    f"(e) settings where SAM beats the base by > 1 std and a policy at <= {GAIN_COST_LIMIT}"
    f" base steps keeps >= {100 * GAIN_SHARE:.0f}% of its gain: at least 2"
  )
  value = "; ".join(f"{where}: {', '.join(w) or 'none'}" for where, w in kept) or "no such setting"
  return [harness.check(target, value, sum(bool(w) for _, w in kept) >= 2)]


def format_shares(shares: list[dict]) -> str:
  names = list(dict.fromkeys(n for s in shares for n in s["shares"]))
  cells = [("base", "dataset", "noise", "SAM gain", "std", *names)]
  for s in shares:
    cells.append(
      (
        s["base_optimizer"],
        s["dataset"],
        f"{100 * s['noise']:.0f}%",
        f"{100 * s['sam_gain']:+.2f}",
        f"{100 * s['gain_std']:.2f}",
        *(
          "-"
          if n not in s["shares"] or s["shares"][n]["share"] is None
          else f"{100 * s['shares'][n]['share']:.0f}%"
          for n in names
        ),
      )
    )
  return harness.render_table(cells)


def format_table(rows: list[dict]) -> str:
  cells = [
    (
      "base",
      "dataset",
      "noise",
      "contender",
      "test acc %",
      "step cost",
      "base steps",
      "full %",
      "flops cost",
      "noise fitted %",
      "lr",
      "rho",
    )
  ]
  for r in rows:
    cells.append(
      (
        r["base_optimizer"],
        r["dataset"],
        f"{100 * r['noise']:.0f}%",
        r["contender"],
        harness.mean_std(r["accuracies"], 100),
        f"{r['step_cost']:.3f}",
        f"{r['base_steps']:.3f}",
        "-" if r["full_fraction"] is None else f"{100 * r['full_fraction']:.1f}",
        f"{r['flops_cost']:.3f}",
        "-" if r["noise"] == 0 else f"{100 * r['noise_fitted_mean']:.1f}",
        f"{r['lr']:.3g}",
        f"{r['rho']:.3g}",
      )
    )
  return harness.render_table(cells)


def format_overhead(rows: list[dict]) -> str:
  keys = (
    "model",
    "contender",
    "cheap",
    "ms_per_step",
    "base_ms_per_step",
    "ratio_to_base",
    "flops_ratio_to_base",
  )
  cells = [("model", "cheap step of", "cheap", "ms/step", "base ms/step", "/ base", "flops / base")]
  for r in rows:
    cells.append(tuple(f"{r[k]:.3f}" if isinstance(r[k], float) else r[k] for k in keys))
  return harness.render_table(cells)


def plot(rows: list[dict], path: Path, x_key: str = "step_cost") -> None:
  """Test accuracy (mean ± std) against ``x_key``, one panel per base, data set and noise level.

  ``x_key``: ``"step_cost"`` (measured time per base step) or ``"base_steps"`` (gradient
  evaluations per base step).
  """
  limit = COST_LIMIT if x_key == "step_cost" else GAIN_COST_LIMIT
  x_label = "step cost / base step" if x_key == "step_cost" else "gradient evaluations / base step"
  panel = lambda r: (r.get("base_optimizer", "adamw"), r["dataset"], r["noise"])
  panels = list(dict.fromkeys(panel(r) for r in rows))
  cols = min(3, len(panels))
  nrows = -(-len(panels) // cols)
  fig, axes = harness.figure(nrows, cols, figsize=(4.6 * cols, 4.0 * nrows), squeeze=False)
  for ax in axes.flat[len(panels) :]:
    ax.axis("off")
  for ax, (base, dataset, noise) in zip(axes.flat, panels, strict=False):
    here = [r for r in rows if panel(r) == (base, dataset, noise)]
    sam = next((r for r in here if r["contender"] == "sam"), None)
    if sam is not None:
      band = (100 * (sam["acc_mean"] - sam["acc_std"]), 100 * (sam["acc_mean"] + sam["acc_std"]))
      ax.axhspan(*band, color="tab:orange", alpha=0.12, label="SAM ± std")
    base_row = next((r for r in here if r["contender"] == "base"), None)
    if base_row is not None:
      band = (
        100 * (base_row["acc_mean"] - base_row["acc_std"]),
        100 * (base_row["acc_mean"] + base_row["acc_std"]),
      )
      ax.axhspan(*band, color="tab:gray", alpha=0.12, label="base ± std")
    ax.axvline(limit, color="k", ls="--", lw=0.8, label=f"{limit}x base")
    # A contender far below the rest is drawn on the bottom edge, its accuracy in the label.
    top = max(100 * r["acc_mean"] for r in here)
    floor = (
      min(100 * (r["acc_mean"] - r["acc_std"]) for r in here if 100 * r["acc_mean"] >= top - 8)
      - 0.5
    )
    for r in here:
      acc, label = 100 * r["acc_mean"], r["contender"]
      if acc < floor:
        acc, label = floor, f"{label} ({acc:.1f}%, off scale)"
        ax.plot(r[x_key], acc, "v", ms=6)
      else:
        ax.errorbar(r[x_key], acc, yerr=100 * r["acc_std"], fmt="o", capsize=3, ms=5)
      ax.annotate(label, (r[x_key], acc), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_ylim(floor - 0.3, None)
    ax.set_xlabel(x_label)
    ax.set_ylabel("test accuracy % (mean ± std over seeds)")
    ax.set_title(f"{base}, {dataset}, {100 * noise:.0f}% label noise")
    ax.legend(fontsize=7, loc="lower right")
  harness.save_figure(fig, path)


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


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the tables, writes JSON (and a PNG unless ``--no-plot``)."""
  args = parse_args(argv)
  if not args.joint and (args.base != "adamw" or "mnist1d-ln" in (args.datasets or ())):
    raise SystemExit("--base sgd and mnist1d-ln have grids only under --joint: add --joint.")
  if args.replot:  # also the gain shares and target (e) over all the files' rows
    png, files = args.replot
    rows = [r for f in files.split(",") for r in json.loads(Path(f).read_text())["rows"]]
    plot(rows, Path(png), x_key="base_steps")
    shares = gain_shares(rows)
    print(format_shares(shares))
    summary = {"files": files.split(","), "gain_shares": shares}
    summary["targets"] = check_gain_shares(shares, CONTENDERS)
    Path(png).with_name(f"{Path(png).stem}_shares.json").write_text(
      json.dumps(summary, indent=2) + "\n"
    )
    return summary
  mode = "quick" if args.quick else "full"
  seeds = args.seeds or (2 if args.quick else 5)
  rounds = args.rounds or (2 if args.quick else 60)
  # --joint tunes unless --no-tune (JOINT_DEFAULTS), even with --quick; the rest tune unless
  # --quick or --no-tune (DEFAULTS).
  tune_enabled = not args.no_tune if args.joint else not (args.quick or args.no_tune)
  options = QUICK_COMPILER_OPTIONS if args.quick else None
  start = time.perf_counter()
  names = args.contenders or (JOINT_CONTENDERS if args.joint else DEFAULT_CONTENDERS)
  wanted = {n: c for n, c in CONTENDERS.items() if n in names}
  contenders = harness.available(wanted)
  # Results of another base or of --joint go to their own files: pareto[_quick][_joint][_sgd].json
  suffix = ("_joint" if args.joint else "") + ("" if args.base == "adamw" else f"_{args.base}")
  missing = sorted(set(wanted) - set(contenders))
  print(
    f"pareto, {mode}: {seeds} seeds; tuning {'on validation' if tune_enabled else 'off'}; {list(contenders)}; left out (not in this optax_gsam): {missing}"
  )

  rows, tuned, sweeps = [], {}, {}
  by_name = tasks(mode, args.base)
  datasets = args.datasets or (["mnist1d-ln"] if args.joint else ["digits", "mnist1d"])
  for task in (by_name[name] for name in datasets):  # in the order given
    noises = tuple(n for n in task.noise_levels if args.noise is None or n in args.noise)
    if not noises:
      continue
    task = dataclasses.replace(task, noise_levels=noises, epochs=args.epochs or task.epochs)
    if tune_enabled:
      keys = {"base"} | {c.hparams for c in contenders.values()}
      tuning = {k: CONTENDERS[TUNED_WITH[k]] for k in TUNED_WITH if k in keys}
      all_grids = joint_grids() if args.joint else grids(task.name)
      task_grids = {k: g for k, g in all_grids.items() if k in keys}
      lr_grid = JOINT_LR_GRIDS[args.base] if args.joint else LR_GRIDS[task.name]
      chosen, sweeps[task.name] = harness.tune(
        task,
        tuning,
        lr_grid,
        task_grids,
        seeds=args.tune_seeds,
        joint=args.joint,
        compiler_options=options,
      )
    elif args.joint:
      chosen = {n: JOINT_DEFAULTS[args.base][n] for n in noises}
    else:
      chosen = {n: DEFAULTS[task.name][n] for n in noises}
    tuned[task.name] = {str(n): v for n, v in chosen.items()}
    rows += run_task(task, contenders, chosen, seeds, rounds=rounds, quick=args.quick)
    partial = {"partial": True, "seeds": seeds, "tuned": tuned, "sweep": sweeps, "rows": rows}
    harness.save("pareto", mode, partial, args.out_dir, argv, suffix=f"{suffix}_partial")

  print(format_table(rows))
  overhead = []
  if not args.no_vit:  # single-step pairs: their ratios agree within 1.2%, 3-step samples' by 5%
    overhead = vit_overhead(
      contenders,
      quick=args.quick,
      base_kind=args.base,
      rounds=2 if args.quick else 100,
      steps=1,
      compiler_options=options,
    )
    print(format_overhead(overhead))
  shares = gain_shares(rows)
  if shares:
    print("Share of SAM's gain over the base that each contender keeps:")
    print(format_shares(shares))
  checks = check_targets(rows, contenders, overhead)
  if args.joint:
    checks += check_gain_shares(shares, contenders)
  seconds = time.perf_counter() - start
  print(f"{seconds:.0f} s")
  result = {
    "seconds": seconds,
    "seeds": seeds,
    "timing_rounds": rounds,
    "tuned": tuned,
    "base_optimizer": args.base,
    "joint_tuning": args.joint,
    "tuning": {"validation": tune_enabled, "seeds": args.tune_seeds, "sweep": sweeps},
    "left_out": missing,
    "rows": rows,
    "gain_shares": shares,
    "vit_cheap_step": overhead,
    "targets": checks,
  }
  x_key = "base_steps" if args.joint else "step_cost"
  draw = None if args.no_plot or not rows else functools.partial(plot, rows, x_key=x_key)
  return harness.save("pareto", mode, result, args.out_dir, argv, draw, suffix=suffix)


if __name__ == "__main__":
  main()
