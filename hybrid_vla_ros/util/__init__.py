"""Small helpers every layer may use: package paths, bags, statistics. No torch, no ROS."""
