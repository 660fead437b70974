"""How the benchmark scripts report: provenance, tables, target verdicts, JSON and figures.

Every script writes ``benchmarks/results/<name>[_<mode>].json`` with the command, the machine and
the code measured (:func:`save`). ``harness`` re-exports these names, so scripts may call
``harness.save`` as before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import optax_gsam

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- provenance


def code_version() -> dict[str, Any]:
  """The optax_gsam commit measured, and whether its package sources differ from it."""
  root = Path(optax_gsam.__file__).resolve().parents[1]
  try:
    git = lambda *a: subprocess.run(
      ["git", "-C", str(root), *a], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {
      "commit": git("rev-parse", "HEAD"),
      "dirty": bool(git("status", "--porcelain", "optax_gsam")),
    }
  except (OSError, subprocess.CalledProcessError):
    return {"commit": os.environ.get("OPTAX_GSAM_COMMIT", "unknown"), "dirty": None}


def machine() -> dict[str, str]:
  """Where the numbers were measured."""
  cpu = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = models[0] if models else cpu
  except OSError:
    pass
  return {
    "nproc": str(os.cpu_count()),
    "cpu": cpu,
    "jax": jax.__version__,
    "optax": optax.__version__,
    "backend": jax.default_backend(),
    "device": jax.devices()[0].device_kind,
  }


# ----------------------------------------------------------------------------- results


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
  """``"mean ± std"`` of ``values`` times ``scale``."""
  values = scale * np.asarray(values, np.float64)
  return f"{values.mean():.{digits}f} ± {values.std():.{digits}f}"


def render_table(cells: list[tuple[str, ...]]) -> str:
  """Left-aligned columns with a dashed rule under the first (header) row."""
  widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
  lines = [
    "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def check(target: str, value: float | str, met: bool) -> dict:
  """One target's verdict; printed as ``target: value -> met``."""
  shown = f"{value:.3f}" if isinstance(value, float) else value
  print(f"{target}: {shown} -> {'met' if met else 'MISSED'}")
  return {"target": target, "value": value, "met": bool(met)}


def parser(description: str, contenders: Sequence[str] = ()) -> argparse.ArgumentParser:
  """The flags every benchmark takes: ``--quick``, ``--out-dir``, ``--no-plot`` (and ``--contenders``)."""
  out = argparse.ArgumentParser(description=description.splitlines()[0])
  out.add_argument("--quick", action="store_true", help="a short run (see the script's docstring)")
  out.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
  out.add_argument("--no-plot", action="store_true")
  if contenders:
    out.add_argument("--contenders", nargs="*", default=None, help=f"subset of {list(contenders)}")
  return out


# The scripts that call :func:`save`, by the name they save under (``generalization_tune`` and
# ``generalization_cost`` are modes of ``generalization``).
SCRIPTS = {
  "step_cost": "benchmarks.costs.step_cost",
  "microbatches": "benchmarks.costs.microbatches",
  "gradient_cache": "benchmarks.costs.gradient_cache",
  "generalization": "benchmarks.science.generalization",
  "pareto": "benchmarks.science.pareto",
}


def script_of(name: str) -> str:
  """The module a result named ``name`` comes from: ``python -m`` runs it."""
  return next(module for stem, module in SCRIPTS.items() if name.startswith(stem))


def save(
  name: str,
  mode: str,
  result: dict,
  out_dir: Path,
  argv: Sequence[str] | None,
  plot: Callable[[Path], None] | None = None,
  suffix: str = "",
) -> dict:
  """Adds the command, machine and code to ``result``; writes ``<name>[_<mode>]<suffix>.json``.

  ``plot(path)``, when given, draws the PNG of the same name.
  """
  argv = sys.argv[1:] if argv is None else argv
  result = {
    "benchmark": name,
    "mode": mode,
    "command": " ".join(["python -m", script_of(name), *argv]),
    "machine": machine(),
    "code": code_version(),
    **result,
  }
  stem = (name if mode == "full" else f"{name}_{mode}") + suffix
  write_json(out_dir / f"{stem}.json", result)
  if plot is not None:
    plot(out_dir / f"{stem}.png")
  return result


def write_json(path: Path, result: dict) -> None:
  """``result`` as indented JSON at ``path``, its folder made if needed."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=2) + "\n")


def _installed_version(package: str) -> str:
  from importlib import metadata

  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return "unknown"


def libtpu_version() -> str:
  """The installed libtpu's version (the TPU compiler of the ahead-of-time scripts)."""
  return _installed_version("libtpu")


def cuda_plugin_version() -> str:
  """The installed CUDA plugin's version (the GPU compiler of the ahead-of-time scripts)."""
  return _installed_version("jax-cuda12-plugin")


def figure(*args, **kwargs) -> tuple[Any, Any]:
  """``plt.subplots`` on the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: Path) -> None:
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
