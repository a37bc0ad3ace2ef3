"""launch_testing test of launch/hybrid_vla.launch.py with the real launch_testing.

Runs both ways, with the same result:

    launch_test test/test_launch_testing.py              # launch_testing's own runner
    python -m pytest test/test_launch_testing.py         # pytest, through launch_testing's pytest plugin

It builds the package with colcon into a temporary install space (the same one the pytest session's other
launch tests use; test/ros_tools.py), includes the installed launch file with the environment of that install's
setup.bash (scoped to the include, so the test process's own environment is left as it was), brings both
lifecycle nodes to active with the launch file's autostart, plays frames of the embedded bag restamped to now
into the camera and odometry topics, and expects an Autoware Trajectory stamped with a camera stamp. After
launch_testing shuts the launch down (SIGINT), both processes must have exited with 0, logged their clean-up,
and printed no traceback and no 'Failed to publish log message to rosout'.

Without the launch tools it is skipped with the reason (with CI=true it fails instead).
"""
import atexit
import shutil
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):  # ros_tools, and hybrid_vla_ros for the test process (launch_test)
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402
import ros_tools  # noqa: E402

# The launch_testing pytest plugin imports every test module at collection, so nothing here may raise or skip
# at import (a module-level skip would skip the module pytest is collecting, whichever it is). Without the
# tools this module holds one plain test instead, which the ros_tools_available fixture skips (fails with CI=true).
if ros_tools.missing_tools():

    def test_launch_testing_needs_the_ros_tools(ros_tools_available):
        """Stands for the launch_testing test where the tools are missing."""

else:
    import launch_testing.actions
    import launch_testing.asserts
    import rclpy
    import rclpy.executors
    from launch.actions import GroupAction, IncludeLaunchDescription, SetEnvironmentVariable
    from launch.launch_description_sources import PythonLaunchDescriptionSource

    from launch import LaunchDescription

    NAMESPACE = f"hvla_launch_test_{int(time.time() * 1000) % 10**8}"  # the ring lives in /dev/shm per namespace
    OUTPUT = f"/{NAMESPACE}/trajectory"
    _SHARE = {}  # the install space's share/hybrid_vla_ros, set by generate_test_description

    @pytest.mark.launch_test
    def generate_test_description():
        from hybrid_vla_ros.model.checkpoint import init_model

        tmp = tempfile.mkdtemp(prefix="hvla_launch_test_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        model_dir = Path(tmp) / "tiny"
        init_model("tiny", model_dir)
        install = ros_tools.colcon_install()
        env = ros_tools.install_env(install)
        share = install / "hybrid_vla_ros" / "share" / "hybrid_vla_ros"
        _SHARE["path"] = share
        include = IncludeLaunchDescription(
            PythonLaunchDescriptionSource(str(share / "launch" / "hybrid_vla.launch.py")),
            launch_arguments={
                "model_path": str(model_dir), "split_layer": "2", "device": "cpu", "cpu_affinity": "[0]",
                "camera_transport": "compressed", "camera_topic_suffix": "image_raw", "namespace": NAMESPACE,
                "input_kinematic_state": "/localization/kinematic_state", "output_trajectory": OUTPUT,
            }.items())
        # the install's environment for the include only (the launch file's package lookups and the nodes)
        setup = [SetEnvironmentVariable(name, env[name]) for name in ("AMENT_PREFIX_PATH", "PYTHONPATH", "PATH")]
        return LaunchDescription([GroupAction(setup + [include], scoped=True), launch_testing.actions.ReadyToTest()])

    class TestTrajectoryFromRealFrames(unittest.TestCase):
        def test_a_trajectory_arrives_for_a_played_frame(self):
            from autoware_planning_msgs.msg import Trajectory
            from rclpy.serialization import deserialize_message

            from hybrid_vla_ros.tools.replay import message_class
            from hybrid_vla_ros.util.bags import read_bag

            messages = [m for m in read_bag(_SHARE["path"] / "data" / "dgp_scene02_6cam_mcap")
                        if m.topic.endswith("/compressed") or m.topic == "/localization/kinematic_state"]
            context = rclpy.Context()
            rclpy.init(context=context)
            try:
                node = rclpy.create_node("hvla_launch_test_driver", context=context)
                received = []
                node.create_subscription(Trajectory, OUTPUT, received.append, 10)
                pubs = {t: node.create_publisher(message_class(m.msgtype), t, 10)
                        for t, m in {m.topic: m for m in messages}.items()}
                executor = rclpy.executors.SingleThreadedExecutor(context=context)
                executor.add_node(node)
                spin = threading.Thread(target=executor.spin, daemon=True)
                spin.start()
                camera_stamps = set()
                last_camera = max(m.t_ns for m in messages if m.topic.endswith("/compressed"))
                deadline = time.monotonic() + 300  # model load and both lifecycle transitions on a loaded machine
                while not received and time.monotonic() < deadline:
                    # stamped as a live camera would stamp them (the last frame now), so the output guard's
                    # age check, on as shipped, lets the newest frame's trajectory through
                    shift = time.time_ns() - last_camera
                    for m in messages:
                        msg = deserialize_message(m.raw, message_class(m.msgtype))
                        stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec + shift
                        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp, 10**9)
                        pubs[m.topic].publish(msg)
                        if m.topic.endswith("/compressed"):
                            camera_stamps.add(stamp)
                    time.sleep(1.0)
                self.assertTrue(received, "no Trajectory within 300 s")
                stamp = received[0].header.stamp.sec * 10**9 + received[0].header.stamp.nanosec
                self.assertIn(stamp, camera_stamps)
                self.assertEqual(received[0].header.frame_id, "map")
                self.assertGreaterEqual(len(received[0].points), 2)
                executor.shutdown()
                node.destroy_node()
            finally:
                rclpy.try_shutdown(context=context)

    @launch_testing.post_shutdown_test()
    class TestCleanShutdown(unittest.TestCase):
        def test_exit_codes(self, proc_info):
            launch_testing.asserts.assertExitCodes(proc_info)

        def test_clean_up_logged_without_errors(self, proc_output):
            text = b"".join(io.text for io in proc_output).decode(errors="replace")
            self.assertIn("cleaned up: ring removed", text)
            self.assertIn("cleaned up: detached from the ring", text)
            self.assertNotIn("Failed to publish log message to rosout", text)
            self.assertNotIn("Traceback", text)
            self.assertEqual(ros_tools.ring_segments(f"/{NAMESPACE}"), [])
