"""What every benchmark records next to its numbers: the machine and the code measured."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import jax
import optax

import optax_gsam


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


def render_table(cells: list[tuple[str, ...]]) -> str:
  """Left-aligned columns with a dashed rule under the first (header) row."""
  widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
  lines = [
    "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)
