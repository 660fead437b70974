"""Exact full-batch gradients of batch-coupled losses chunk by chunk, and the contrastive losses."""
