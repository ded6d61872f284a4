"""Rule tables, one module per op family; importing this package fills the registry."""
from . import (annotate, attention, embedding, factory, loss, matmul, misc, norm, optimizer,  # noqa: F401
               pointwise, reduction, softmax, views)
