"""Frozen parameters: neither perturbed nor differentiated."""
