"""The settings dataclasses against the node schemas: the nodes' settings (ros/settings.py) have one typed field per
schema parameter, mechanically named (``ring.delivery`` is ``settings.ring.delivery``), with the schema's defaults;
the runners' settings (runtime/settings.py) default to the schema's defaults too; validation returns the settings and
still refuses a bad value with the same ParameterError. No ROS graph needed."""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Union

import pytest

from hybrid_vla_ros.ros import params
from hybrid_vla_ros.ros.params import ParameterError, validate
from hybrid_vla_ros.ros.settings import SETTINGS, PrefixNodeSettings, SuffixNodeSettings, SuffixRingSettings
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SplitPolicySettings, SuffixRunnerSettings
from hybrid_vla_ros.vehicle.guard import GuardLimits

NODES = ("prefix_node", "suffix_node")
RUNNERS = {"prefix_node": PrefixRunnerSettings, "suffix_node": SuffixRunnerSettings}
#: Runner fields that come from the node itself, not from a parameter.
NOT_PARAMETERS = {"prefix_node": {"namespace", "domain_id", "decode_overlap", "decode_prefill_chunk"},
                  "suffix_node": {"namespace", "domain_id", "background_build"}}
_SCALARS = {"string": str, "integer": int, "number": float, "boolean": bool}


def _expected_type(spec: dict):
    """The Python type a schema entry's value has in the settings: str / int / float / bool, a Literal of its
    enum, a tuple of its items, or for ``split_layer`` (an integer, or a string matching ``^auto$``) int | 'auto'."""
    kind = spec["type"]
    if isinstance(kind, list):
        assert kind == ["integer", "string"] and spec.get("pattern") == "^auto$", spec
        return Union[int, Literal["auto"]]
    if kind == "array":
        return tuple[_expected_type(spec["items"]), ...]
    if "enum" in spec:
        return Literal[tuple(spec["enum"])]
    return _SCALARS[kind]


def _field_type(cls: type, name: str):
    """The type hint of parameter ``name`` (dotted: a group's field) in settings class ``cls``."""
    *group, leaf = name.split(".")
    for part in group:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[leaf]


def _given(tmp_path, node: str, **values) -> dict:
    return {"model_path": str(tmp_path), "split_layer": 2, **values}


# ------------------------------------------------------------------------------------------ node settings
@pytest.mark.parametrize("node", NODES)
def test_node_settings_fields_are_the_schema_parameters_one_to_one(node):
    specs = params.parameter_specs(node)
    cls = SETTINGS[node]
    assert cls.NODE == node
    assert cls.parameter_names() == tuple(specs), "same names, none missing, none extra, in schema order"
    for name, spec in specs.items():
        assert _field_type(cls, name) == _expected_type(spec), name


@pytest.mark.parametrize("node", NODES)
def test_node_settings_defaults_are_the_schema_defaults(node):
    settings = SETTINGS[node]()
    assert settings.parameters() == params.defaults(node)
    for name, default in params.defaults(node).items():
        assert type(settings[name]) is (tuple if isinstance(default, list) else type(default)), name


def test_dotted_parameters_are_fields_of_nested_frozen_groups(tmp_path):
    s = validate("suffix_node", _given(tmp_path, "suffix_node", **{"ring.delivery": "fifo", "guard.max_age_s": 2.0}))
    assert isinstance(s, SuffixNodeSettings)
    assert isinstance(s.ring, SuffixRingSettings) and isinstance(s.guard, GuardLimits)
    assert s.ring.delivery == s["ring.delivery"] == "fifo" and s.guard.max_age_s == s["guard.max_age_s"] == 2.0
    assert GuardLimits.from_params(s) == s.guard, "the guard's own by-name reader agrees with the group"
    assert "ring.delivery" in s and "ring" not in s and len(s) == len(params.parameter_specs("suffix_node"))
    with pytest.raises(KeyError):
        s["ring"]  # a group is not a parameter
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dtype = "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ring.delivery = "newest"
    assert dataclasses.replace(s, ring=dataclasses.replace(s.ring, delivery="newest"))["ring.delivery"] == "newest"
    assert SuffixNodeSettings.from_parameters(s.parameters()) == s, "parameters() and from_parameters() round-trip"
    with pytest.raises(ValueError, match="not parameters of suffix_node: ring_slots"):
        SuffixNodeSettings.from_parameters({"ring_slots": 4})


def test_validate_returns_typed_settings(tmp_path):
    p = validate("prefix_node",
                 _given(tmp_path, "prefix_node", sync_tolerance_ms=20, camera_transports=["compressed"]),
                 n_cameras=3, num_layers=4)
    assert isinstance(p, PrefixNodeSettings)
    assert p.sync_tolerance_ms == 20.0 and isinstance(p.sync_tolerance_ms, float)  # a YAML 20 is a double
    assert p.camera_topics == ("~/input/image0", "~/input/image1", "~/input/image2")
    assert p.camera_transports == ("compressed",) * 3 and p.cpu_affinity == ()
    assert hash(p) == hash(dataclasses.replace(p)), "frozen and hashable (lists are tuples)"
    assert validate("prefix_node", _given(tmp_path, "prefix_node", split_layer="auto")).split_layer == "auto"


