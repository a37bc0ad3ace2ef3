"""The node parameter schemas (schema/<node>.schema.json) and everything that follows from them:
the shipped parameter files, the nodes' declarations, validation errors, the README tables."""
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from hybrid_vla_ros.ros import params
from hybrid_vla_ros.ros.params import ParameterError, validate

REPO = Path(__file__).resolve().parent.parent
DRAFT_07 = "http://json-schema.org/draft-07/schema#"


@pytest.mark.parametrize("node", params.NODES)
def test_schema_is_valid_draft_07_in_autoware_form(node):
    path = REPO / "schema" / f"{node}.schema.json"
    schema = json.loads(path.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == DRAFT_07
    assert schema["title"] == f"Parameters for {node}"
    top = schema["properties"]["/**"]
    assert top["properties"]["ros__parameters"] == {"$ref": f"#/definitions/{node}"}
    assert top["required"] == ["ros__parameters"]
    definition = schema["definitions"][node]
    assert definition["additionalProperties"] is False
    assert definition["required"] == list(definition["properties"]), "every parameter is required in a file"
    for name, spec in definition["properties"].items():
        assert {"type", "description", "default"} <= set(spec), name
        assert spec["description"].strip(), name
        if spec["type"] == "array":
            assert "type" in spec["items"], name
    assert params.schema_path(node) == path  # a source tree uses its own schema/ folder


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.param.yaml")), ids=lambda p: p.name)
def test_shipped_parameter_file_validates_against_its_schema(path):
    node = path.name.removesuffix(".param.yaml")
    document = yaml.safe_load(path.read_text())
    jsonschema.Draft7Validator(params.load_schema(node)).validate(document)


def test_every_node_has_a_parameter_file():
    assert sorted(p.name for p in (REPO / "config").glob("*.param.yaml")) == \
        sorted(f"{n}.param.yaml" for n in params.NODES)


@pytest.fixture(scope="module")
def declared():
    """Parameters the real node classes declare, built in-process: name -> (value, descriptor), per node."""
    import rclpy
    from rclpy.node import Node

    from hybrid_vla_ros.ros._suffix_impl import SuffixNode
    from hybrid_vla_ros.ros.prefix_node import PrefixNode

    context = rclpy.Context()
    rclpy.init(context=context)
    built = []
    try:
        bare = Node("bare_node", context=context)  # what every rclpy node declares on its own
        built.append(bare)
        inherent = set(bare._parameters)
        out = {}
        for name, cls in (("prefix_node", PrefixNode), ("suffix_node", SuffixNode)):
            node = cls(context=context)
            built.append(node)
            out[name] = {n: (p.value, node.describe_parameter(n)) for n, p in node._parameters.items()
                         if n not in inherent}
        yield out
    finally:
        for node in built:
            node.destroy_node()
        context.try_shutdown()


@pytest.mark.parametrize("node", params.NODES)
def test_nodes_declare_exactly_the_schema_parameters(declared, node):
    specs = params.parameter_specs(node)
    assert list(declared[node]) == list(specs), "the same names, in schema order"
    for name, spec in specs.items():
        value, descriptor = declared[node][name]
        assert descriptor.description == spec["description"], name
        assert descriptor.additional_constraints == params.constraint_text(spec), name
        if spec["default"] == []:
            assert value is None, f"{name}: an empty array is declared by type and left unset"
        else:
            assert value == spec["default"] and type(value) is type(spec["default"]), name


def _problems(node, values, **checkpoint):
    with pytest.raises(ParameterError) as e:
        validate(node, values, **checkpoint)
    assert str(e.value) == "invalid parameters: " + "; ".join(e.value.problems)
    return e.value.problems


@pytest.mark.parametrize("node,name,value,words", [
    # wrong type
    ("prefix_node", "ring_slots", "4", "must be of type int"),
    ("prefix_node", "torch_threads", True, "must be of type int"),
    ("prefix_node", "camera_topics", "/camera0", "must be of type list"),
    ("suffix_node", "wheelbase_m", "2.79", "must be of type double"),
    ("suffix_node", "cpu_affinity", [1.5], "must be of type int"),
    # out of range
    ("prefix_node", "ring_slots", 65, "must be <= 64"),
    ("prefix_node", "sync_tolerance_ms", 0.0, "must be > 0"),
    ("prefix_node", "split_layer", -1, "must be >= 0"),
    ("prefix_node", "split_layer", 2.0, "must be of type int or string, got 2.0"),  # a double is no block index
    ("suffix_node", "split_layer", "fastest", "must match ^auto$"),
    ("prefix_node", "gpu_budget_gb", -1.0, "must be >= 0"),
    ("suffix_node", "odometry_wait_s", 5.5, "must be <= 5"),
    ("prefix_node", "ego_state_wait_s", 5.5, "must be <= 5"),
    ("prefix_node", "max_ego_state_age_s", 0.0, "must be > 0"),
    ("suffix_node", "threads", -1, "must be >= 0"),
    ("suffix_node", "cpu_affinity", [-1], "must be >= 0"),
    # bad enum
    ("prefix_node", "dtype", "fp64", "must be one of fp32, bf16, fp16"),
    ("prefix_node", "camera_transports", ["h264"], "must be one of raw, compressed"),
    ("suffix_node", "dtype", "int8", "must be one of"),
    ("suffix_node", "navigation_command", "FORWARD", "must be one of LEFT, RIGHT, STRAIGHT, LANE_FOLLOW"),
    ("suffix_node", "navigation_command", "left", "must be one of"),  # the parameter takes the exact names
    # bad pattern
    ("prefix_node", "ring_name", "a/b", "must match"),
    ("prefix_node", "ring_name", "x" * 65, "must match"),
    ("prefix_node", "device", "cuda:x", "must match"),
    ("suffix_node", "ring_name", "", "must match"),
    # lengths and uniqueness
    ("prefix_node", "camera_transports", [], "must have at least 1 item"),
    ("prefix_node", "camera_topics", ["/a", "/a"], "must not repeat"),
    ("suffix_node", "output_frame", "", "must not be empty"),
    # what the schema cannot say (params.validate's code checks)
    ("prefix_node", "model_frame_origin", [float("nan"), 0.0, 1.84], "must be finite metres"),
    ("suffix_node", "model_frame_origin", [1.0, float("inf"), 1.84], "must be finite metres"),
    ("prefix_node", "model_frame_origin", [1.0, 0.0], "must have at least 3 items"),
    ("prefix_node", "base_frame", "  ", "must match"),
])
def test_bad_value_names_the_parameter(tmp_path, node, name, value, words):
    problems = _problems(node, {"model_path": str(tmp_path), "split_layer": 1, name: value})
    assert len(problems) == 1, problems
    assert problems[0].split(":", 1)[0].split("[", 1)[0] == name
    assert words in problems[0]


@pytest.mark.parametrize("node", params.NODES)
def test_unknown_parameter_is_named(tmp_path, node):
    problems = _problems(node, {"model_path": str(tmp_path), "split_layer": 1, "ring_size": 8})
    assert problems == [f"ring_size: unknown parameter (not in {node}'s schema)"]


def test_unset_split_layer_says_so():
    (problem,) = [p for p in _problems("suffix_node", {}) if p.startswith("split_layer")]
    assert "placeholder" in problem


def test_schema_and_code_problems_come_together(tmp_path, tiny_checkpoint):
    problems = _problems("prefix_node", {
        "model_path": str(tmp_path / "missing"), "split_layer": 2, "dtype": "fp64", "ring_slots": 2,
        "camera_topics": ["/a", "/b"], "unknown": 0}, n_cameras=6, num_layers=4)
    names = [p.split(":", 1)[0] for p in problems]
    assert sorted(names) == ["camera_topics", "dtype", "model_path", "ring_slots", "unknown"], problems
    # a parameter the schema rejects gets no second, code-side message
    problems = _problems("suffix_node", {"model_path": str(tiny_checkpoint), "split_layer": 1,
                                         "cpu_affinity": [-1, 100000]})
    assert problems == ["cpu_affinity[0]: must be >= 0, got -1"]
    # a valid schema value still meets the checkpoint
    problems = _problems("suffix_node", {"model_path": str(tiny_checkpoint), "split_layer": 5}, num_layers=4)
    assert problems == ["split_layer: 5 out of range [0, 4] for this model"]


def test_valid_values_come_back_complete_and_typed(tiny_checkpoint):
    p = validate("suffix_node", {"model_path": str(tiny_checkpoint), "split_layer": 4, "wheelbase_m": 3},
                 num_layers=4)
    assert set(p) == set(params.parameter_specs("suffix_node"))
    assert p.wheelbase_m == 3.0 and isinstance(p.wheelbase_m, float)
    assert p.odometry_wait_s == 0.2 and p.output_frame == "map" and p.cpu_affinity == ()
    with pytest.raises(AttributeError):
        p.no_such_parameter  # noqa: B018


def test_installed_schema_is_found_through_the_ament_index(tmp_path, monkeypatch):
    """Outside a source tree the schema comes from share/hybrid_vla_ros/schema (setup.py installs it)."""
    from distutils.core import run_setup

    import setuptools  # noqa: F401  (first, so that distutils is setuptools' copy, also on Python >= 3.12)

    monkeypatch.chdir(REPO)
    dist = run_setup("setup.py", stop_after="init")
    assert ("share/hybrid_vla_ros/schema", [f"schema/{n}.schema.json" for n in sorted(params.NODES)]) in \
        [(d, sorted(files)) for d, files in dist.data_files]

    share = tmp_path / "share" / "hybrid_vla_ros" / "schema"
    share.mkdir(parents=True)
    for node in params.NODES:
        (share / f"{node}.schema.json").write_text((REPO / "schema" / f"{node}.schema.json").read_text())
    index = tmp_path / "share" / "ament_index" / "resource_index" / "packages"
    index.mkdir(parents=True)
    (index / "hybrid_vla_ros").write_text("")
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(tmp_path))
    monkeypatch.setattr(params, "_SOURCE_SCHEMA_DIR", tmp_path / "not_a_source_tree")
    assert params.schema_path("prefix_node") == share / "prefix_node.schema.json"
    with pytest.raises(LookupError):
        params.schema_path("no_such_node")


def _generator(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "generate_param_tables.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_readme_parameter_tables_are_current():
    out = _generator("--check")
    assert out.returncode == 0, out.stderr


def test_generator_rewrites_a_stale_table_and_check_catches_it(tmp_path):
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    readme.write_text(text.replace("| `ring_slots` | int | `4` |", "| `ring_slots` | int | `8` |"))
    assert readme.read_text() != text
    assert _generator("--check", "--readme", str(readme)).returncode == 1
    assert _generator("--readme", str(readme)).returncode == 0
    assert readme.read_text() == text
    readme.write_text("# no markers\n")
    assert _generator("--check", "--readme", str(readme)).returncode == 2
