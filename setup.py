"""ament_python build of hybrid_vla_ros (colcon build on a ROS 2 machine)."""
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "hybrid_vla_ros"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(exclude=["test"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.py") + glob("launch/*.xml")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml") + glob("config/*.xml")),
        (f"share/{PACKAGE}/schema", glob("schema/*.json")),
        (f"share/{PACKAGE}/rviz", glob("rviz/*.rviz")),
        (f"share/{PACKAGE}/data/dgp_scene02_6cam_mcap", glob("data/dgp_scene02_6cam_mcap/*")),
    ],
    install_requires=["setuptools"],
    zip_safe=True,
    maintainer="hybrid_vla_ros maintainers",
    maintainer_email="maintainers@hybrid-vla-ros.invalid",
    description="Split VLA inference: GPU prefix node, shared-memory hand-off, CPU suffix node, Autoware trajectory.",
    license="Apache License 2.0",
    extras_require={"test": ["pytest"]},
    entry_points={
        "console_scripts": [
            "prefix_node = hybrid_vla_ros.ros.prefix_main:main",  # pins, then imports prefix_node (OpenCV, torch)
            "suffix_node = hybrid_vla_ros.ros.suffix_node:main",
            "hybrid-vla = hybrid_vla_ros.tools.cli:main",
        ],
    },
)
