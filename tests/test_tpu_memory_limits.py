"""Every memory limit the recorded table meets on the TPU compiler, compiled again and checked.

``benchmarks/results/memory_table.json`` holds each model's steps against what their maths needs
(``benchmarks/memory_table.py``). Each TPU cell it marks met is compiled here again, the step and
its reference at the recorded model, batch and topology, and must still be met: a change that
brings held buffers back fails here. The missed cells are left to the table, which says what holds
them. The decoder's all-reduce counts against optax.contrib.sam's are guarded too.

Needs libtpu (the ``tpu-compile`` extra; without it these tests fail, they do not skip) and takes
about 25 minutes on two cores, so it runs apart from the README's suite, one worker per class
(the FSDP and the ViT compiles; two ViT compiles at once, about 11 GB each, would not fit 24 GB):
``python -m pytest -n 2 --dist loadscope -m tpu_limits tests/test_tpu_memory_limits.py``.
"""

import concurrent.futures
import functools
import json
import multiprocessing

import jax
import memory_table  # benchmarks/ (pyproject.toml's pythonpath)
import pytest
import tpu_compile
import tpu_sharded
from compiled_hlo import analyse
from tpu_decoder import DecoderConfig
from tpu_mlp import MLPConfig
from tpu_vit import ViTConfig

pytestmark = pytest.mark.usefixtures("no_compilation_cache")  # conftest.py: none for a TPU

RESULTS = memory_table.RESULTS
DECODER = "FSDP decoder 1.04B, v4-64"
MLP = "FSDP residual MLP 537M, v4-64"
VIT = "ViT-B/32 replicated, v3-64"
VIT_MICROBATCHES = "ViT-B/32 replicated, v3-64, 256 images"
# The table's TPU models -> (the result file whose "model", topology and batch they were compiled
# at, memory_table's (label, row, reference, needs) steps of that model).
MODELS = memory_table.TPU_MODELS
VIT_MICROBATCH_BATCH = memory_table.VIT_MICROBATCH_BATCH
# How many cells of each model the table marks met: re-recording the results that changes a
# verdict changes this line too, so no cell leaves the guard unseen.
MET_CELLS = {DECODER: 3, MLP: 10, VIT: 6, VIT_MICROBATCHES: 6}


def _met_cells(models) -> list:
  """(model, label, over, dtype) of every cell of ``models`` the recorded table marks met."""
  table = json.loads((RESULTS / "memory_table.json").read_text())["rows"]
  cells = []
  for row in table:
    if row["model"].startswith("CPU") or row["step"].endswith("(reference)"):
      continue  # the CPU rows: tests/test_microbatches.py; references have no verdict
    if row["model"] not in MODELS:
      raise ValueError(f"memory_table.json has a TPU model this guard does not know: {row}")
    for dtype in ("f32", "bf16"):
      if row["model"] in models and row.get(dtype, {}).get("met"):
        cells.append((row["model"], row["step"], row["over"], dtype))
  return cells


def _step(model: str, label: str, over: str) -> tuple:
  """(row name, reference, needs) of a table row, from memory_table's step lists."""
  found = [s[1:] for s in MODELS[model][1] if s[0] == label and s[2] == over]
  assert len(found) == 1, (model, label, over)
  return found[0]


def _recorded_rows(model: str) -> dict:
  """The recorded rows of ``model`` by (contender, dtype)."""
  recorded = json.loads((RESULTS / MODELS[model][0]).read_text())
  rows = recorded["rows"]
  if model == VIT_MICROBATCHES:
    rows = [r for r in rows if r.get("batch") == VIT_MICROBATCH_BATCH]
  return {(r["contender"], r["dtype"]): r for r in rows}


@functools.cache
def _compiled_row(model: str, name: str, dtype: str) -> dict:
  """One step's figures compiled now, at the model, batch and topology its result file records.

  Each compile runs in a fresh process: the TPU compiler keeps much of what it allocated, and a
  process that compiled the ViT's programs one after another grew past 15 GB.
  """
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
    row = pool.submit(_compile, model, name, dtype).result()
  # The arguments (params, optimizer state, batch) fix the model, batch and layout: the program
  # compiled is the one recorded.
  assert row["argument_bytes"] == _recorded_rows(model)[name, dtype]["argument_bytes"], name
  return row


def _compile(model: str, name: str, dtype: str) -> dict:
  """:func:`_compiled_row`'s compile, in the child process (no persistent compilation cache)."""
  jax.config.update("jax_enable_compilation_cache", False)
  recorded = json.loads((RESULTS / MODELS[model][0]).read_text())
  config = {k: v for k, v in recorded["model"].items() if k != "name"}
  if model in (DECODER, MLP):
    kind = DecoderConfig if model == DECODER else MLPConfig
    mesh = tpu_sharded.tpu_mesh(recorded["topology"])
    row, _ = tpu_sharded.compile_row(mesh, kind(**config), dtype, name, recorded["per_core_batch"])
    return row
  mesh = tpu_compile.tpu_mesh(recorded["topology"])
  if model == VIT_MICROBATCHES:
    method = name.rsplit(" mb=", 1)[0]
    contender = tpu_compile.microbatch_contender(4, "whole", method)
    per_core = VIT_MICROBATCH_BATCH
  else:
    contender, per_core = tpu_compile.CONTENDERS[name], recorded["per_core_batch"]
  compiled, param_bytes, _ = tpu_compile.compile_step(
    mesh, ViTConfig(**config), tpu_compile.DTYPES[dtype], contender, per_core
  )
  return {"param_bytes": param_bytes, **analyse(compiled)}


def _check(model: str, label: str, over: str, dtype: str) -> None:
  name, reference, needs = _step(model, label, over)
  cell = memory_table.tpu_cell(
    _compiled_row(model, name, dtype), _compiled_row(model, reference, dtype), needs
  )
  assert cell["met"], (model, label, dtype, cell)


@pytest.mark.tpu_limits
class TestFSDP:
  """The decoder and the residual MLP, FSDP over a v4-64 (23 compiles, about 15 minutes)."""

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
    name, reference, _ = _step(model, label, over)
    if model in (DECODER, MLP):
      known = set(tpu_sharded.CONTENDERS)
    elif model == VIT_MICROBATCHES:
      known = {f"{m} mb=4" for m in microbatch_methods}
    else:
      known = set(tpu_compile.CONTENDERS)
    assert {name, reference} <= known, (model, name, reference)
    assert {(name, dtype), (reference, dtype)} <= set(_recorded_rows(model)), (model, name)
