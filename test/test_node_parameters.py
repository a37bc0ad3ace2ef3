"""Parameters given at start as rcl reads them: an empty list (``-p 'cpu_affinity:=[]'``, YAML ``[]``), which rcl
reads as 'not set' and rclpy cannot type, is the empty list; the real prefix node class, in this process."""
import pytest


@pytest.fixture
def make_prefix_node():
    import rclpy
    from rclpy.context import Context

    from hybrid_vla_ros.ros.prefix_node import PrefixNode

    made = []

    def make(*ros_args):
        context = Context()
        rclpy.init(context=context)
        node = PrefixNode(context=context, cli_args=["--ros-args", *ros_args])
        made.append((node, context))
        return node

    yield make
    for node, context in made:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_an_empty_list_given_at_start_is_the_empty_list(make_prefix_node):
    from hybrid_vla_ros.ros.node_base import parameter_values

    values = parameter_values(make_prefix_node("-p", "cpu_affinity:=[]", "-p", "split_layer:=1"), "prefix_node")
    assert values["cpu_affinity"] == [] and values["split_layer"] == 1


def test_an_empty_list_is_checked_as_given_not_replaced_by_the_default(make_prefix_node, tmp_path):
    from hybrid_vla_ros.ros import params
    from hybrid_vla_ros.ros.node_base import parameter_values

    node = make_prefix_node("-p", "camera_transports:=[]", "-p", "model_path:=/nonexistent", "-p", "split_layer:=1")
    values = parameter_values(node, "prefix_node")
    assert values["camera_transports"] == []  # not the schema's default [raw]
    with pytest.raises(params.ParameterError, match="camera_transports"):
        params.validate("prefix_node", values)
