"""Step cost of SAM and GSAM against the base optimizer and ``optax.contrib.sam``.

Every contender trains the same model on the same fixed batch in one process:

* ``base``: the base optimizer (AdamW) alone, one gradient evaluation;
* ``sam``: ``optax.chain(optax_gsam.sam(rho), base)``;
* ``gsam``: ``optax.chain(optax_gsam.gsam(rho, alpha), base)``;
* ``optax.contrib.sam``: ``optax.contrib.sam(base, optax.chain(normalize(), sgd(rho)),
  opaque_mode=True)`` called with ``grad_fn=lambda p, _: jax.grad(loss)(p)``.

The models are a ViT-tiny (4x4 patches of a 32x32 image, a few pre-LN transformer
blocks) and a small ResNet (GroupNorm, so no batch statistics), both sized so a
CPU step takes tens of milliseconds. The timer runs the contenders interleaved,
in a fresh random order every round, each for a few steps, and reports the
median over rounds of the time per step and of the per-round ratios to the base
step and to ``optax.contrib.sam`` (ratios taken within one round share the
machine's noise). Compile time is the wall time of ``lower().compile()``; the
FLOPs and bytes that XLA's cost analysis reports for the compiled step, and the
number of reduce instructions in its optimized HLO, are deterministic and show
where any extra time goes.

Targets (DESIGN.md, "Numbers that matter"): GSAM no slower than
``optax.contrib.sam`` (ratio <= 1.02) and at most 2.05x the base step.

Run ``python benchmarks/step_cost.py`` (about 10 minutes on 2 CPU cores) or
``--quick`` (about a minute). ``--donate`` donates params and optimizer state to
the jitted step for every contender alike. A table goes to stdout, JSON and a
PNG to ``benchmarks/results/``.

Add a contender with one line in ``CONTENDERS``, e.g.::

  "gsam_every4": Contender(lambda base, hp: optax.chain(
      optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=4), base)),
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import code_version
from _common import machine
from _common import render_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass(frozen=True)
class HParams:
  """What a contender factory may read."""

  rho: float = 0.05
  alpha: float = 0.3


@dataclasses.dataclass(frozen=True)
class Contender:
  """An optimizer factory and how its ``update`` is called.

  Attributes:
    make: ``(base_optimizer, hparams) -> optimizer``.
    protocol: ``"loss_fn"`` calls ``update(grads, state, params, loss_fn=loss_fn,
      value=loss)`` (optax_gsam); ``"grad_fn"`` calls it with
      ``grad_fn=lambda p, _: jax.grad(loss_fn)(p)`` (``optax.contrib.sam``);
      ``"plain"`` calls ``update(grads, state, params)``.
  """

  make: Callable[[optax.GradientTransformation, HParams], optax.GradientTransformation]
  protocol: Literal["loss_fn", "grad_fn", "plain"] = "loss_fn"
  static_every: int = 0  # > 0: one jitted step per branch, update(..., perturb=t % k == 0)


def _contrib_sam(base: optax.GradientTransformation, hp: HParams) -> optax.GradientTransformation:
  adversary = optax.chain(optax.contrib.normalize(), optax.sgd(hp.rho))
  return optax.contrib.sam(base, adversary, opaque_mode=True)


CONTENDERS: dict[str, Contender] = {
  "base": Contender(lambda base, hp: base, "plain"),
  "sam": Contender(lambda base, hp: optax.chain(optax_gsam.sam(hp.rho), base)),
  "gsam": Contender(lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha), base)),
  "optax.contrib.sam": Contender(_contrib_sam, "grad_fn"),
  "gsam k=5": Contender(
    lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=5), base)
  ),
  "gsam k=5 static": Contender(
    lambda base, hp: optax.chain(optax_gsam.gsam(hp.rho, hp.alpha, perturb_every=5), base),
    static_every=5,
  ),
}
BASELINE, REFERENCE = "base", "optax.contrib.sam"


def base_optimizer() -> optax.GradientTransformation:
  """The optimizer every contender wraps."""
  return optax.adamw(1e-3, weight_decay=1e-4)


# ----------------------------------------------------------------------------- models


class EncoderBlock(nn.Module):
  """Pre-LayerNorm transformer block: self-attention and a GELU MLP."""

  width: int
  heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
    y = nn.LayerNorm()(x)
    y = nn.Dense(self.width * self.mlp_ratio)(y)
    return x + nn.Dense(self.width)(nn.gelu(y))


class ViT(nn.Module):
  """A small Vision Transformer: patch embedding, learned positions, mean pooling."""

  patch: int = 4
  width: int = 96
  depth: int = 4
  heads: int = 3
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch, padding="VALID")(x)
    x = x.reshape(x.shape[0], -1, self.width)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.width))
    for _ in range(self.depth):
      x = EncoderBlock(self.width, self.heads)(x)
    x = nn.LayerNorm()(x).mean(axis=1)
    return nn.Dense(self.num_classes)(x)


class ResidualBlock(nn.Module):
  """Two 3x3 convolutions with GroupNorm; a 1x1 projection when the shape changes."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    groups = min(8, self.features)
    y = nn.Conv(self.features, (3, 3), strides=self.stride, use_bias=False)(x)
    y = nn.relu(nn.GroupNorm(groups)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
    y = nn.GroupNorm(groups)(y)
    if x.shape != y.shape:
      x = nn.Conv(self.features, (1, 1), strides=self.stride, use_bias=False)(x)
      x = nn.GroupNorm(groups)(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A small ResNet: a 3x3 stem and one residual block per stage."""

  stages: tuple[int, ...] = (16, 32, 64)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
    x = nn.relu(nn.GroupNorm(min(8, self.stages[0]))(x))
    for i, features in enumerate(self.stages):
      x = ResidualBlock(features, stride=1 if i == 0 else 2)(x)
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model and the shape of the batch it trains on."""

  name: str
  model: nn.Module
  batch_size: int
  image_size: int = 32


def workloads(size: Literal["full", "smoke"]) -> list[Workload]:
  """The benchmark models; ``"smoke"`` shrinks them for the tests."""
  if size == "smoke":
    return [
      Workload("vit-tiny", ViT(width=16, depth=1, heads=2), batch_size=4, image_size=8),
      Workload("resnet-small", ResNet(stages=(4, 8)), batch_size=4, image_size=8),
    ]
  return [
    Workload("vit-tiny", ViT(), batch_size=32),
    Workload("resnet-small", ResNet(), batch_size=32),
  ]


# ----------------------------------------------------------------------------- timing


def make_step(
  model: nn.Module, contender: Contender, hp: HParams, *, donate: bool, perturb: bool | None = None
) -> tuple[Callable, optax.GradientTransformation]:
  """The jitted train step of one contender: ``(params, opt_state, x, y) -> same + loss``.

  ``perturb`` fixes the branch of a ``perturb_every`` transform statically.
  """
  tx = contender.make(base_optimizer(), hp)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = model.apply(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    if contender.protocol == "loss_fn":
      extra = {"loss_fn": loss_fn, "value": loss}
      if perturb is not None:
        extra["perturb"] = perturb
    elif contender.protocol == "grad_fn":
      extra = {"grad_fn": lambda p, _: jax.grad(loss_fn)(p)}
    else:
      extra = {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1) if donate else ()), tx


def hlo_stats(compiled: Any) -> dict[str, float]:
  """Deterministic facts about a compiled step: XLA's cost analysis and HLO op counts."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list):  # older jax returns one dict per device
    cost = cost[0]
  text = compiled.as_text()
  return {
    "flops": float(cost.get("flops", float("nan"))),
    "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    "reduce_ops": len(re.findall(r"\breduce\(", text)),
    "fusions": len(re.findall(r"\bfusion\(", text)) + len(re.findall(r" fusion\.?\d* = ", text)),
  }


@dataclasses.dataclass
class Runner:
  """One contender's compiled step and its live state."""

  name: str
  compiled: Any
  params: Any
  opt_state: Any
  compile_seconds: float
  stats: dict[str, float]
  cheap_compiled: Any = None  # with static_every: the step without the perturbed pass
  every: int = 0
  count: int = 0

  def run(self, x: jax.Array, y: jax.Array, steps: int) -> float:
    """Runs ``steps`` steps; returns seconds per step."""
    start = time.perf_counter()
    for _ in range(steps):
      full = not self.every or self.count % self.every == 0
      step = self.compiled if full else self.cheap_compiled
      self.params, self.opt_state, loss = step(self.params, self.opt_state, x, y)
      self.count += 1
    loss.block_until_ready()
    jax.block_until_ready(self.params)
    return (time.perf_counter() - start) / steps


def bench_workload(
  workload: Workload,
  contenders: dict[str, Contender],
  hp: HParams,
  *,
  rounds: int,
  steps: int,
  donate: bool,
  seed: int = 0,
) -> list[dict]:
  """Compiles every contender, then times them interleaved; one row per contender."""
  key_x, key_y, key_init = jax.random.split(jax.random.key(seed), 3)
  shape = (workload.batch_size, workload.image_size, workload.image_size, 3)
  x = jax.random.normal(key_x, shape)
  y = jax.random.randint(key_y, (workload.batch_size,), 0, 10)
  params0 = workload.model.init(key_init, x[:1])
  num_params = sum(p.size for p in jax.tree.leaves(params0))

  runners = []
  for name, contender in contenders.items():
    every = contender.static_every
    step, tx = make_step(
      workload.model, contender, hp, donate=donate, perturb=True if every else None
    )
    params = jax.tree.map(jnp.copy, params0)
    opt_state = tx.init(params)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, x, y).compile()
    stats = hlo_stats(compiled)
    cheap_compiled = None
    if every:
      cheap_step, _ = make_step(workload.model, contender, hp, donate=donate, perturb=False)
      cheap_compiled = cheap_step.lower(params, opt_state, x, y).compile()
      cheap = hlo_stats(cheap_compiled)
      stats = {k: (v + (every - 1) * cheap[k]) / every for k, v in stats.items()}  # per step
    compile_seconds = time.perf_counter() - start
    runner = Runner(
      name, compiled, params, opt_state, compile_seconds, stats, cheap_compiled, every
    )
    runner.run(x, y, 2)  # warm up
    runners.append(runner)

  times: dict[str, list[float]] = {r.name: [] for r in runners}
  order = list(runners)
  shuffle = random.Random(seed)
  for _ in range(rounds):
    shuffle.shuffle(order)
    for runner in order:
      times[runner.name].append(runner.run(x, y, steps))

  def ratio_to(other: str, name: str) -> float | None:
    if other not in times:
      return None
    return float(np.median(np.array(times[name]) / np.array(times[other])))

  rows = []
  for runner in runners:
    rows.append(
      {
        "model": workload.name,
        "params": int(num_params),
        "batch_size": workload.batch_size,
        "contender": runner.name,
        "ms_per_step": 1e3 * float(np.median(times[runner.name])),
        "ratio_to_base": ratio_to(BASELINE, runner.name),
        "ratio_to_contrib_sam": ratio_to(REFERENCE, runner.name),
        "compile_s": runner.compile_seconds,
        "flops_ratio_to_base": runner.stats["flops"]
        / next(r.stats["flops"] for r in runners if r.name == BASELINE),
        "bytes_ratio_to_base": runner.stats["bytes_accessed"]
        / next(r.stats["bytes_accessed"] for r in runners if r.name == BASELINE),
        **runner.stats,
        "ms_per_step_rounds": [1e3 * t for t in times[runner.name]],
      }
    )
  return rows


def check_targets(rows: list[dict]) -> list[dict]:
  """Per model: GSAM vs optax.contrib.sam (<= 1.02) and vs base (<= 2.05); k=5 vs base (<= 1.3)."""
  limits = {
    "gsam": (("optax.contrib.sam", "ratio_to_contrib_sam", 1.02), ("base", "ratio_to_base", 2.05)),
    "gsam k=5": (("base", "ratio_to_base", 1.3),),
    "gsam k=5 static": (("base", "ratio_to_base", 1.3),),
  }
  checks = []
  for row in rows:
    for other, key, limit in limits.get(row["contender"], ()):
      value = row[key]
      if value is not None:
        checks.append(
          {
            "model": row["model"],
            "target": f"{row['contender']} / {other} <= {limit}",
            "value": value,
            "met": bool(value <= limit),
          }
        )
  return checks


def format_table(rows: list[dict]) -> str:
  """A plain-text table of :func:`bench_workload`'s rows."""
  header = (
    "model",
    "contender",
    "ms/step",
    "/ base",
    "/ contrib.sam",
    "compile s",
    "flops / base",
    "bytes / base",
    "reduces",
  )
  cells = [header]
  for r in rows:
    ref = r["ratio_to_contrib_sam"]
    cells.append(
      (
        r["model"],
        r["contender"],
        f"{r['ms_per_step']:.2f}",
        f"{r['ratio_to_base']:.3f}",
        "-" if ref is None else f"{ref:.3f}",
        f"{r['compile_s']:.2f}",
        f"{r['flops_ratio_to_base']:.3f}",
        f"{r['bytes_ratio_to_base']:.3f}",
        str(r["reduce_ops"]),
      )
    )
  return render_table(cells)


def plot(rows: list[dict], path: Path) -> None:
  """Bar chart of the step-time ratio to the base step, per model and contender."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(r["model"] for r in rows))
  names = list(dict.fromkeys(r["contender"] for r in rows))
  fig, ax = plt.subplots(figsize=(7, 3.5))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    values = [
      next(r["ratio_to_base"] for r in rows if r["model"] == m and r["contender"] == name)
      for m in models
    ]
    ax.bar(np.arange(len(models)) + i * width, values, width, label=name)
  ax.axhline(2.05, color="k", ls="--", lw=1, label="target 2.05x")
  ax.set_xticks(np.arange(len(models)) + width * (len(names) - 1) / 2, models)
  ax.set_ylabel("step time / base step")
  ax.legend(fontsize=8, loc="upper left")
  ax.set_title("Step cost (median of interleaved rounds)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the table, writes JSON (and a PNG unless ``--no-plot``)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="about a minute on 2 CPU cores")
  parser.add_argument("--smoke", action="store_true", help="tiny models, for the tests")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
  parser.add_argument("--steps", type=int, default=None, help="steps per contender per round")
  parser.add_argument("--donate", action="store_true", help="donate params and opt_state")
  parser.add_argument("--models", nargs="*", default=None, help="subset of models to run")
  parser.add_argument("--contenders", nargs="*", default=None, help=f"subset of {list(CONTENDERS)}")
  parser.add_argument("--rho", type=float, default=HParams.rho)
  parser.add_argument("--alpha", type=float, default=HParams.alpha)
  parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)

  mode = "smoke" if args.smoke else "quick" if args.quick else "full"
  rounds = args.rounds or {"smoke": 2, "quick": 5, "full": 25}[mode]
  steps = args.steps or {"smoke": 1, "quick": 4, "full": 10}[mode]
  hp = HParams(rho=args.rho, alpha=args.alpha)
  selected = [
    w
    for w in workloads("smoke" if args.smoke else "full")
    if not args.models or w.name in args.models
  ]
  print(
    f"step cost, {mode} mode: {rounds} interleaved rounds x {steps} steps per contender, "
    f"donate={args.donate}, base = AdamW, rho={hp.rho}, alpha={hp.alpha}"
  )
  contenders = {
    name: c
    for name, c in CONTENDERS.items()
    if not args.contenders or name in args.contenders or name == BASELINE  # ratios need base
  }
  rows = []
  for workload in selected:
    rows += bench_workload(workload, contenders, hp, rounds=rounds, steps=steps, donate=args.donate)
  checks = check_targets(rows)
  print(format_table(rows))
  for check in checks:
    status = "met" if check["met"] else "MISSED"
    print(f"{check['model']}: {check['target']}: {check['value']:.3f} -> {status}")

  result = {
    "benchmark": "step_cost",
    "mode": mode,
    "command": " ".join(
      ["python", "benchmarks/step_cost.py", *(sys.argv[1:] if argv is None else argv)]
    ),
    "rounds": rounds,
    "steps_per_round": steps,
    "donate": args.donate,
    "hparams": dataclasses.asdict(hp),
    "machine": machine(),
    "code": code_version(),
    "rows": rows,
    "targets": checks,
  }
  args.out_dir.mkdir(parents=True, exist_ok=True)
  stem = "step_cost" + ("" if mode == "full" else f"_{mode}") + ("_donate" if args.donate else "")
  (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
  if not args.no_plot:
    plot(rows, args.out_dir / f"{stem}.png")
  return result


if __name__ == "__main__":
  main()
