"""Gradient rules, one module per op family; importing this package registers them all."""
from ngdist.passes.autodiff.rules import (  # noqa: F401
    activation,
    conv,
    elementwise,
    indexing,
    linalg,
    loss,
    norm,
    pointwise,
    pool,
    reduce,
    select,
    shape,
)
