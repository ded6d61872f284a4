"""Calibration on the launch's device (issue 28): the timer, where the probes' tensors live,
and the intra-/inter-node labels of the collective fits.

On the CPU the ``meta`` device stands in for a GPU: a probe made there and run there never
touches a CPU tensor. The CUDA tests skip without CUDA (CI never has one).
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar import calibrate as cal
from autopar.calibrate import collectives as cal_comm
from autopar.calibrate import ops as cal_ops
from autopar.calibrate import slowdown as cal_slowdown
from autopar.calibrate import timing as cal_timing
from autopar.cost import Profile

META = torch.device("meta")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Devices(TorchDispatchMode):
    """The device types of every tensor an aten op is called with, while active."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen |= {t.device.type for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------- the timer


def test_cpu_timer_is_the_host_clock(monkeypatch):
    clock = iter([10.0, 10.25, 11.0])
    monkeypatch.setattr(cal_timing.time, "perf_counter", lambda: next(clock))
    timer = cal_timing.Timer(torch.device("cpu"))
    assert timer.start() == 10.0
    assert timer.stop() == 0.25                   # its own reading
    assert timer.stop(now=10.5) == 0.5            # the caller's reading


def test_batch_and_call_probes_time_on_the_cpu_as_before():
    calls = []
    probe = cal_timing.batch_probe(lambda: (calls.append(1), time.sleep(0.002)), 0.01)
    assert probe() == pytest.approx(0.002, abs=2e-3) and len(calls) >= 3
    x = torch.zeros(4)
    lead = lambda: time.sleep(0.003)  # noqa: E731
    call = cal_timing.call_probe(lambda t: time.sleep(0.001), x, lead)
    assert call() == pytest.approx(0.004, abs=3e-3)


# --------------------------------------------------------------- intra- or inter-node


@pytest.mark.parametrize("n, world, local, want", [
    (2, 4, 4, "intra-node"),     # one node
    (4, 4, 4, "intra-node"),
    (2, 8, 4, "intra-node"),     # pairs within each node of 4
    (4, 8, 4, "intra-node"),     # a node each
    (8, 8, 4, "inter-node"),     # all ranks: both nodes
    (2, 6, 3, "inter-node"),     # [2, 3] straddles nodes 0 and 1
    (3, 6, 3, "intra-node"),
    (2, 2, 1, "inter-node"),     # one rank per node
])
def test_link_kind(n, world, local, want):
    assert cal.link_kind(n, world, local) == want


@given(st.integers(1, 8), st.integers(1, 8), st.data())
def test_link_kind_is_whether_every_group_has_one_node(nodes, local, data):
    world = nodes * local
    sizes = cal.group_sizes(world)
    if not sizes:
        return
    n = data.draw(st.sampled_from(sizes))
    groups = [range(s, s + n) for s in range(0, world, n)]     # _mesh_dim's groups
    one_node = all(len({r // local for r in g}) == 1 for g in groups)
    assert cal.link_kind(n, world, local) == ("intra-node" if one_node else "inter-node")
    if nodes == 1:
        assert cal.link_kind(n, world, local) == "intra-node"


def test_link_kind_refuses_a_size_the_launch_cannot_have():
    with pytest.raises(ValueError, match="3 ranks in a launch of 4"):
        cal.link_kind(3, 4, 2)


def test_links_read_torchrun_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cal_comm.links(4) == {2: "intra-node", 4: "inter-node"}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cal_comm.links(4) == {2: "intra-node", 4: "intra-node"}


# ------------------------------------------------------------- probes on the device


def test_compute_and_op_probes_run_only_on_the_given_device():
    settings = cal.Settings.quick()
    with _Devices() as devices:
        compute = cal.measure_compute(settings, META)
        ops = cal.measure_ops(settings, META)
        slowdown = cal_slowdown._slowdown_probes(settings, META)
        lead = cal_timing.lead(META)
        lead()
    assert devices.seen == {"meta"}
    assert compute["matmul"] and compute["pointwise"] and len(slowdown) == 3
    assert "op:aten.gelu.default:float32" in ops


def test_collective_probe_tensors_are_made_on_the_given_device(monkeypatch):
    class Axis:
        ranks, group = (0, 1), None

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(cal_comm, "bind_step", lambda comm, groups: (lambda t: t))
    made = [cal_comm._broadcast((4, 64), Axis(), META), cal_comm._ping_pong((4, 64), Axis(), META),
            *(cal_comm._runtime_collective(kind, (4, 64), 2, 0, None, META)
              for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"))]
    assert all(x.device == META for _, x, _ in made)


def test_op_cases_off_the_cpu_leave_out_targets_without_a_kernel_there(monkeypatch):
    def no_kernel(i, dtype):
        raise NotImplementedError("no kernel for meta")
    probed = dict(cal.op_probes.PROBED, **{"aten.none.default": (no_kernel, 1, True)})
    monkeypatch.setattr(cal.op_probes, "PROBED", probed)
    targets = {target for target, _, _ in cal_ops._op_cases(torch.float32, 1, META)}
    assert "aten.gelu.default" in targets and "aten.none.default" not in targets
    with pytest.raises(NotImplementedError):      # on the CPU a failing probe is an error
        cal_ops._op_cases(torch.float32, 1, torch.device("cpu"))


def test_a_whole_calibration_on_another_device_records_it():
    profile, measured = cal.calibrate(cal.Settings.quick(), 1, META)
    assert measured["device"] == "meta" and measured["links"] == {}
    assert profile.machine.endswith("no backend") and profile.matmul.points


def test_the_cpu_is_calibrated_where_there_is_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cal.calibration_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="AUTOPAR_CALIBRATE_DEVICE=cpu"):
        cal.calibration_device("cuda")


# ------------------------------------------------------------------------- on CUDA


@needs_cuda
def test_cuda_timer_times_the_kernel_not_its_launch():
    cuda = torch.device("cuda", 0)
    torch.cuda._sleep(1000)                       # warm up the context
    timer = cal_timing.Timer(cuda)
    timer.start()
    host = time.perf_counter()
    torch.cuda._sleep(int(5e7))                   # ~25 ms of GPU spinning, launched at once
    launched = time.perf_counter() - host
    seconds = timer.stop()
    assert seconds > 5e-3 and seconds > 5 * launched


@needs_cuda
def test_quick_calibration_on_cuda(tmp_path):
    cuda = torch.device("cuda", 0)
    profile, measured = cal.calibrate(cal.Settings.quick(), 1, cuda)
    assert measured["device"] == "cuda:0"
    assert torch.cuda.get_device_name(cuda) in profile.machine
    mm = profile.matmul
    assert mm.throughput(mm.points[-1][0]) > 3 * mm.throughput(mm.points[0][0])
    assert "aten.gelu.default" in profile.op_curves
    Profile.load(profile.save(tmp_path / "p.json"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices")
def test_quick_calibration_on_two_gpus_with_nccl(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--processes", "2",
                           "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = Profile.load(out)
    assert "nccl" in profile.machine and list(profile.collectives["all_reduce"]) == [2]
