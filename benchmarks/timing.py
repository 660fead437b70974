"""Interleaved timing of compiled steps, and the deterministic facts XLA reports about them.

``harness`` re-exports these names; ``harness.compile_step`` builds the :class:`Timed`
entries of a train step.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


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
class Timed:
  """Functions called in turn on a live state (``state -> state``), for interleaved timing.

  Attributes:
    cycle: the functions; step ``t`` calls ``cycle[t % len(cycle)]``.
    state: what the next call receives.
    stats: :func:`hlo_stats` per step, averaged over the cycle.
    compile_s: the seconds the compilation took.
  """

  cycle: tuple[Callable[[Any], Any], ...]
  state: Any = None
  stats: dict[str, float] = dataclasses.field(default_factory=dict)
  compile_s: float = 0.0
  count: int = 0

  def run(self, steps: int) -> float:
    """Runs ``steps`` calls; returns seconds per call."""
    start = time.perf_counter()
    for _ in range(steps):
      self.state = self.cycle[self.count % len(self.cycle)](self.state)
      self.count += 1
    jax.block_until_ready(self.state)
    return (time.perf_counter() - start) / steps


def interleaved(
  timed: dict[str, Timed],
  base: str,
  *,
  rounds: int,
  steps: int,
  paired: bool = False,
  seed: int = 0,
) -> dict[str, dict[str, Any]]:
  """Median ms per step of each entry and the median of its ratios to ``base``'s runs.

  Every round visits the entries in a fresh random order, each for ``steps`` calls.
  Unpaired, each entry runs once a round and a ratio is to ``base``'s run of the same
  round. Paired, every other entry's run sits right next to a run of ``base`` of its
  own (before it on even rounds, after it on odd ones), so a ratio compares two runs
  a few milliseconds apart: the load of a shared machine changes faster than a round.
  """
  seconds: dict[str, list[float]] = {name: [] for name in timed}
  against: dict[str, list[float]] = {name: [] for name in timed}
  order = [name for name in timed if name != base or not paired]
  shuffle = random.Random(seed)
  for i in range(rounds):
    shuffle.shuffle(order)
    if not paired:
      for name in order:
        seconds[name].append(timed[name].run(steps))
      for name in order:
        against[name].append(seconds[base][-1])
      continue
    for name in order:
      first, second = (base, name) if i % 2 == 0 else (name, base)
      times = {first: timed[first].run(steps), second: timed[second].run(steps)}
      seconds[name].append(times[name])
      seconds[base].append(times[base])
      against[name].append(times[base])
  against[base] = seconds[base]
  flops = timed[base].stats.get("flops", float("nan"))
  return {
    name: {
      "ms": 1e3 * float(np.median(seconds[name])),
      "ratio": float(np.median(np.array(seconds[name]) / np.array(against[name]))),
      "flops_ratio": timed[name].stats.get("flops", float("nan")) / flops,
      "seconds": seconds[name],
    }
    for name in timed
  }
