"""Passes: the planned program, one transformation per file, run in order (``PIPELINE``) by
``autopar.pass_infra.manager``. Each pass declares the facts it needs and makes and the
strategy sections it implements; what passes share (their context and facts, pinning,
explanations) lives in ``autopar.pass_infra``, and lowering (``autopar.lower``) makes each
rank's program from the result.

    decompose_loss, fold_noops, dead_code        clean up the captured step
    refuse_unmasked_padding                      sequence padding no real position reads
    functionalize_writes                         writes through views made out of place
    scale_loss, skip_nonfinite_steps             loss scaling (amp.loss_scale)
    clip_grad, optimizer_updates                 gradient clipping and the optimizer's updates
    vocab_parallel_loss                          log_softmax decomposed where classes may shard
    sync_batch_norm                              batch norm's statistics all-reduced under dp
    settle_mesh                                  the mesh and pipeline the program runs on
    pin_annotations, tensor_parallel_plan,       the placements the user gave (shard_tensor,
      expert_parallel, zero_sharding,              the tp plan, experts, ZeRO, Megatron-SP,
      sequence_parallel, shard_batch               the batch)
    split_stages                                 each forward/backward op's pipeline stage
    regroup_flattens                             where a reshape may keep a merged shard
    completion                                   a placement for every value (SPMD rules)
    gradient_reduce_dtype                        the dtype gradients are reduced in (amp)
    merge_gradients                              gradients accumulated over k batches
    reshard                                      communication where placements differ
    ring_shifts                                  ring attention's passes as p2p shifts
    recompute                                    activations recomputed for the backward
    bucket_collectives, join_gradients           fewer, larger, asynchronous collectives
    regather_for_backward, prefetch_gathers,     ZeRO's gathers and early reduce-scatters
      scatter_gradients_early, gather_updates
    offload_states                               state kept in host memory, updated there
    assign_phases, schedule_pipeline             a pipeline's phases and job order
"""
from ..ir import Program
from ..pass_infra.context import Fact, PassContext
from ..pass_infra.explain import format_explanations
from ..pass_infra.manager import Pass, PassManager, make_pass
from .assign_phases import assign_phases
from .bucket_collectives import bucket_collectives
from .clip_grad import clip_grad
from .completion import completion
from .dead_code import dead_code
from .decompose_loss import decompose_loss
from .expert_parallel import expert_parallel
from .fold_noops import fold_noops
from .functionalize_writes import functionalize_writes
from .gather_updates import gather_updates
from .gradient_reduce_dtype import format_casts, gradient_reduce_dtype
from .join_gradients import join_gradients
from .merge_gradients import merge_gradients
from .offload_states import offload_states
from .optimizer_updates import optimizer_updates
from .pin_annotations import pin_annotations
from .prefetch_gathers import prefetch_gathers
from .recompute import format_recompute, recompute
from .refuse_unmasked_padding import refuse_unmasked_padding
from .regather_for_backward import regather_for_backward
from .regroup_flattens import regroup_flattens
from .reshard import reshard
from .ring_shifts import ring_shifts
from .scale_loss import scale_loss
from .scatter_gradients_early import scatter_gradients_early
from .schedule_pipeline import format_schedule, schedule_pipeline
from .sequence_parallel import sequence_parallel
from .settle_mesh import settle_mesh
from .shard_batch import shard_batch
from .skip_nonfinite_steps import skip_nonfinite_steps
from .split_stages import split_stages
from .sync_batch_norm import sync_batch_norm
from .tensor_parallel_plan import tensor_parallel_plan
from .vocab_parallel_loss import vocab_parallel_loss
from .zero_sharding import zero_sharding

__all__ = ["PIPELINE", "pass_manager"]


def _explanations(program: Program, ctx: PassContext) -> str:
    return format_explanations(program) if ctx.state.mesh is not None else ""


