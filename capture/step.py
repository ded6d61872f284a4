"""Capture a whole training step (forward, loss, backward) into one IR Program.

We trace ``functional_call`` + ``torch.autograd.grad`` with ``make_fx`` over fake tensors, so
parameters are program state and gradients are program values (tracing ``loss.backward()``
on a live module would bake parameters in as constants). Two pieces of node metadata are
made on the way, through ``torch.fx.traceback``'s preserved meta:

* the module path of every forward op, from global module hooks;
* for every backward op, the autograd sequence number of the forward op it differentiates,
  from pre/post hooks on the autograd graph (the same trick aot_autograd uses).
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses import fake_tensor
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..ir import StateKey, state_op
from ..ir.attrs import BATCH_PATH, NAME, SLOTS
from ..ir.core import Op, OpKind, Program, Role, Slot, Value
from ..ir.from_fx import FxImporter, value_type
from .experts import dense_experts
from .mixed_precision import FULL_PRECISION, Precision, device_type
from .ring_attention import ring_attention_mode


class CaptureError(RuntimeError):
    pass


class CaptureNote(UserWarning):
    """What capture changed in how the model computes (never in what it computes)."""


# --------------------------------------------------------------------------------------
# metadata recorded while tracing
# --------------------------------------------------------------------------------------
class _Annotator:
    """Stamps phase and module path into fx's current meta, so each created node keeps it."""

    def __init__(self, model: torch.nn.Module | None):
        self.paths = {id(m): name for name, m in model.named_modules()} if model else {}
        self.module_stack: list[str] = []
        self.phase = "fwd"

    def module(self) -> str:
        """The module the trace is in now ('' at the top level)."""
        return self.module_stack[-1] if self.module_stack else ""

    def _publish(self) -> None:
        module = self.module_stack[-1] if self.module_stack else ""
        fx_traceback.current_meta["custom"] = {"phase": self.phase, "module": module}

    @contextlib.contextmanager
    def in_phase(self, phase: str, module: str | None = None):
        saved = (self.phase, list(self.module_stack))
        self.phase = phase
        if module is not None:
            self.module_stack = [module]
        self._publish()
        try:
            yield
        finally:
            self.phase, self.module_stack = saved
            self._publish()

    def _pre_hook(self, module, args):
        if id(module) in self.paths:
            self.module_stack.append(self.paths[id(module)])
            self._publish()

    def _post_hook(self, module, args, out):
        if id(module) in self.paths and self.module_stack:
            self.module_stack.pop()
            self._publish()

    @contextlib.contextmanager
    def tracing(self):
        register = torch.nn.modules.module
        hooks = [register.register_module_forward_pre_hook(self._pre_hook),
                 register.register_module_forward_hook(self._post_hook)]
        try:
            with fx_traceback.preserve_node_meta():
                self._publish()
                yield
        finally:
            for h in hooks:
                h.remove()


def _mark_grad_fn(seq: int | None) -> None:
    """Record in the preserved ``custom`` meta which autograd node is running (None between
    nodes). fx's own ``seq_nr`` falls back to the last forward node outside a node's
    backward, which would link the engine's gradient accumulation (the ``add`` summing the
    gradients of a value used twice) to the loss."""
    custom = dict(fx_traceback.current_meta.get("custom") or {})
    if seq is None:
        custom.pop("grad_fn", None)
    else:
        custom["grad_fn"] = seq
    fx_traceback.current_meta["custom"] = custom


def _link_backward_to_forward(root: torch.autograd.graph.Node | None) -> None:
    """While autograd runs a node's backward, mark created fx nodes with that node's
    sequence number; the forward op that created the node carries the same number."""
    if root is not None:    # the loss's own gradient (the seed) is made before any node runs
        _mark_grad_fn(root._sequence_nr())
    seen: set = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()

        def enter(grad_outputs, seq=seq):
            fx_traceback.current_meta["in_grad_fn"] = 1
            fx_traceback.current_meta["grad_fn_seq_nr"] = [seq]
            _mark_grad_fn(seq)

        def leave(grad_inputs, grad_outputs):
            fx_traceback.current_meta.pop("in_grad_fn", None)
            fx_traceback.current_meta.pop("grad_fn_seq_nr", None)
            _mark_grad_fn(None)

        node.register_prehook(enter)
        node.register_hook(leave)
        todo.extend(nxt for nxt, _ in node.next_functions)


