"""Data-parallel train steps: shard_map on a mesh, and devices emulated with vmap."""
