"""Step cost of SAM and GSAM against the base optimizer and ``optax.contrib.sam``.

Every contender trains the same model on the same fixed batch in one process: the
base optimizer (AdamW), ``optax_gsam.sam``, ``optax_gsam.gsam``,
``optax.contrib.sam`` (opaque mode) and GSAM with a full step every fifth step,
with its ``lax.cond`` and with one jitted step per branch chosen in Python
(``update(..., perturb=t % 5 == 0)``, "static"). The models are a ViT-tiny and a
small ResNet. The contenders run interleaved (:func:`harness.interleaved`);
flops, bytes and reduce counts come from the compiled step. Targets and results:
benchmarks/README.md.

    python -m benchmarks.costs.step_cost            # full: 25 rounds x 10 steps (~10 min, 2 cores)
    python -m benchmarks.costs.step_cost --quick    # about a minute
    python -m benchmarks.costs.step_cost --donate   # donate params and optimizer state, all alike

Writes ``results/step_cost[_quick][_donate].json`` and a PNG.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax

import optax_gsam

from benchmarks import harness
from benchmarks.baselines import contrib_sam
from benchmarks.harness import Contender
from benchmarks.harness import before_base
from benchmarks.models import ResNet
from benchmarks.models import ViT


def _gsam_every(hp: harness.HParams) -> optax.GradientTransformation:
  return optax_gsam.gsam(hp.rho, hp.alpha, policy=optax_gsam.every_k_policy(5))


CONTENDERS: dict[str, Contender] = {
  **{name: harness.CONTENDERS[name] for name in ("base", "sam", "gsam")},
  "optax.contrib.sam": Contender(lambda base, hp: contrib_sam(base, hp.rho), protocol="grad_fn"),
  "gsam k=5": Contender(before_base(_gsam_every)),
  "gsam k=5 static": Contender(before_base(_gsam_every)),
}
STATIC_EVERY = {"gsam k=5 static": 5}  # one jitted step per branch, update(..., perturb=t % k == 0)
BASELINE, REFERENCE = "base", "optax.contrib.sam"


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model and the shape of the batch it trains on."""

  name: str
  model: object
  batch_size: int
  image_size: int = 32


def workloads(size: str) -> list[Workload]:
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


def bench_workload(
  workload: Workload,
  contenders: dict[str, Contender],
  hp: harness.HParams,
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
  params = workload.model.init(key_init, x[:1])
  timed = {}
  for name, contender in contenders.items():
    tx = contender.make(harness.base_optimizer(), hp)
    every = STATIC_EVERY.get(name, 0)
    timed[name] = harness.compile_step(
      workload.model,
      tx,
      contender,
      params,
      x,
      y,
      perturb=True if every else None,
      static_every=every,
      donate=donate,
    )
  times = harness.interleaved(timed, BASELINE, rounds=rounds, steps=steps, seed=seed)
  seconds = {name: np.array(t["seconds"]) for name, t in times.items()}
  ratio_to = lambda other, name: (
    float(np.median(seconds[name] / seconds[other])) if other in seconds else None
  )
  base_stats = timed[BASELINE].stats
  return [
    {
      "model": workload.name,
      "params": int(sum(p.size for p in jax.tree.leaves(params))),
      "batch_size": workload.batch_size,
      "contender": name,
      "ms_per_step": times[name]["ms"],
      "ratio_to_base": times[name]["ratio"],
      "ratio_to_contrib_sam": ratio_to(REFERENCE, name),
      "compile_s": timed[name].compile_s,
      "flops_ratio_to_base": times[name]["flops_ratio"],
      "bytes_ratio_to_base": timed[name].stats["bytes_accessed"] / base_stats["bytes_accessed"],
      **timed[name].stats,
      "ms_per_step_rounds": [1e3 * t for t in times[name]["seconds"]],
    }
    for name in timed
  ]


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
      if row[key] is not None:
        target = f"{row['model']}: {row['contender']} / {other} <= {limit}"
        checks.append(harness.check(target, row[key], row[key] <= limit))
  return checks


def format_table(rows: list[dict]) -> str:
  header = ("model", "contender", "ms/step", "/ base", "/ contrib.sam", "compile s")
  cells = [(*header, "flops / base", "bytes / base", "reduces")]
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
        f"{r['reduce_ops']:g}",
      )
    )
  return harness.render_table(cells)


def plot(rows: list[dict], path) -> None:
  """Bar chart of the step-time ratio to the base step, per model and contender."""
  models = list(dict.fromkeys(r["model"] for r in rows))
  names = list(dict.fromkeys(r["contender"] for r in rows))
  fig, ax = harness.figure(figsize=(7, 3.5))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    values = [
      next(r["ratio_to_base"] for r in rows if (r["model"], r["contender"]) == (m, name))
      for m in models
    ]
    ax.bar(np.arange(len(models)) + i * width, values, width, label=name)
  ax.axhline(2.05, color="k", ls="--", lw=1, label="target 2.05x")
  ax.set_xticks(np.arange(len(models)) + width * (len(names) - 1) / 2, models)
  ax.set_ylabel("step time / base step")
  ax.legend(fontsize=8, loc="upper left")
  ax.set_title("Step cost (median of interleaved rounds)")
  harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; prints the table, writes JSON (and a PNG unless ``--no-plot``)."""
  parser = harness.parser(__doc__, CONTENDERS)
  parser.add_argument("--smoke", action="store_true", help="tiny models, for the tests")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
  parser.add_argument("--steps", type=int, default=None, help="steps per contender per round")
  parser.add_argument("--donate", action="store_true", help="donate params and opt_state")
  parser.add_argument("--models", nargs="*", default=None, help="subset of models to run")
  parser.add_argument("--rho", type=float, default=harness.HParams.rho)
  parser.add_argument("--alpha", type=float, default=harness.HParams.alpha)
  args = parser.parse_args(argv)
  mode = "smoke" if args.smoke else "quick" if args.quick else "full"
  rounds = args.rounds or {"smoke": 2, "quick": 5, "full": 25}[mode]
  steps = args.steps or {"smoke": 1, "quick": 4, "full": 10}[mode]
  hp = harness.HParams(rho=args.rho, alpha=args.alpha)
  selected = [
    w
    for w in workloads("smoke" if args.smoke else "full")
    if not args.models or w.name in args.models
  ]
  print(
    f"step cost, {mode} mode: {rounds} interleaved rounds x {steps} steps per contender, donate={args.donate}, base = AdamW, rho={hp.rho}, alpha={hp.alpha}"
  )
  contenders = {
    name: c
    for name, c in CONTENDERS.items()
    if not args.contenders or name in args.contenders or name == BASELINE  # ratios need base
  }
  rows = []
  for workload in selected:
    rows += bench_workload(workload, contenders, hp, rounds=rounds, steps=steps, donate=args.donate)
  print(format_table(rows))
  checks = check_targets(rows)
  result = {
    "rounds": rounds,
    "steps_per_round": steps,
    "donate": args.donate,
    "hparams": {"rho": hp.rho, "alpha": hp.alpha},
    "rows": rows,
    "targets": checks,
  }
  draw = None if args.no_plot else functools.partial(plot, rows)
  suffix = "_donate" if args.donate else ""
  return harness.save("step_cost", mode, result, args.out_dir, argv, draw, suffix)


if __name__ == "__main__":
  main()
