"""A batch split into micro-batches: accumulation, PRNG keys and model state per micro-batch."""
