"""pareto.py's reporting: its targets, the share of SAM's gain each contender keeps, tables, plots.

``replot`` draws the rows of saved ``--joint`` result files against gradient
evaluations and writes their gain shares, training nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Contender
from benchmarks.science.pareto_contenders import CONTENDERS
from benchmarks.science.pareto_contenders import COST_LIMIT
from benchmarks.science.pareto_contenders import GAIN_COST_LIMIT
from benchmarks.science.pareto_contenders import GAIN_SHARE
from benchmarks.science.pareto_contenders import LATE_LIMIT
from benchmarks.science.pareto_contenders import OVERHEAD_LIMIT


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
    if "base" in here:  # (d): no cheap policy may end below base - 2 std
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


def replot(png: str, files: str) -> dict:
  """``--replot``: the rows of ``files`` (comma-separated JSONs) against gradient evaluations.

  Draws them into ``png`` and writes their gain shares and target (e) beside it
  (``<png>_shares.json``); trains nothing.
  """
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
