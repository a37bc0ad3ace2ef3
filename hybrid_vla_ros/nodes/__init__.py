"""Thin rclpy lifecycle nodes around the core. Importing this package imports neither torch nor rclpy."""