@pytest.mark.parametrize("node,values,problem", [
    ("prefix_node", {"ring_slots": 2}, "ring_slots: must be >= 3, got 2"),
    ("prefix_node", {"dtype": "int8"}, "dtype: must be one of fp32, bf16, fp16, got 'int8'"),
    ("prefix_node", {"split_layer": -1}, "split_layer: must be >= 0, got -1 (the default, a placeholder: set it)"),
    ("suffix_node", {"ring.delivery": "lifo"}, "ring.delivery: must be one of newest, fifo, got 'lifo'"),
    ("suffix_node", {"guard.max_speed_mps": 0.0}, "guard.max_speed_mps: must be > 0, got 0.0"),
    ("prefix_node", {"ring_slots": "four"}, "ring_slots: must be of type int, got 'four'"),
    ("suffix_node", {"split_layer": 9}, "split_layer: 9 out of range [0, 4] for this model"),
])
def test_a_bad_value_still_raises_the_same_parameter_error(tmp_path, node, values, problem):
    with pytest.raises(ParameterError) as e:
        validate(node, _given(tmp_path, node, **values), num_layers=4)
    assert e.value.problems == [problem]
    assert str(e.value) == f"invalid parameters: {problem}"


# ---------------------------------------------------------------------------------------- runner settings
@pytest.mark.parametrize("node", NODES)
def test_runner_settings_defaults_are_the_schema_defaults(node):
    cls, specs = RUNNERS[node], params.parameter_specs(node)
    names = {f.name for f in dataclasses.fields(cls)}
    assert set(cls.PARAMETER_OF) == names - NOT_PARAMETERS[node], "every other field comes from a parameter"
    assert set(cls.PARAMETER_OF.values()) <= set(specs)
    settings = cls(split_layer=0)  # the one field without a default: a runner needs a resolved K
    for name, parameter in cls.PARAMETER_OF.items():
        if name == "split_layer":
            continue
        default = specs[parameter]["default"]
        expected = int(round(default * 1e9)) if name == "gpu_budget_bytes" else default  # GB -> bytes
        assert getattr(settings, name) == expected and type(getattr(settings, name)) is type(expected), name
        if "enum" in specs[parameter]:
            assert typing.get_type_hints(cls)[name] == _expected_type(specs[parameter]), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.split_layer = 1


def test_split_policy_settings_defaults_are_the_schema_defaults_and_the_node_builds_them(tmp_path):
    specs = params.parameter_specs("prefix_node")
    assert {f.name for f in dataclasses.fields(SplitPolicySettings)} == set(SplitPolicySettings.PARAMETER_OF)
    settings = SplitPolicySettings("auto", str(tmp_path))
    for name, parameter in SplitPolicySettings.PARAMETER_OF.items():
        if name not in ("split_layer", "model_path"):  # the two a control needs given
            default = specs[parameter]["default"]
            assert getattr(settings, name) == default and type(getattr(settings, name)) is type(default), name
    p = dataclasses.replace(validate("prefix_node", _given(tmp_path, "prefix_node")), split_layer="auto",
                            auto_rebalance=False, auto_resplit_free_mb=512.0, profile_path="/tmp/p.json")
    assert p.split_settings() == dataclasses.replace(settings, auto_rebalance=False, auto_resplit_free_mb=512.0,
                                                     profile_path="/tmp/p.json")


def test_node_settings_build_the_runner_settings(tmp_path):
    p = validate("prefix_node", _given(tmp_path, "prefix_node"))
    assert p.runner_settings(namespace="/ns", domain_id=7) == PrefixRunnerSettings(2, namespace="/ns", domain_id=7)
    p = dataclasses.replace(p, split_layer="auto", gpu_budget_gb=1.5, cpu_affinity=(0, 1), dtype="bf16")
    r = p.runner_settings(3)
    assert (r.split_layer, r.gpu_budget_bytes, r.torch_threads, r.dtype) == (3, 1_500_000_000, 2, "bf16")
    with pytest.raises(ValueError, match="plan `auto` first"):
        p.runner_settings()

    s = validate("suffix_node", _given(tmp_path, "suffix_node"))
    assert s.runner_settings(4, namespace="/ns") == SuffixRunnerSettings(2, namespace="/ns")
    s = dataclasses.replace(s, split_layer="auto", ring=SuffixRingSettings("fifo", 0.5, 0.0), threads=3,
                            suffix_backend="openvino", backend_cache_dir="/tmp/x")
    assert s.runner_settings(4) == SuffixRunnerSettings(4, threads=3, delivery="fifo", spin_lead_ms=0.5,
                                                        spin_max_ms=0.0, backend="openvino",
                                                        backend_cache_dir="/tmp/x"), "auto follows: K = L"
    assert dataclasses.replace(s, threads=0, cpu_affinity=(5,)).runner_settings(4).threads == 1
