"""Strategy: strict YAML schema, cross-section facts, and the checks the engine runs."""

from __future__ import annotations

import ast
import math
import pickle
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.strategy import (
    AmpConfig,
    MeshConfig,
    PipelineConfig,
    Strategy,
    TensorParallelConfig,
    UnsupportedStrategyError,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STRATEGY_DIR = Path(__file__).resolve().parents[2] / "strategy"

DESIGN_EXAMPLE = """
mesh: {shape: [2, 2, 2], dim_names: [pp, dp, tp]}   # last dim = fastest link
data_parallel: {axis: dp}
tensor_parallel:
  axis: tp
  plan: {"blocks.*.qkv": colwise, "blocks.*.proj": rowwise, "head": colwise, "wte": vocab}
  sequence_parallel: false
pipeline: {axis: pp, schedule: 1F1B, micro_batches: 4, split: auto}
sharding: {axis: dp, stage: 0}
amp: {enable: false, dtype: bfloat16}
recompute: {enable: false}
gradient_merge: {k_steps: 1}
grad_clip: {max_norm: null, norm_type: 2.0}
debug: {dump_dir: null, verify: true, strict_rules: false}
seed: 0
"""

EXAMPLES = {
    "design": DESIGN_EXAMPLE,
    "empty": "",
    "dp": "mesh: {shape: [4], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "one_dim_default_name": "mesh: {shape: [2]}\ndata_parallel: {axis: d0}\n",
    "tp_sp": """
mesh: {shape: [2], dim_names: [tp]}
tensor_parallel: {axis: tp, plan: {"*.fc1": colwise, "*.fc2": rowwise}, sequence_parallel: true}
""",
    "vpp_split": """
mesh: {shape: [2, 2], dim_names: [pp, dp]}
data_parallel: {axis: dp}
pipeline: {axis: pp, schedule: VPP, vpp_chunks: 2, micro_batches: 8,
           split: [blocks.1, blocks.2, blocks.3]}
""",
    "zero_amp_merge_clip": """
mesh: {shape: [8], dim_names: [dp]}
data_parallel: {axis: dp}
sharding: {axis: dp, stage: 3}
amp: {enable: true, dtype: float16, loss_scale: dynamic}
recompute: {enable: true, modules: ["blocks.*"]}
gradient_merge: {k_steps: 4}
grad_clip: {max_norm: 1.0, norm_type: .inf}
debug: {dump_dir: /tmp/dumps, verify: false, strict_rules: true}
seed: 1234
""",
}


# ---- loading and round trips --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_round_trip(name: str) -> None:
    strategy = Strategy.from_yaml_str(EXAMPLES[name])
    assert Strategy.from_yaml_str(strategy.to_yaml()) == strategy
    assert Strategy(**strategy.model_dump()) == strategy


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_config_files_round_trip(path: Path) -> None:
    strategy = Strategy.from_yaml(path)
    assert Strategy.from_yaml_str(strategy.to_yaml()) == strategy


def test_serial_config_is_the_default() -> None:
    serial = Strategy.from_yaml(CONFIGS / "serial.yaml")
    assert serial == Strategy() == Strategy.from_yaml_str("")
    assert serial.world_size == 1
    assert serial.enabled_sections() == ()
    assert serial.parallel_degrees() == {
        "data_parallel": 1, "tensor_parallel": 1, "pipeline": 1, "sharding": 1,
        "expert_parallel": 1, "context_parallel": 1}


def test_design_example_fields() -> None:
    s = Strategy.from_yaml_str(DESIGN_EXAMPLE)
    assert s.mesh == MeshConfig(shape=(2, 2, 2), dim_names=("pp", "dp", "tp"))
    assert s.tensor_parallel.plan["wte"] == "vocab"
    assert s.pipeline == PipelineConfig(axis="pp", schedule="1F1B", micro_batches=4)
    assert s.world_size == 8
    assert s.enabled_sections() == ("mesh", "data_parallel", "tensor_parallel", "pipeline")
    assert s.parallel_degrees() == {
        "data_parallel": 2, "tensor_parallel": 2, "pipeline": 2, "sharding": 1,
        "expert_parallel": 1, "context_parallel": 1}


def test_dict_construction_equals_yaml() -> None:
    d = yaml.safe_load(DESIGN_EXAMPLE)
    assert Strategy(**d) == Strategy.from_yaml_str(DESIGN_EXAMPLE)


def test_null_section_means_absent() -> None:
    assert Strategy.from_yaml_str("amp:\ndata_parallel: null\n") == Strategy()


def test_one_dim_mesh_names_itself() -> None:
    assert Strategy(mesh={"shape": [3]}).mesh.dim_names == ("d0",)


def test_norm_type_accepts_inf_text() -> None:
    s = Strategy.from_yaml_str("grad_clip: {max_norm: 1, norm_type: inf}")
    assert s.grad_clip.norm_type == math.inf and s.grad_clip.max_norm == 1.0


def test_strategy_is_immutable() -> None:
    s = Strategy()
    with pytest.raises(ValueError):
        s.seed = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        s.amp.enable = True  # type: ignore[misc]


# ---- strictness -------------------------------------------------------------------------

def test_unknown_top_level_key_names_it() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'meshh' at the top level.*'mesh'\?"):
        Strategy.from_yaml_str("meshh: {shape: [2]}")
    with pytest.raises(ValueError, match="unknown key 'zero'"):
        Strategy(zero=1)


@pytest.mark.parametrize("section, body, key", [
    ("mesh", "{shape: [2], dim_names: [dp], devices: [0, 1]}", "devices"),
    ("data_parallel", "{axis: dp, bucket_cap_mb: 25}", "bucket_cap_mb"),
    ("tensor_parallel", "{axis: tp, sequence_paralel: true}", "sequence_paralel"),
    ("pipeline", "{axis: pp, chunks: 2}", "chunks"),
    ("sharding", "{axis: dp, level: 1}", "level"),
    ("amp", "{enable: true, opt_level: O2}", "opt_level"),
    ("recompute", "{enable: true, granularity: full}", "granularity"),
    ("gradient_merge", "{k_steps: 2, average: true}", "average"),
    ("grad_clip", "{max_norm: 1.0, clip_value: 3}", "clip_value"),
    ("debug", "{verify: true, dump: x}", "dump"),
])
def test_unknown_nested_key_names_key_and_section(section: str, body: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown key '{key}' in section '{section}'"):
        Strategy.from_yaml_str(f"{section}: {body}\n")


def test_duplicate_yaml_key_is_an_error() -> None:
    with pytest.raises(ValueError, match="duplicate key 'seed'"):
        Strategy.from_yaml_str("seed: 1\nseed: 2\n")


def test_non_mapping_document_is_an_error() -> None:
    with pytest.raises(ValueError, match="mapping of sections, got list"):
        Strategy.from_yaml_str("- mesh\n")


def test_bad_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("amp: {enable: maybe}\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        Strategy.from_yaml(path)


@pytest.mark.parametrize("text, match", [
    ("mesh: {shape: [2, 0], dim_names: [a, b]}", "greater than or equal to 1"),
    ("mesh: {shape: [], dim_names: []}", "at least 1 item"),
    ("mesh: {shape: [2.0], dim_names: [a]}", "valid integer"),
    ("mesh: {shape: [2, 2], dim_names: [a, a]}", r"repeat \['a'\]"),
    ("mesh: {shape: [2, 2], dim_names: [a]}", "has 2 dims but dim_names"),
    ("mesh: {shape: [2, 2]}", "needs dim_names"),
    ("mesh: {shape: [2], dim_names: [1x]}", "pattern"),
    ("pipeline: {micro_batches: 0}", "greater than or equal to 1"),
    ("pipeline: {schedule: 1f1b}", "FThenB"),
    ("pipeline: {schedule: VPP}", "VPP needs vpp_chunks >= 2"),
    ("pipeline: {vpp_chunks: 2}", "needs schedule VPP"),
    ("pipeline: {split: blocks.2}", "split"),
    ("gradient_merge: {k_steps: 0}", "greater than or equal to 1"),
    ("amp: {enable: true, dtype: float16}", "needs loss_scale"),
    ("amp: {enable: true, level: O1, reduce_dtype: bfloat16}", "needs level O2"),
    ("amp: {enable: true, level: O2, dtype: bfloat16, reduce_dtype: float16}",
     "must be float32 or"),
    ("amp: {dtype: bfloat16, level: O2}", "dtype, level given without enable"),
    ("recompute: {policy: selective}", "policy given without enable"),
    ("compile: {backend: eager}", "backend given without enable"),
    ("amp: {loss_scale: 128.0, growth_interval: 10}", "only apply to loss_scale: dynamic"),
    ("amp: {level: O3}", "O1"),
    ("recompute: {enable: true, modules: [a], policy: some}", "selective"),
    ("gradient_merge: {k_steps: '2'}", "valid integer"),
    ("grad_clip: {max_norm: 0}", "max_norm must be a finite number > 0"),
    ("grad_clip: {max_norm: -1.5}", "max_norm must be a finite number > 0"),
    ("grad_clip: {max_norm: .inf}", "max_norm must be a finite number > 0"),
    ("grad_clip: {norm_type: 0}", "norm_type must be > 0 or inf"),
    ("grad_clip: {norm_type: .nan}", "norm_type must be > 0 or inf"),
    ("tensor_parallel: {plan: {head: diagonal}}", "colwise"),
    ("sharding: {stage: 4}", "less than or equal to 3"),
    ("amp: {enable: 1}", "valid boolean"),
    ("amp: {dtype: float32}", "bfloat16"),
    ("debug: {dump_dir: ''}", "at least 1 character"),
    ("seed: -1", "greater than or equal to 0"),
    ("seed: null", "valid integer"),
])
def test_field_validation(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Strategy.from_yaml_str(text)


# ---- facts against the mesh ---------------------------------------------------------------

def test_bad_axis_prints_mesh_and_section() -> None:
    text = "mesh: {shape: [2, 4], dim_names: [dp, tp]}\ntensor_parallel: {axis: mp}\n"
    with pytest.raises(ValueError) as info:
        Strategy.from_yaml_str(text)
    message = str(info.value)
    assert "tensor_parallel.axis 'mp'" in message
    assert "mesh shape [2, 4]" in message and "dim_names ['dp', 'tp']" in message


def test_axis_without_mesh_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no mesh.*\n.*data_parallel.axis 'dp'"):
        Strategy(data_parallel={"axis": "dp"})


def test_all_mesh_problems_reported_together() -> None:
    text = """
mesh: {shape: [2, 2], dim_names: [a, b]}
data_parallel: {axis: dp}
tensor_parallel: {axis: a}
pipeline: {axis: a, split: [x, y]}
"""
    with pytest.raises(ValueError) as info:
        Strategy.from_yaml_str(text)
    message = str(info.value)
    assert "data_parallel.axis 'dp'" in message
    assert "tensor_parallel.axis and pipeline.axis are both 'a'" in message
    assert "2 stages needs 1" in message


def test_sharding_may_share_the_data_parallel_axis_only() -> None:
    mesh = {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    s = Strategy(mesh=mesh, data_parallel={"axis": "dp"}, sharding={"axis": "dp", "stage": 1})
    assert s.parallel_degrees()["sharding"] == 2
    with pytest.raises(ValueError, match="sharding.axis are both 'tp'"):
        Strategy(mesh=mesh, tensor_parallel={"axis": "tp"}, sharding={"axis": "tp", "stage": 1})
    with pytest.raises(ValueError, match="data_parallel.axis and tensor_parallel.axis"):
        Strategy(mesh=mesh, data_parallel={"axis": "dp"}, tensor_parallel={"axis": "dp"})


# ---- engine checks ----------------------------------------------------------------------

def test_world_size() -> None:
    assert Strategy().world_size == 1
    s = Strategy.from_yaml_str(DESIGN_EXAMPLE)
    s.check_world_size(8)
    Strategy().check_world_size(1)


def test_world_size_mismatch_prints_all_facts() -> None:
    s = Strategy.from_yaml_str(DESIGN_EXAMPLE)
    with pytest.raises(ValueError) as info:
        s.check_world_size(4)
    message = str(info.value)
    for fact in ["world size 4", "needs 8 processes", "mesh shape [2, 2, 2]",
                 "dim_names ['pp', 'dp', 'tp']", "data_parallel=2 (axis 'dp')",
                 "tensor_parallel=2 (axis 'tp')", "pipeline=2 (axis 'pp')", "sharding=1 (off)"]:
        assert fact in message
    with pytest.raises(ValueError, match="positive int"):
        s.check_world_size(0)


def test_unused_mesh_dim_is_reported() -> None:
    s = Strategy(mesh={"shape": [2, 2], "dim_names": ["dp", "x"]}, data_parallel={})
    with pytest.raises(ValueError, match=r"used by no section \(replicated\): \['x'\]"):
        s.check_world_size(2)


def test_check_supported_refuses_every_enabled_section() -> None:
    s = Strategy.from_yaml_str(EXAMPLES["zero_amp_merge_clip"])
    with pytest.raises(UnsupportedStrategyError) as info:
        s.check_supported({"mesh", "data_parallel"})
    err = info.value
    assert isinstance(err, ValueError)
    assert err.sections == ("sharding", "amp", "recompute", "gradient_merge", "grad_clip")
    message = str(err)
    assert "sharding is not supported yet in this version of autopar" in message
    assert "sharding: {axis: dp, stage: 3, unit: layer}" in message
    assert "amp: {enable: true, dtype: float16, level: O1" in message
    assert "debug" not in message
    assert pickle.loads(pickle.dumps(err)).sections == err.sections
    s.check_supported({"mesh", "data_parallel", "sharding", "amp", "recompute",
                       "gradient_merge", "grad_clip"})


def test_check_supported_off_sections_pass() -> None:
    off = Strategy(mesh={"shape": [1]}, sharding={"axis": "d0", "stage": 0},
                   amp={"enable": False}, gradient_merge={"k_steps": 1},
                   grad_clip={"max_norm": None}, debug={"dump_dir": "d"}, seed=7)
    off.check_supported(set())
    with pytest.raises(UnsupportedStrategyError, match="^mesh is not supported"):
        Strategy(mesh={"shape": [2]}).check_supported(set())


def test_check_supported_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown section names"):
        Strategy().check_supported({"tensor_paralel"})
    with pytest.raises(TypeError):
        Strategy().check_supported("amp")


def test_resolved_dump_dir() -> None:
    s = Strategy(debug={"dump_dir": "from_yaml"})
    assert s.resolved_dump_dir({}) == "from_yaml"
    assert s.resolved_dump_dir({"AUTOPAR_DUMP_DIR": "from_env"}) == "from_env"
    assert s.resolved_dump_dir({"AUTOPAR_DUMP_DIR": ""}) == "from_yaml"
    assert Strategy().resolved_dump_dir({}) is None
    assert Strategy().resolved_dump_dir({"AUTOPAR_DUMP_DIR": "x"}) == "x"


def test_section_models_usable_directly() -> None:
    s = Strategy(amp=AmpConfig(enable=True), tensor_parallel=TensorParallelConfig(axis="d0"),
                 mesh=MeshConfig(shape=(2,), dim_names=("d0",)))
    assert s.enabled_sections() == ("mesh", "tensor_parallel", "amp")


def test_strategy_code_does_not_import_torch() -> None:
    for path in STRATEGY_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "torch" for n in names), path


# ---- property: any valid strategy survives YAML ----------------------------------------------

AXES = ["pp", "dp", "tp", "sp", "ep"]
module_names = st.text(string.ascii_letters + string.digits + "._*?[]-", min_size=1, max_size=12)


@st.composite
def strategies(draw: st.DrawFn) -> Strategy:
    """Valid strategies: a mesh, distinct axes for dp/tp/pp, sharding on dp or a free dim."""
    d: dict = {}
    names = draw(st.lists(st.sampled_from(AXES), min_size=0, max_size=4, unique=True))
    free = list(names)
    if names:
        d["mesh"] = {"shape": draw(st.lists(st.integers(1, 4), min_size=len(names),
                                            max_size=len(names))), "dim_names": names}
    axis_of = {}
    for section in ("data_parallel", "tensor_parallel", "pipeline"):
        if free and draw(st.booleans()):
            axis_of[section] = free.pop(draw(st.integers(0, len(free) - 1)))
    if "data_parallel" in axis_of:
        d["data_parallel"] = {"axis": axis_of["data_parallel"]}
    if "tensor_parallel" in axis_of:
        d["tensor_parallel"] = {
            "axis": axis_of["tensor_parallel"],
            "plan": draw(st.dictionaries(module_names,
                                         st.sampled_from(["colwise", "rowwise", "vocab"]))),
            "sequence_parallel": draw(st.booleans())}
    if "pipeline" in axis_of:
        d["pipeline"] = draw(pipelines(axis_of["pipeline"], d["mesh"]))
    sharding_axes = free + ([axis_of["data_parallel"]] if "data_parallel" in axis_of else [])
    if sharding_axes and draw(st.booleans()):
        d["sharding"] = {"axis": draw(st.sampled_from(sharding_axes)),
                         "stage": draw(st.integers(0, 3))}
    d["amp"] = {"enable": draw(st.booleans()),
                "dtype": draw(st.sampled_from(["bfloat16", "float16"])),
                "loss_scale": draw(st.sampled_from(["dynamic", 1024.0]))}
    d["recompute"] = {"enable": draw(st.booleans()), "modules": ["blocks.*"]}
    d["gradient_merge"] = {"k_steps": draw(st.integers(1, 64))}
    d["grad_clip"] = {
        "max_norm": draw(st.none() | st.floats(min_value=1e-30, max_value=1e30)),
        "norm_type": draw(st.just(math.inf) | st.floats(min_value=1e-3, max_value=1e3))}
    d["debug"] = {"dump_dir": draw(st.none() | st.text(min_size=1, max_size=20)),
                  "verify": draw(st.booleans()), "strict_rules": draw(st.booleans())}
    d["seed"] = draw(st.integers(0, 2**64 - 1))
    return Strategy(**d)


@st.composite
def pipelines(draw: st.DrawFn, axis: str, mesh: dict) -> dict:
    schedule = draw(st.sampled_from(["FThenB", "1F1B", "VPP", "ZBH1"]))
    chunks = draw(st.integers(2, 3)) if schedule == "VPP" else 1
    stages = mesh["shape"][mesh["dim_names"].index(axis)] * chunks
    split = draw(st.just("auto") | st.lists(module_names, min_size=stages - 1,
                                            max_size=stages - 1, unique=True))
    ranks = mesh["shape"][mesh["dim_names"].index(axis)]
    # what the schedule needs: 1F1B and ZBH1 a micro-batch per rank at least, VPP a multiple
    micro_batches = draw(st.integers(1, 64))
    if schedule in ("1F1B", "ZBH1"):
        micro_batches = max(micro_batches, ranks)
    elif schedule == "VPP":
        micro_batches = ranks * draw(st.integers(1, 16))
    return {"axis": axis, "schedule": schedule, "micro_batches": micro_batches,
            "split": split, "vpp_chunks": chunks}


@settings(max_examples=300, deadline=None)
@given(strategies())
def test_round_trip_property(s: Strategy) -> None:
    assert Strategy.from_yaml_str(s.to_yaml()) == s
    assert Strategy(**s.model_dump()) == s
    s.check_world_size(s.world_size)
