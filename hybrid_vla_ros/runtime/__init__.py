"""The two pipeline stages as runners (one per process, no ROS), their devices and CPU affinity."""
