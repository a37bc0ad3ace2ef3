"""ROS-free core: model partition, shared-memory ring, conversions, camera synchronization."""
