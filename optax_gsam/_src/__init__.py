"""Private implementation of optax_gsam; import from :mod:`optax_gsam` instead."""
