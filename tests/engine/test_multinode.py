"""A multi-node launch on one machine: two torchrun agents on loopback, each a "node" of two
workers, meet through c10d rendezvous (``--nnodes 2 --rdzv-backend c10d``) as a user's two
machines would, and train the GPT on ``configs/dp_tp.yaml`` (mesh ``[dp, tp]`` = [2, 2]):
tp inside a node, dp across the nodes. Every rank's losses and final parameters equal
single-device eager torch, both agents exit 0, and each rank's launch (torchrun's
LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK, the engine's ``launch``) is its node's.
Then the multi-node examples (``examples/slurm_train_gpt.sbatch``,
``examples/k8s_train_gpt.yaml``): valid bash and YAML, each run with stand-ins for srun,
scontrol and python so the torchrun command it makes is parsed by torchrun's own parser,
and its strategy's mesh fits the launch with tp inside a node.

With c10d rendezvous torchrun ignores ``--node-rank`` (it warns): the rendezvous numbers the
agents itself (GROUP_RANK), and agent g's workers are ranks ``g * nproc + LOCAL_RANK``. So
the test labels each agent (``AUTOPAR_TEST_NODE``, inherited by its workers) and checks the
numbering against the labels rather than assuming which agent became node 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

import autopar as ap
from autopar.models.gpt import lm_loss
from autopar.runtime.spawn import free_port

from ..multiproc import RANK_MAIN, _children, logs, stop
from ..parity import ATOL, RTOL, eager_train, gpt_optimizer, lm_data, parity_gpt

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def agent_command(port: int, run_id: str, host: bool, log_dir: Path, *script: str
                  ) -> list[str]:
    """One node's torchrun: c10d rendezvous at ``127.0.0.1:port``; the first node hosts the
    rendezvous store (``is_host``, as the first host of a SLURM job or the master pod would:
    on loopback both would otherwise think they are that host), every node waits at most
    60 s for the others to join."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}",
            f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={int(host)},join_timeout=60",
            "--max-restarts=0", "--monitor-interval=0.1", f"--log-dir={log_dir}",
            "--redirects=3", *script]


