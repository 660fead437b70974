"""Every memory limit the recorded table meets on the TPU compiler, compiled again and checked.

``benchmarks/results/memory_table.json`` holds each model's steps against what their maths needs
(``benchmarks/compiled/memory_table.py``). Each TPU cell it marks met is compiled here again, the step and
its reference at the recorded model, batch and topology, and must still be met: a change that
brings held buffers back fails here. Each missed cell must carry what is live at its peak
(``benchmarks/compiled/tpu_live.py``'s dumps, in the table), checked without compiling. The decoder's
all-reduce counts against optax.contrib.sam's are guarded too.

Needs libtpu (the ``tpu-compile`` extra; without it these tests fail, they do not skip) and takes
about 25 minutes on two cores, so it runs apart from the README's suite, one worker per class
(the FSDP and the ViT compiles; two ViT compiles at once, about 11 GB each, would not fit 24 GB):
``python -m pytest -n 2 --dist loadscope -m tpu_limits tests/test_tpu_memory_limits.py``.
"""

import functools
import json

import pytest

from benchmarks.compiled import memory_table  # the repository root: pyproject.toml's pythonpath
from benchmarks.compiled import sharded_steps
from benchmarks.compiled import tpu_compile
from benchmarks.compiled import tpu_live
from benchmarks.compiled.hlo import data_peak

pytestmark = pytest.mark.usefixtures("no_compilation_cache")  # conftest.py: none for a TPU

DECODER, MLP, VIT, VIT_MICROBATCHES = (
  memory_table.TPU_MODEL_LABELS[k] for k in ("decoder", "mlp", "vit", "vit256")
)
# The table's TPU models -> (the result file whose "model", topology and batch they were compiled
# at, memory_table's (label, row, reference, needs) steps of that model).
MODELS = memory_table.TPU_MODELS
# How many cells of each model the table marks met: re-recording the results that changes a
# verdict changes this line too, so no cell leaves the guard unseen.
MET_CELLS = {DECODER: 4, MLP: 10, VIT: 6, VIT_MICROBATCHES: 6}


def _met_cells(models) -> list:
  """(model, label, over, dtype) of every cell of ``models`` the recorded table marks met."""
  return tpu_live.table_cells(models, verdict=True)


@functools.cache
def _compiled_row(model: str, name: str, dtype: str) -> dict:
  """One step's figures compiled now, in a fresh process, at the model, batch and topology its
  result file records."""
  row = tpu_live.in_fresh_process(tpu_live.compile_recorded, model, name, dtype)
  # The arguments (params, optimizer state, batch) fix the model, batch and layout: the program
  # compiled is the one recorded.
  assert row["argument_bytes"] == tpu_live.recorded_rows(model)[name, dtype]["argument_bytes"], name
  return row


def _check(model: str, label: str, over: str, dtype: str) -> None:
  name, reference, needs = tpu_live.step_of(model, label, over)
  cell = memory_table.tpu_cell(
    _compiled_row(model, name, dtype), _compiled_row(model, reference, dtype), needs
  )
  assert cell["met"], (model, label, dtype, cell)


@pytest.mark.tpu_limits
class TestFSDP:
  """The decoder and the residual MLP, FSDP over a v4-64 (25 compiles, about 16 minutes)."""

  @pytest.mark.parametrize(("model", "label", "over", "dtype"), _met_cells((DECODER, MLP)))
  def test_a_met_memory_limit_stays_met(self, model, label, over, dtype):
    _check(model, label, over, dtype)

  @pytest.mark.parametrize("dtype", ["f32", "bf16"])
  @pytest.mark.parametrize("name", ["gsam", "sam"])
  def test_decoder_all_reduces_at_most_two_more_than_optax_contrib_sam(self, name, dtype):
    count = lambda n: _compiled_row(DECODER, n, dtype)["collectives"]["all-reduce"]["count"]
    assert count(name) <= count("optax.contrib.sam") + 2, (count(name), count("optax.contrib.sam"))


@pytest.mark.tpu_limits
class TestViT:
  """The replicated ViT-B/32 on a v3-64, at 64 images per core and micro-batched at 256."""

  @pytest.mark.parametrize(("model", "label", "over", "dtype"), _met_cells((VIT, VIT_MICROBATCHES)))
  def test_a_met_memory_limit_stays_met(self, model, label, over, dtype):
    _check(model, label, over, dtype)


def test_every_met_cell_is_guarded_with_steps_the_scripts_build():
  """The wiring, without compiling: the table's met cells are the counted ones, and each names
  a step and a reference that the benchmark scripts build."""
  cells = _met_cells(tuple(MODELS))
  assert {m: sum(c[0] == m for c in cells) for m in MODELS} == MET_CELLS
  microbatch_methods = [*tpu_compile.MICROBATCH_METHODS, tpu_compile.MICROBATCH_BASELINE]
  for model, label, over, dtype in cells:
    name, reference, _ = tpu_live.step_of(model, label, over)
    if model in (DECODER, MLP):
      known = set(sharded_steps.CONTENDERS)
    elif model == VIT_MICROBATCHES:
      known = {f"{m} mb=4" for m in microbatch_methods}
    else:
      known = set(tpu_compile.CONTENDERS)
    assert {name, reference} <= known, (model, name, reference)
    assert {(name, dtype), (reference, dtype)} <= set(tpu_live.recorded_rows(model)), (model, name)


def test_every_missed_cell_has_its_live_buffers_dumped():
  """Each TPU cell the table marks missed carries ``tpu_live.py``'s split of its excess into the
  buffers live at the peak over its reference's and the heap's packing, read from the programs
  the results record (the same data peaks), and the table shows it."""
  live = json.loads((memory_table.RESULTS / memory_table.LIVE).read_text())
  dumped = {(c["model"], c["step"], c["over"], c["dtype"]): c for c in live["cells"]}
  missed = tpu_live.table_cells(tuple(MODELS), verdict=False)
  assert set(dumped) == set(missed)
  for key, program in live["programs"].items():
    model, name, dtype = key.split(" | ")
    assert program["data_peak_bytes"] == data_peak(tpu_live.recorded_rows(model)[name, dtype]), key
    assert 0 < program["live_bytes"] <= program["data_peak_bytes"], key
  table = json.loads((memory_table.RESULTS / "memory_table.json").read_text())["rows"]
  rows = {(r["model"], r["step"], r["over"]): r for r in table}
  for key in missed:
    entry, cell = rows[key[:3]][key[3]], dumped[key]
    name, reference, _ = tpu_live.step_of(*key[:3])
    assert {f"{key[0]} | {n} | {key[3]}" for n in (name, reference)} <= set(live["programs"]), key
    live_key = "live_ratio" if "ratio" in cell else "live_over_P"
    assert entry[live_key] == cell[live_key], key
