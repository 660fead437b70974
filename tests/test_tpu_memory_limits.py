"""Every memory limit the recorded table meets on the TPU compiler, compiled again and checked.

``benchmarks/results/memory_table.json`` holds each model's steps against what their maths needs
(``benchmarks/memory_table.py``). Each cell it marks met is compiled here again, the step and its
reference at the recorded sizes, for the recorded topology, and must still be met: a change that
brings held buffers back fails here. The missed cells are left to the table, which says what holds
them. The decoder's all-reduce counts against optax.contrib.sam's are guarded too.

Needs libtpu (the ``tpu-compile`` extra) and takes about 25 minutes on two cores, so it runs apart
from the README's suite: ``python -m pytest -n 2 -m tpu_limits tests/test_tpu_memory_limits.py``.
"""

import functools
import importlib.util
import json

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
needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed; pip install -e '.[tpu-compile]' to compile for a TPU",
)

RESULTS = memory_table.RESULTS
# The table's model labels -> the result file whose "model", topology and batch they were compiled
# at. Each model's steps are compiled once per worker (_compiled_row's cache).
MODELS = {
  "FSDP decoder 1.04B, v4-64": "tpu_sharded.json",
  "FSDP residual MLP 537M, v4-64": "tpu_sharded_mlp.json",
  "ViT-B/32 replicated, v3-64": "tpu_compile.json",
  "ViT-B/32 replicated, v3-64, 256 images": "tpu_compile_microbatches.json",
}
VIT_MICROBATCH_BATCH = 256  # memory_table's _at_batch
STEPS = {  # label -> (row name, reference row name, needs), per model
  **{m: memory_table.TPU_STEPS for m in list(MODELS)[:2]},
  list(MODELS)[2]: memory_table.VIT_STEPS,
  list(MODELS)[3]: memory_table.VIT_MICROBATCH_STEPS,
}


def _group(model: str) -> str:
  """The xdist group: the ViT's compiles (about 11 GB each) on one worker, the FSDP ones on the
  other, so that two never run at once on a machine of 24 GB."""
  return "fsdp" if model.startswith("FSDP") else "vit"


def _met_cells() -> list:
  """(model, label, dtype) of every TPU cell the recorded table marks met."""
  table = json.loads((RESULTS / "memory_table.json").read_text())["rows"]
  cells = []
  for row in table:
    if row["model"] not in MODELS or row["step"].endswith("(reference)"):
      continue
    for dtype in ("f32", "bf16"):
      if row.get(dtype, {}).get("met"):
        cell = (row["model"], row["step"], row["over"], dtype)
        cells.append(pytest.param(*cell, marks=pytest.mark.xdist_group(_group(row["model"]))))
  return cells


def _step(model: str, label: str, over: str) -> tuple:
  """(row name, reference, needs) of a table row, from memory_table's step lists."""
  found = [s[1:] for s in STEPS[model] if s[0] == label and s[2] == over]
  assert len(found) == 1, (model, label, over)
  return found[0]


@functools.cache
def _compiled_row(model: str, name: str, dtype: str) -> dict:
  """One step's figures compiled now, at the model and batch its result file records."""
  recorded = json.loads((RESULTS / MODELS[model]).read_text())
  config = {k: v for k, v in recorded["model"].items() if k != "name"}
  if model.startswith("FSDP"):
    kind = DecoderConfig if recorded["model"]["name"] == "decoder" else MLPConfig
    mesh = tpu_sharded.tpu_mesh(recorded["topology"])
    row, _ = tpu_sharded.compile_row(mesh, kind(**config), dtype, name, recorded["per_core_batch"])
    jax.clear_caches()
    return row
  mesh = tpu_compile.tpu_mesh(recorded["topology"])
  if model.endswith("256 images"):
    method = name.rsplit(" mb=", 1)[0]
    contender = tpu_compile.microbatch_contender(4, "whole", method)
    per_core = VIT_MICROBATCH_BATCH
  else:
    contender, per_core = tpu_compile.CONTENDERS[name], recorded["per_core_batch"]
  compiled, param_bytes, _ = tpu_compile.compile_step(
    mesh, ViTConfig(**config), tpu_compile.DTYPES[dtype], contender, per_core
  )
  row = {"param_bytes": param_bytes, **analyse(compiled)}
  del compiled
  jax.clear_caches()  # The executables and their traces: a worker compiles up to 17 programs.
  return row


@pytest.mark.tpu_limits
@needs_libtpu
@pytest.mark.parametrize(("model", "label", "over", "dtype"), _met_cells())
def test_a_met_memory_limit_stays_met(model, label, over, dtype):
  name, reference, needs = _step(model, label, over)
  cell = memory_table.tpu_cell(
    _compiled_row(model, name, dtype), _compiled_row(model, reference, dtype), needs
  )
  assert cell["met"], (model, label, dtype, cell)


DECODER = "FSDP decoder 1.04B, v4-64"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["gsam", "sam"])
@pytest.mark.xdist_group(_group(DECODER))
@pytest.mark.tpu_limits
@needs_libtpu
def test_decoder_all_reduces_at_most_two_more_than_optax_contrib_sam(name, dtype):
  count = lambda n: _compiled_row(DECODER, n, dtype)["collectives"]["all-reduce"]["count"]
  assert count(name) <= count("optax.contrib.sam") + 2, (count(name), count("optax.contrib.sam"))


def test_every_met_cell_names_steps_the_guard_can_compile():
  """The wiring, without compiling: each met cell's step and reference are contenders the
  benchmark scripts build, so the guard cannot silently check fewer cells than the table has."""
  cells = [p.values for p in _met_cells()]
  assert len(cells) >= 20, len(cells)
  for model, label, over, _ in cells:
    name, reference, _ = _step(model, label, over)
    if model.startswith("FSDP"):
      known = set(tpu_sharded.CONTENDERS)
    elif model.endswith("256 images"):
      known = {
        f"{m} mb=4" for m in [*tpu_compile.MICROBATCH_METHODS, tpu_compile.MICROBATCH_BASELINE]
      }
    else:
      known = set(tpu_compile.CONTENDERS)
    assert {name, reference} <= known, (model, name, reference)