def run_nodes(scenario: str, *args: str, timeout: float = 150) -> list[dict]:
    """Run ``scenario`` on two local agents; each rank's result, by rank. An agent that exits
    non-zero, or a launch past ``timeout``, kills both agents' process groups (every worker
    is in its agent's session) and fails with every log."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        port, run_id = free_port(), f"autopar-test-{os.getpid()}"
        procs = []
        for node in range(NODES):
            node_dir = out / f"node{node}"
            node_dir.mkdir()
            with open(node_dir / "torchrun.log", "w") as log:
                procs.append(subprocess.Popen(
                    agent_command(port, run_id, node == 0, node_dir / "logs", str(RANK_MAIN),
                                  scenario, *args),
                    env=dict(os.environ, PYTHONWARNINGS="ignore", AUTOPAR_TEST_NODE=str(node),
                             AUTOPAR_TEST_RESULT_DIR=str(out)),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        failure = _wait(procs, timeout)
        if failure:
            raise AssertionError(f"{scenario} on {NODES} agents: {failure}\n" + "\n".join(
                f"=== node {n} ===\n{logs(out / f'node{n}')}" for n in range(NODES)))
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> str:
    """'' when every agent exited 0; else what went wrong, every agent and worker stopped."""
    deadline, failure = time.monotonic() + timeout, ""
    while not failure and any(p.poll() is None for p in procs):
        failed = [(n, p.returncode) for n, p in enumerate(procs)
                  if p.returncode not in (None, 0)]
        if failed:
            failure = f"the agent of node {failed[0][0]} exited with {failed[0][1]}"
        elif time.monotonic() > deadline:
            failure = f"timed out after {timeout:.0f} s"
        else:
            time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            stop(p)
    failed = [(n, p.returncode) for n, p in enumerate(procs) if p.returncode != 0]
    if not failure and failed:
        failure = f"the agent of node {failed[0][0]} exited with {failed[0][1]}"
    return failure


@pytest.mark.slow
def test_two_nodes_train_dp_across_tp_inside_like_eager():
    steps, batch = 4, 4
    results = run_nodes("train_nodes", "dp_tp", "adamw", str(steps), str(batch), "0.1")

    # the launch each rank saw: its node's agent, local rank and size, node (group) rank
    group_of = {}                      # the test's node label -> the rendezvous' group rank
    for rank, result in enumerate(results):
        env = result["environ"]
        node, group, local = env["AUTOPAR_TEST_NODE"], int(env["GROUP_RANK"]), \
            int(env["LOCAL_RANK"])
        assert group_of.setdefault(node, group) == group, f"rank {rank}: {env}"
        assert rank == group * PER_NODE + local, f"rank {rank}: {env}"
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
                env["GROUP_WORLD_SIZE"]) == (str(rank), str(WORLD), str(PER_NODE),
                                             str(NODES)), env
        launch = result["launch"]            # what the engine read: its device is LOCAL_RANK's
        assert (launch.rank, launch.world_size, launch.local_rank) == (rank, WORLD, local)
        assert result["device"] == (f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        # tp is the consecutive ranks of one node, dp pairs the same local rank across nodes
        assert result["groups"]["tp"] == (group * PER_NODE, group * PER_NODE + 1)
        assert result["groups"]["dp"] == (local, PER_NODE + local)
    assert sorted(group_of.values()) == list(range(NODES)), group_of
    # ... and the workers of one node are children of one agent, each node's its own
    agents = {node: {r["agent_pid"] for r in results if r["environ"]["AUTOPAR_TEST_NODE"] == node}
              for node in group_of}
    assert all(len(pids) == 1 for pids in agents.values()), agents
    assert len(set.union(*agents.values())) == NODES, agents

    # the training: single-device eager torch, step for step
    model = parity_gpt("adamw", dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    ref_losses = eager_train(model, lm_loss, optimizer, lm_data(steps * batch, 16, 64),
                             batch_size=batch, steps=steps, scheduler=scheduler)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank}: {m}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["state"][name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# -- the examples ---------------------------------------------------------------------------

STAND_INS = {
    # records its arguments, one a line, in $RECORD_DIR/<name>
    "srun": 'printf "%s\\n" "$@" > "$RECORD_DIR/srun"',
    "python": 'printf "%s\\n" "$@" > "$RECORD_DIR/python"',
    "scontrol": 'printf "node-a\\nnode-b\\n"',
    "getent": 'echo "10.0.0.1 $2"',
}


def _run_with_stand_ins(tmp_path: Path, script: str, env: dict[str, str]) -> list[str]:
    """Run a launch script with srun, scontrol, getent and python replaced by stand-ins; the
    torchrun arguments it ended up passing (after ``python -m torch.distributed.run``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD_DIR": str(tmp_path),
                               **env}, timeout=30)
    assert done.returncode == 0, done.stderr
    record = tmp_path / ("srun" if (tmp_path / "srun").exists() else "python")
    args = record.read_text().splitlines()
    start = args.index("torch.distributed.run") + 1
    assert args[start - 2] == "-m", args
    return args[start:]


def _check_launch(torchrun_args: list[str], nodes: int, gpus: int, endpoint: str) -> None:
    """The command is torchrun's (its own parser), c10d rendezvous at ``endpoint`` for
    ``nodes`` x ``gpus`` processes, running examples/train_gpt.py on a strategy whose mesh
    has that many ranks and puts tp last, inside one node."""
    from torch.distributed.run import get_args_parser
    args = get_args_parser().parse_args(torchrun_args)
    assert (args.nnodes, args.nproc_per_node) == (str(nodes), str(gpus))
    assert (args.rdzv_backend, args.rdzv_endpoint, args.max_restarts) == \
        ("c10d", endpoint, 0)
    assert args.training_script == "examples/train_gpt.py"
    script_args = args.training_script_args
    strategy = ap.Strategy.from_yaml(ROOT / script_args[script_args.index("--strategy") + 1])
    assert strategy.world_size == nodes * gpus
    mesh = strategy.mesh
    assert mesh.dim_names[-1] == strategy.tensor_parallel.axis
    assert gpus % mesh.shape[-1] == 0                      # a tp group never spans nodes
    assert strategy.data_parallel.axis == mesh.dim_names[0]


def test_the_slurm_example_launches_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    path = ROOT / "examples" / "slurm_train_gpt.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    directives = dict(line.split()[1].lstrip("-").split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH "))
    nodes, gpus = int(directives["nodes"]), int(directives["gpus-per-node"])
    assert directives["ntasks-per-node"] == "1"       # one agent per node
    args = _run_with_stand_ins(tmp_path, f"bash {path}", {
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "1234"})
    _check_launch(args, nodes, gpus, "node-a:29500")
    srun = (tmp_path / "srun").read_text().splitlines()
    assert "--kill-on-bad-exit=1" in srun[:srun.index("python")]
    assert args[args.index("--rdzv-id") + 1] == "1234"


