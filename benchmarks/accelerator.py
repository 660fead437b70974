"""Runs the step-cost, generalization and gradient-cache benchmarks on an accelerator.

    python -m benchmarks.accelerator            # full sizes
    python -m benchmarks.accelerator --quick    # each benchmark's --quick mode

Results go to ``benchmarks/results/<platform>-<device kind>/``: each script's
JSON (and PNG), plus ``device.json`` with the device, the JAX version and the
wall time of each benchmark. On a machine whose default backend is the CPU it
stops, unless ``--allow-cpu`` is given, so a CPU run is never filed as a GPU
one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import time

import jax

HERE = pathlib.Path(__file__).resolve().parent
BENCHMARKS = {  # name -> the module that runs it
  "step_cost": "benchmarks.costs.step_cost",
  "generalization": "benchmarks.science.generalization",
  "gradient_cache": "benchmarks.costs.gradient_cache",
}


def results_dir(device: jax.Device) -> pathlib.Path:
  slug = re.sub(r"[^a-z0-9]+", "-", f"{device.platform}-{device.device_kind}".lower()).strip("-")
  return HERE / "results" / slug


def plan(out_dir: pathlib.Path, quick: bool) -> dict[str, list[str]]:
  """The arguments each benchmark's ``main`` is called with."""
  mode = ["--quick"] if quick else []
  return {name: [*mode, "--out-dir", str(out_dir)] for name in BENCHMARKS}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--allow-cpu", action="store_true", help="run even without an accelerator")
  parser.add_argument("--only", nargs="*", default=None, help=f"subset of {list(BENCHMARKS)}")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  if device.platform == "cpu" and not args.allow_cpu:
    raise SystemExit("No accelerator: jax's default backend is the CPU (pass --allow-cpu to run).")
  out_dir = results_dir(device)
  out_dir.mkdir(parents=True, exist_ok=True)
  record = {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "jax": jax.__version__,
    "quick": args.quick,
    "seconds": {},
  }
  for name, bench_args in plan(out_dir, args.quick).items():
    if args.only and name not in args.only:
      continue
    print(f"\n=== {name} {' '.join(bench_args)}", flush=True)
    start = time.perf_counter()
    importlib.import_module(BENCHMARKS[name]).main(bench_args)
    record["seconds"][name] = time.perf_counter() - start
  (out_dir / "device.json").write_text(json.dumps(record, indent=2) + "\n")
  print(f"\nwrote {out_dir}")
  return record


if __name__ == "__main__":
  main()
