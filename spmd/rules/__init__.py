"""Rule tables, one module per op family; importing this package fills the registry."""
from . import (  # noqa: F401
    annotate,
    attention,
    conv,
    embedding,
    factory,
    loss,
    matmul,
    misc,
    norm,
    optimizer,
    pointwise,
    reduction,
    scatter,
    softmax,
    view_writes,
    views,
)