def test_the_kubernetes_example_is_an_indexed_job_of_torchrun_agents(tmp_path):
    service, job = yaml.safe_load_all((ROOT / "examples" / "k8s_train_gpt.yaml").read_text())
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container, = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    nodes, gpus = int(env["NNODES"]), int(env["GPUS_PER_NODE"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    # the headless Service names the Job's pods: <job>-0.<service> is the rendezvous host
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    head = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    port = service["spec"]["ports"][0]["port"]
    script, = container["args"]
    assert container["command"] == ["/bin/bash", "-c"]
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    for index, host in (("0", "1"), ("1", "0")):     # pod 0 hosts the rendezvous store
        out = tmp_path / f"pod{index}"
        out.mkdir()
        args = _run_with_stand_ins(out, script, {**env, "JOB_COMPLETION_INDEX": index})
        _check_launch(args, nodes, gpus, f"{head}:{port}")
        assert args[args.index("--rdzv-conf") + 1] == f"is_host={host}"


def test_the_multinode_config_plans_the_example_model_on_every_rank(tmp_path):
    """``python -m autopar plan`` plans examples/train_gpt.py on all 8 ranks of
    configs/multinode_dp_tp.yaml offline (tp 4 divides its heads, width and vocabulary)."""
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/train_gpt.py",
                           "--strategy", "configs/multinode_dp_tp.yaml", "--dump-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank     params" in done.stdout


@pytest.mark.slow
def test_losing_a_node_restarts_the_job_on_the_survivors_from_its_checkpoint(tmp_path):
    """Two agents (``--nnodes 1:2``, one restart each) train dp4 with
    ``elastic: {on_resize: data_parallel}``, a checkpoint every step. After step 2 the
    second node is killed (agent and workers: a lost machine); the first node's workers
    fail in their next collective, its agent restarts them on the 2 processes left, the
    engine resizes dp 4 -> 2, and ``fit(resume=True)`` continues from step 2's checkpoint:
    every later step's loss equals eager's (the same global batches)."""
    steps, batch = 5, 4
    markers = tmp_path / "markers"
    markers.mkdir()
    port, run_id = free_port(), f"autopar-elastic-{os.getpid()}"
    conf = ("join_timeout=60,last_call_timeout=5,keep_alive_interval=1,"
            "keep_alive_max_attempt=3")
    agents = []
    for node in range(NODES):
        node_dir = tmp_path / f"node{node}"
        node_dir.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{NODES}",
                   f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                   f"--rdzv-conf=is_host={int(node == 0)},{conf}", "--max-restarts=1",
                   "--monitor-interval=0.1", f"--log-dir={node_dir / 'logs'}", "--redirects=3",
                   str(RANK_MAIN), "train_elastic", str(tmp_path / "ckpt"), str(markers),
                   str(steps), str(batch)]
        with open(node_dir / "torchrun.log", "w") as log:
            agents.append(subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, PYTHONWARNINGS="ignore", AUTOPAR_TEST_NODE=str(node),
                         AUTOPAR_TEST_RESULT_DIR=str(tmp_path))))

    def logs_of_both() -> str:
        return "\n".join(f"=== node {n} ===\n{logs(tmp_path / f'node{n}')}"
                         for n in range(NODES))
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.iterdir())) < PER_NODE:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), \
                "node 1 never reached step 2\n" + logs_of_both()
            time.sleep(0.2)
        lost = agents[1]
        for pid in (lost.pid, *_children(lost.pid)):      # the machine is gone, at once
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        lost.wait()
        code = agents[0].wait(240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                stop(agent)
    assert code == 0, f"the surviving agent exited with {code}\n" + logs_of_both()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
               for r in range(PER_NODE)]
    model = parity_gpt("adamw", dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    want = eager_train(model, lm_loss, optimizer, lm_data(steps * batch, 16, 64), batch,
                       steps, scheduler=scheduler)
    for rank, got in enumerate(results):
        assert got["restarts"] == 1 and got["mesh"] == (2,) and got["steps"] == steps
        assert len(got["loss"]) == steps - 2, f"rank {rank} trained {len(got['loss'])} steps"
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want[2:]),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank}: {m}")