# --------------------------------------------------------------------------------------
# model outputs: dicts, dataclasses and tuples with the loss inside
# --------------------------------------------------------------------------------------
class _Static:
    """A non-tensor output leaf (``loss=None`` in predict, a flag): it rides in the tree
    spec as context, so the program returns tensors only and unflattening the spec with
    them restores the value itself."""

    def __init__(self, value: Any):
        self.value = value


pytree.register_pytree_node(_Static, lambda s: ([], s.value), lambda _, value: value)


def _to_tree(out: Any, path: str = "output") -> Any:
    """The model output as a pytree of tensors: dataclasses (not registered with pytree)
    become dicts of their fields, plain Python values become static leaves."""
    if isinstance(out, torch.Tensor):
        return out
    if out is None or isinstance(out, (bool, int, float, str, torch.Size)):
        return _Static(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: _to_tree(getattr(out, f.name), f"{path}.{f.name}")
                for f in dataclasses.fields(out)}
    if isinstance(out, dict):
        return {k: _to_tree(v, f"{path}[{k!r}]") for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        items = [_to_tree(v, f"{path}[{i}]") for i, v in enumerate(out)]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    raise CaptureError(
        f"model {path} is a {type(out).__name__}: autopar returns tensors (and plain Python "
        "values) from eval/predict programs, not objects built during tracing. Stop the "
        "model from returning it (Hugging Face models: config.use_cache = False).")


def loss_from_output(out: Any) -> torch.Tensor:
    """The loss a model returns itself: key/attribute ``loss`` or the first element."""
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    if hasattr(out, "loss") and isinstance(getattr(out, "loss"), torch.Tensor):
        return out.loss
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    raise CaptureError(
        "loss=None needs the model to return its loss: a scalar tensor, a dict with key "
        "'loss', an object with a .loss tensor, or a tuple starting with it; got "
        f"{type(out).__name__}")


# --------------------------------------------------------------------------------------
# the traced step
# --------------------------------------------------------------------------------------
@dataclass
class StepSpec:
    """What a captured program computes and how a user's batch maps onto its inputs."""

    mode: str                    # "train" | "eval" | "predict"
    batch_spec: pytree.TreeSpec  # structure of (inputs, labels)
    output_spec: pytree.TreeSpec | None = None   # structure of the model output (eval/predict)
    output_type: Any = None      # original output class, to rebuild dataclasses


def call_model(model: torch.nn.Module, inputs: Any, labels: Any, loss_fn: Callable | None):
    """How a batch is fed: dict inputs as keywords, tuples positionally; with loss=None the
    labels go to the model (as ``labels=`` for dict inputs, positionally otherwise)."""
    args, kwargs = (), {}
    if isinstance(inputs, dict):
        kwargs = dict(inputs)
    elif isinstance(inputs, (list, tuple)):
        args = tuple(inputs)
    else:
        args = (inputs,)
    if loss_fn is None and labels is not None:
        if kwargs:
            kwargs["labels"] = labels
        else:
            args = args + (labels,)
    return args, kwargs


def flatten_batch(inputs: Any, labels: Any) -> tuple[list[torch.Tensor], Callable[[list], Any]]:
    """The batch's tensors in a fixed order, and how to rebuild ``(inputs, labels)`` from
    them; non-tensor leaves (None labels, flags) stay as they are, part of the signature."""
    leaves, spec = pytree.tree_flatten((inputs, labels))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(tensors: list) -> Any:
        full = list(leaves)
        for i, t in zip(positions, tensors, strict=True):
            full[i] = t
        return pytree.tree_unflatten(full, spec)

    return [leaves[i] for i in positions], rebuild


def batch_paths(inputs: Any, labels: Any) -> list[str]:
    """Each batch tensor's place in ``(inputs, labels)``, in ``flatten_batch`` order:
    ``inputs``, ``inputs.input_ids``, ``inputs.0``, ``labels`` (what a strategy's
    ``batch_dim`` mapping names)."""
    paths, _ = pytree.tree_flatten_with_path({"inputs": inputs, "labels": labels})
    return [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, leaf in paths if isinstance(leaf, torch.Tensor)]


def _named_state(model: torch.nn.Module):
    params = dict(model.named_parameters())          # tied weights appear once
    buffers = dict(model.named_buffers())
    return params, buffers


def _module_in_traceback(exc: BaseException, model: torch.nn.Module) -> tuple[str, str]:
    paths = {id(m): name for name, m in model.named_modules()}
    found = ("<model>", "")
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            found = (paths[id(owner)] or type(owner).__name__,
                     f"{frame.f_code.co_filename}:{lineno}")
    return found


_DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (
        getattr(fake_tensor, "DataDependentOutputException", None),
        getattr(fake_tensor, "DynamicOutputShapeException", None),
        getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None),
    ) if cls is not None)


