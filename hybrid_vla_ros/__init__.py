"""hybrid_vla_ros: split VLA inference between a GPU prefix node and a CPU suffix node.

The core (``hybrid_vla_ros.core``) holds the model partition, the shared-memory transport and the
image / trajectory conversions and imports nothing from ROS. ``hybrid_vla_ros.nodes`` holds the thin
rclpy lifecycle nodes, ``hybrid_vla_ros.cli`` the ``hybrid-vla`` command.
"""

__version__ = "0.1.0"
