"""Sensor and vehicle I/O without ROS: images, camera sync, ego state and odometry, trajectories, the output guard."""
