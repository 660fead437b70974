"""Trajectory losses: SAF's and MESA's term that keeps the outputs close to past ones.

SAF (a store of each example's outputs, recorded some epochs before) and MESA
(the outputs of an exponential moving average of the weights) add a KL term to
the loss instead of a second gradient evaluation. This folder holds the term
itself (``loss``), SAF's store (``saf``) and MESA's averaged weights
(``mesa``). It reads only ``core``.
"""
