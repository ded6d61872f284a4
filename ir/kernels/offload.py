"""Kernels that move values between the device and host memory (``sharding.offload``,
``passes/offload_states.py``):

* ``autopar.to_host(x)`` — a copy of ``x`` in pinned host memory, started on a side
  stream as soon as ``x`` is made (a gradient, as the backward makes it), so the copy
  overlaps the rest of the backward and the host does not wait for it here;
* ``autopar.host_ready(*xs)`` — waits for those copies, once, before a run of host
  updates reads them (the updates of a param group stay one batched call);
* ``autopar.to_device(x)`` — ``x`` on the device the process computes on (a parameter the
  host updated or keeps), copied without blocking: later kernels on the compute stream
  read it after the copy, and the pinned source is not reused before (torch's pinned
  allocator records the copy).

On a process that computes on the CPU every one returns its input: both homes are the same
memory. While ``torch.compile`` traces, the copies are plain ``Tensor.to`` (Inductor orders
its devices' work itself) and the waits vanish.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..core import Value
from ..ops import kernel
from .generator_state import compute_device

__all__ = ["HOST", "COPIES", "to_host", "host_ready", "to_device", "before_copies"]

HOST = torch.device("cpu")
COPIES = frozenset({"autopar.to_host", "autopar.host_ready", "autopar.to_device"})
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()   # host copy -> the event that ends it
_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


@kernel("autopar.to_host")
def to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    if torch.compiler.is_compiling():
        return x.to(HOST)
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    stream = _copy_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))    # x is made before the copy
    with torch.cuda.stream(stream):
        out.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)          # x's memory is not reused while the copy reads it
    _PENDING[out] = done
    return out


@kernel("autopar.host_ready")
def host_ready(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if torch.compiler.is_compiling():       # its copies were plain ``Tensor.to``
        return xs
    for x in xs:
        done = _PENDING.pop(x, None)
        if done is not None:
            done.synchronize()
    return xs


@kernel("autopar.to_device")
def to_device(x: torch.Tensor) -> torch.Tensor:
    device = compute_device()
    if x.device == device or (device.type == x.device.type == "cpu"):
        return x
    return x.to(device, non_blocking=not torch.compiler.is_compiling())


def before_copies(value: Value) -> Value:
    """The value ``value`` is a copy of (between the device and the host), else itself."""
    while value.producer is not None and value.producer.target in COPIES:
        copy = value.producer
        value = copy.args[value.index if copy.target == "autopar.host_ready" else 0]
    return value
