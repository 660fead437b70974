"""The compiled-program lab: steps compiled ahead of time for described TPU and GPU hosts."""