F, _pass = Fact, make_pass
ZERO, PIPE, AMP = ("sharding",), ("pipeline",), ("amp",)
# The passes, in order.
PIPELINE: tuple[Pass, ...] = (
    _pass("decompose_loss", decompose_loss),
    _pass("fold_noops", fold_noops),
    _pass("functionalize_writes", functionalize_writes),
    _pass("dead_code", dead_code),
    _pass("refuse_unmasked_padding", refuse_unmasked_padding, implements=("data",)),
    _pass("scale_loss", scale_loss, implements=AMP),
    _pass("clip_grad", clip_grad, implements=("grad_clip",)),
    _pass("optimizer_updates", optimizer_updates, makes=(F.OPTIMIZER,)),
    _pass("skip_nonfinite_steps", skip_nonfinite_steps, needs=(F.OPTIMIZER,), implements=AMP),
    _pass("vocab_parallel_loss", vocab_parallel_loss),
    _pass("sync_batch_norm", sync_batch_norm),
    _pass("settle_mesh", settle_mesh, makes=(F.MESH,), implements=("mesh",)),
    _pass("pin_annotations", pin_annotations, needs=(F.MESH,)),
    _pass("tensor_parallel_plan", tensor_parallel_plan, needs=(F.MESH,),
          implements=("tensor_parallel",)),
    _pass("expert_parallel", expert_parallel, needs=(F.MESH,), implements=("expert_parallel",)),
    _pass("zero_sharding", zero_sharding, needs=(F.MESH,), implements=ZERO),
    _pass("sequence_parallel", sequence_parallel, needs=(F.MESH,),
          implements=("tensor_parallel",)),
    _pass("shard_batch", shard_batch, needs=(F.MESH,),
          implements=("data_parallel", "context_parallel")),
    _pass("split_stages", split_stages, needs=(F.MESH,), makes=(F.STAGES,), implements=PIPE),
    _pass("regroup_flattens", regroup_flattens, needs=(F.MESH,)),
    _pass("completion", completion, needs=(F.MESH,), makes=(F.PLACED,),
          reports=(("explain", _explanations),)),
    _pass("gradient_reduce_dtype", gradient_reduce_dtype, needs=(F.PLACED,), implements=AMP,
          reports=(("amp", format_casts),)),
    _pass("merge_gradients", merge_gradients, needs=(F.OPTIMIZER, F.PLACED),
          implements=("gradient_merge",)),
    _pass("reshard", reshard, needs=(F.PLACED,), makes=(F.RESHARDED,)),
    _pass("ring_shifts", ring_shifts, needs=(F.RESHARDED,), implements=("context_parallel",)),
    _pass("recompute", recompute, needs=(F.RESHARDED,), implements=("recompute",),
          reports=(("recompute", format_recompute),)),
    _pass("bucket_collectives", bucket_collectives, needs=(F.RESHARDED, F.STAGES)),
    _pass("regather_for_backward", regather_for_backward, needs=(F.RESHARDED,),
          implements=ZERO, reports=(("explain", _explanations),)),
    _pass("prefetch_gathers", prefetch_gathers, needs=(F.RESHARDED,), implements=ZERO),
    _pass("scatter_gradients_early", scatter_gradients_early, needs=(F.RESHARDED,),
          implements=ZERO),
    _pass("gather_updates", gather_updates, needs=(F.RESHARDED,), implements=ZERO),
    _pass("join_gradients", join_gradients, needs=(F.RESHARDED, F.STAGES)),
    _pass("offload_states", offload_states, needs=(F.RESHARDED,), implements=ZERO),
    _pass("assign_phases", assign_phases, needs=(F.RESHARDED, F.STAGES), makes=(F.PHASES,),
          implements=PIPE),
    _pass("schedule_pipeline", schedule_pipeline, needs=(F.PHASES,), makes=(F.SCHEDULE,),
          implements=PIPE, reports=(("jobs", format_schedule),)),
)


def pass_manager(**options) -> PassManager:
    """A manager of ``PIPELINE`` (``options``: ``verify``, ``dump_dir``, ``dump_formats``,
    ``disabled``)."""
    return PassManager(PIPELINE, **options)
