"""A described GPU host for compiling ahead of time with no GPU attached (jax's CUDA plugin).

XLA's GPU compiler takes the device it compiles for as a target description (a
``GpuTargetConfigProto`` in text form): the limits its emitters and fusion heuristics read
(threads, shared memory, registers, cores), the memory its rematerialization and the buffer
assignment fit in, and the CUDA and cuDNN versions. With the description, jax's CUDA plugin
lays out a topology of such devices (``jax.experimental.topologies.get_topology_desc(
platform="cuda", ...)``) and ``jax.jit(...).lower(...).compile()`` gives the program the GPUs
would run, with its ``memory_analysis()`` and optimized HLO, on a CPU-only host. JAX itself must
run on the CPU (``JAX_PLATFORMS=cpu``, set by ``aot_env`` before jax is imported).

The figures are an H100 SXM 80 GB's, from NVIDIA's published specification (compute
capability 9.0, 132 multiprocessors, 80 GiB of HBM3 less what the driver reserves).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  name: str
  compute_capability: tuple[int, int]
  multiprocessors: int
  memory_bytes: int
  memory_bandwidth: int  # bytes per second
  l2_cache_bytes: int
  clock_ghz: float
  shared_memory_per_multiprocessor: int
  shared_memory_per_block_optin: int


H100_SXM = GpuTarget(
  name="NVIDIA H100 80GB HBM3",
  compute_capability=(9, 0),
  multiprocessors=132,
  memory_bytes=84_942_979_072,  # what cudaMemGetInfo reports as total on an H100 80 GB
  memory_bandwidth=3_352_320_000_000,
  l2_cache_bytes=50 * 2**20,
  clock_ghz=1.98,
  shared_memory_per_multiprocessor=228 * 1024,
  shared_memory_per_block_optin=227 * 1024,
)
TARGETS = {"h100": H100_SXM}
# The share of a GPU's memory JAX's client preallocates and runs in by default.
CLIENT_MEMORY_FRACTION = 0.75


def target_config(target: GpuTarget, memory_bytes: int | None = None) -> str:
  """The target description XLA's GPU compiler reads, as a text proto.

  ``memory_bytes`` replaces the device's memory: the largest-batch search compiles against a
  smaller device to see where the compiler's own verdict falls.
  """
  major, minor = target.compute_capability
  memory = target.memory_bytes if memory_bytes is None else memory_bytes
  fields = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_core": target.shared_memory_per_multiprocessor,
    "threads_per_core_limit": 2048,
    "core_count": target.multiprocessors,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "memory_bandwidth": target.memory_bandwidth,
    "l2_cache_size": target.l2_cache_bytes,
    "clock_rate_ghz": target.clock_ghz,
    "device_memory_size": memory,
    "shared_memory_per_block_optin": target.shared_memory_per_block_optin,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
  }
  lines = [f"  {key}: {value}" for key, value in fields.items()]
  lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
  return "\n".join(
    [
      "gpu_device_info {",
      *lines,
      "}",
      'platform_name: "CUDA"',
      "dnn_version_info { major: 9 minor: 8 patch: 0 }",
    ]
  )


def set_compile_flags() -> None:
  """XLA flags for compiling without a device, set before the backend starts.

  Without a device there is no autotuning, and some float32 dots then fail in the Triton GEMM
  tiler; the cuBLAS path compiles them (and is what the runtime picks for them anyway).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_triton_gemm" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_triton_gemm=false".strip()


def gpu_devices(target: GpuTarget, gpus: int, memory_bytes: int | None = None) -> list:
  """The devices of one host of ``gpus`` GPUs of ``target``, described, with none attached."""
  from jax.experimental import topologies

  set_compile_flags()
  topology = topologies.get_topology_desc(
    platform="cuda",
    target_config=target_config(target, memory_bytes),
    topology=f"1x1x{gpus}",
  )
  return list(topology.devices)
