"""The ROS 2 layer: lifecycle nodes, their schema-driven parameters, message conversion, lifecycle client.

Importing this package imports neither torch nor rclpy (``suffix_node`` pins its process before either).
"""
