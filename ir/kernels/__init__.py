"""The kernels of autopar's own op targets, registered in the op table (``ir.ops``) with
their traits as this package loads:

* ``sharded`` — what a rank runs for an op on sharded pieces when the ATen call cannot say
  it (vocab-parallel embedding and nll_loss, means over a global count, empty pieces,
  the annotation identity); the local forms in ``spmd/local_forms`` choose them;
* ``random`` — a rank's slice of one global random draw;
* ``pipeline`` — a micro-batch's slice or term of a value;
* ``rng`` — reading and setting the generator (recomputed and pipelined random ops);
* ``optim`` — torch.optim's own update functions, one param or one param group per call;
* ``amp`` — loss scaling's check for inf/nan and unscale, one read of each gradient;
* ``offload`` — copies between the device and host memory (``sharding.offload``);
* ``ring`` — ring attention's shift and blocks, as torch operators (context parallelism).
"""
from . import (  # noqa: F401
    amp,
    generator_state,
    offload,
    optim,
    pipeline,
    ring,
    sharded,
    sliced_draws,
)