class BatchDimError(ValueError):
    """A ``batch_dim`` that names no fed tensor, or a dim a fed tensor does not have."""


def batch_dim_of(spec: int | dict[str, int], path: str, shape: tuple[int, ...]) -> int:
    """The batch dim of the fed tensor at ``path``: the longest listed path it is under."""
    dim = spec if isinstance(spec, int) else 0
    if isinstance(spec, dict):
        under = [p for p in spec if path == p or path.startswith(p + ".")]
        if under:
            dim = spec[max(under, key=len)]
    if dim >= len(shape):
        raise BatchDimError(f"batch_dim {dim} for the fed tensor {path} of shape "
                            f"{list(shape)}: it has {len(shape)} dims")
    return dim


def batch_size_of(inputs: Any, batch_dim: int | dict[str, int] = 0) -> int:
    """Rows of the batch: the size of the first input tensor's batch dim (the strategy's
    ``batch_dim``)."""
    leaves, _ = flatten_batch(inputs, None)
    for path, leaf in zip(batch_paths(inputs, None), leaves):
        if leaf.dim() > 0:
            return int(leaf.shape[batch_dim_of(batch_dim, path, tuple(leaf.shape))])
    return 1


def trace_step(model: torch.nn.Module, loss_fn: Callable | None, inputs: Any, labels: Any,
               mode: str, precision: Precision | None = None, ring_pieces: int = 1
               ) -> tuple[fx.GraphModule, StepSpec, list[str], list[str], dict]:
    """make_fx over one step; returns the graph, the step spec, the names of the
    parameters and buffers in placeholder order, and the layout of the flat results
    (``[loss] + grads + outputs``: which parameters got a gradient, how many outputs).
    ``precision``: the forward and the loss in mixed precision (``capture/mixed_precision.py``).
    ``ring_pieces`` > 1: attention as ring attention over that many chunks of the sequence
    (``capture/ring_attention.py``)."""
    params, buffers = _named_state(model)
    param_names, buffer_names = list(params), list(buffers)
    trainable = [n for n in param_names if params[n].requires_grad] if mode == "train" else []
    batch_leaves, rebuild_batch = flatten_batch(inputs, labels)
    spec = StepSpec(mode, pytree.tree_structure((inputs, labels)))
    notes = _Annotator(model)
    layout: dict[str, Any] = {"grads": [], "outputs": 0, "dense_experts": [],
                              "ring_pieces": ring_pieces, "ring_calls": 0}

    amp = precision or FULL_PRECISION
    autocast_device = device_type(batch_leaves + list(params.values()))

    def step(param_values, buffer_values, leaves):
        x, y = rebuild_batch(amp.inputs(leaves))
        master = dict(zip(param_names, param_values))
        read = amp.params(master, lambda n: notes.in_phase("fwd", module=n.rpartition(".")[0]))
        state = {**read, **dict(zip(buffer_names, buffer_values))}
        args, kwargs = call_model(model, x, y, loss_fn)
        with (notes.in_phase("fwd"), amp.autocast(autocast_device),
              ring_attention_mode(ring_pieces, notes.module) as ring):
            out = torch.func.functional_call(model, state, args, kwargs, strict=False)
        layout["ring_calls"] = ring.calls
        out = amp.outputs(out)
        results: list[torch.Tensor] = []
        if mode != "predict":
            with notes.in_phase("loss", module="<loss>"), amp.autocast(autocast_device):
                loss = loss_fn(out, y) if loss_fn is not None else loss_from_output(out)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise CaptureError(f"the loss must be a scalar tensor, got {_describe(loss)}")
            results.append(loss)
        if mode == "train":
            with notes.in_phase("bwd"):
                _link_backward_to_forward(loss.grad_fn)
                wrt = [master[n] for n in trainable]
                grads = torch.autograd.grad(loss, wrt, allow_unused=True) if wrt else ()
            # unused parameters get no gradient (torch.optim then skips them)
            layout["grads"] = [n for n, g in zip(trainable, grads) if g is not None]
            results += [g for g in grads if g is not None]
        else:
            out_leaves, spec.output_spec = pytree.tree_flatten(_to_tree(out))
            spec.output_type = type(out)
            layout["outputs"] = len(out_leaves)
            results += out_leaves
        return results

    was_training = model.training
    model.train(mode == "train")
    try:
        with notes.tracing(), dense_experts(model) as layout["dense_experts"]:
            param_values, buffer_values = _traceable(
                [params[n].detach().requires_grad_(params[n].requires_grad) for n in param_names],
                [buffers[n] for n in buffer_names], batch_leaves)
            gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(
                param_values, buffer_values, _distinct(batch_leaves))
    except _DATA_DEPENDENT_ERRORS as exc:
        module, where = _module_in_traceback(exc, model)
        raise CaptureError(
            f"data-dependent Python control flow in module '{module}' ({where}): autopar "
            "captures one static graph of the step, so a Python `if`/`while` on a tensor's "
            "value cannot be traced. Rewrite it with torch.cond / torch.where. "
            + _moe_hint(model, module) +
            f"Underlying error: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    finally:
        model.train(was_training)
    _refuse_value_dependent_shapes(gm, model)
    return gm, spec, param_names, buffer_names, layout


def _traceable(params: list[torch.Tensor], buffers: list[torch.Tensor], batch: list[Any]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters and buffers as tracing sees them: a model built on the meta device (to be
    materialized later, piece by piece) traces as fake tensors on the batch's device, so
    its ops meet the batch on one device; real ones are left for make_fx to fake."""
    if not any(t.is_meta for t in params + buffers):
        return params, buffers
    device = next((x.device for x in batch if isinstance(x, torch.Tensor)), torch.device("cpu"))
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return mode.from_tensor(t)
        with mode:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return out.requires_grad_(t.requires_grad)

    return [fake(t) for t in params], [fake(t) for t in buffers]


def _refuse_value_dependent_shapes(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """make_fx traces ``nonzero`` / boolean-mask indexing with a symbolic size when nothing
    branches on it; a static plan cannot hold such a value, so name its first op."""
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else [vals]
        if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)
               for v in vals):
            module = (node.meta.get("custom") or {}).get("module") or "<model>"
            raise CaptureError(
                f"{node.target} in module '{module}' makes a tensor whose shape depends on "
                f"tensor values ({[tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)]}"
                "): autopar captures one static graph of the step, so every shape must "
                "follow from the batch's shape. " + _moe_hint(model, module))


def _moe_hint(model: torch.nn.Module, path: str) -> str:
    """What to do when the failing module looks like a mixture of experts (it holds a
    stack of per-expert weights, or a ModuleList of experts): the routing loop is the
    usual culprit."""
    module = dict(model.named_modules()).get("" if path == "<model>" else path)
    if module is None:
        return ""
    stacked = any(p.dim() == 3 for p in module.parameters(recurse=False))
    listed = any(isinstance(c, torch.nn.ModuleList) and "expert" in n.lower()
                 for n, c in module.named_children())
    if not (stacked or listed or "expert" in path.lower()):
        return ""
    return ("It looks like a mixture-of-experts dispatch (a loop over the experts that were "
            "hit): write it densely, with no value-dependent shapes: every expert on every "
            "token, weighted by a [tokens, experts] matrix that holds each token's routing "
            "weight for its top-k experts and zeros elsewhere (see autopar.capture.experts."
            "dense_experts_forward), or decorate the experts class with transformers' "
            "use_experts_implementation (3-D gate_up_proj/down_proj weights), whose "
            "modules autopar captures with that dense dispatch itself. ")


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One object per batch leaf: make_fx maps one tensor object to one placeholder, so a
    tensor passed as both input and label (``prepare(x, x)``) would make the program read
    one feed for both, and later batches with different labels would be wrong."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        out.append(t.clone() if id(t) in seen else t)
        seen.add(id(t))
    return out


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return type(x).__name__


def _attribute_paths(model: torch.nn.Module) -> dict[int, str]:
    """Plain tensor attributes (neither parameter nor buffer, e.g. a rotary ``inv_freq``)
    by identity -> their dotted path; make_fx bakes them into the graph as constants."""
    return {id(v): f"{prefix}.{k}" if prefix else k
            for prefix, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)}


# --------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------
@dataclass
class Captured:
    program: Program
    spec: StepSpec
    param_names: list[str]
    buffer_names: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)   # what capture changed


def capture(model: torch.nn.Module, loss_fn: Callable | None, inputs: Any, labels: Any,
            mode: str = "train", precision: Precision | None = None,
            ring_pieces: int = 1) -> Captured:
    """Trace one step of ``model`` on a sample batch into a Program.

    ``mode`` is ``train`` (loss and gradients), ``eval`` (loss and outputs) or ``predict``
    (outputs). Shapes are specialised to the sample batch. ``precision``: mixed precision
    (O1 autocast, O2 half parameters), see ``capture/mixed_precision.py``. ``ring_pieces``:
    attention as ring attention over that many chunks of the sequence (context parallelism,
    ``capture/ring_attention.py``).
    """
    if mode not in ("train", "eval", "predict"):
        raise ValueError(f"unknown capture mode {mode!r}")
    gm, spec, param_names, buffer_names, layout = trace_step(model, loss_fn, inputs, labels, mode,
                                                             precision, ring_pieces)
    notes = _capture_notes(layout)
    for note in notes:
        warnings.warn(note, CaptureNote, stacklevel=2)
    program = Program()
    params, buffers = _named_state(model)

    def state_value(key: StateKey, tensor: torch.Tensor) -> Value:
        return program.add(state_op(key, value_type(tensor))).outputs[0]

    placeholders: list[Value] = [state_value(StateKey.of_param(n), params[n])
                                 for n in param_names]
    placeholders += [state_value(StateKey.of_buffer(n), buffers[n]) for n in buffer_names]
    batch_leaves, _ = flatten_batch(inputs, labels)
    for i, (leaf, path) in enumerate(zip(batch_leaves, batch_paths(inputs, labels),
                                         strict=True)):
        op = Op(OpKind.INPUT, "input", outputs=[Value(value_type(leaf))],
                attrs={NAME: f"batch/{i}", BATCH_PATH: path})
        placeholders.append(program.add(op).outputs[0])

    importer = FxImporter(program, gm, attribute_paths=_attribute_paths(model))
    traced = list(importer.run(placeholders))
    results: list[tuple[Slot, Value]] = []
    if mode != "predict":
        results.append((Slot("loss"), traced.pop(0)))
    for name in layout["grads"]:
        results.append((Slot("grad", name), traced.pop(0)))
    for i, out in enumerate(traced):
        if not isinstance(out, Value):
            raise CaptureError(f"model output leaf {i} is a {type(out).__name__}, not a tensor")
        results.append((Slot("output", str(i)), out))
    program.add(Op(OpKind.OUTPUT, "output", args=tuple(v for _, v in results),
                   role=Role.FORWARD, attrs={SLOTS: tuple(s for s, _ in results)}))
    return Captured(program, spec, param_names, buffer_names, notes)


def _capture_notes(layout: dict[str, Any]) -> list[str]:
    notes = []
    if layout["ring_pieces"] > 1 and not layout["ring_calls"]:
        notes.append("context_parallel method ring: the model calls no "
                     "scaled_dot_product_attention, so no attention became ring attention; "
                     "an attention written in plain ops (matmul, softmax) is split by the "
                     "ordinary rules, which gather the keys")
    paths = layout["dense_experts"]
    if not paths:
        return notes
    return notes + [f"captured {len(paths)} mixture-of-experts module(s) ({', '.join(paths)}) with "
            "autopar's dense dispatch instead of their experts_implementation (eager loop, "
            "grouped_mm, batched_mm: shapes that depend on the routing): every expert runs on "
            "every token and each token sums its top-k experts' outputs times their routing "
            "weights, the same math with static shapes (experts/top_k times the expert "
            "FLOPs); see autopar.capture.experts"]
