"""A camera driver as many are, for test_launch.py: a plain rclpy node on Fast DDS's defaults (run it without
FASTDDS_DEFAULT_PROFILES_FILE) with rclpy's default publisher QoS (reliable, keep last 10), publishing six raw rgb8
1600 x 900 images per frame (the embedded bag's camera frames, resized) and the odometry, stamped now.

    python test/plain_camera_publisher.py --bag DIR --image-topic /sensing/camera/camera{}/plain_raw \
        --odom-topic /ns/odom --frames 8 --period 1.0

Prints one line per frame, ``frame <stamp ns>``, after its six images went out; exits 3 when the subscribers are
not there within ``--wait`` seconds.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

WIDTH, HEIGHT = 1600, 900


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bag", required=True)
    parser.add_argument("--image-topic", required=True, help="topic pattern, {} is the camera index")
    parser.add_argument("--odom-topic", required=True)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--period", type=float, default=1.0, help="seconds between frames")
    parser.add_argument("--wait", type=float, default=90.0, help="seconds to wait for the subscribers")
    parser.add_argument("--linger", type=float, default=8.0,
                        help="seconds to stay after the last frame (as a driver that keeps running: a reliable "
                             "writer repairs lost fragments on its heartbeat, 3 s by default in Fast DDS)")
    args = parser.parse_args()

    import cv2
    import numpy as np
    import rclpy
    from nav_msgs.msg import Odometry
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import CompressedImage, Image

    from hybrid_vla_ros.util.bags import read_bag
    from hybrid_vla_ros.util.stamps import set_header_stamp

    msgs = read_bag(Path(args.bag))
    cams = sorted({m.topic for m in msgs if m.topic.endswith("/image_raw/compressed")})
    first = {t: next(m for m in msgs if m.topic == t) for t in cams}
    pixels = []
    for t in cams:
        jpeg = deserialize_message(first[t].raw, CompressedImage)
        bgr = cv2.imdecode(np.frombuffer(bytes(jpeg.data), np.uint8), cv2.IMREAD_COLOR)
        pixels.append(cv2.cvtColor(cv2.resize(bgr, (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA),
                                   cv2.COLOR_BGR2RGB).tobytes())
    odom = deserialize_message(next(m for m in msgs if m.topic == "/localization/kinematic_state").raw, Odometry)

    rclpy.init()
    node = rclpy.create_node("plain_camera_driver")
    pubs = [node.create_publisher(Image, args.image_topic.format(i), 10) for i in range(len(cams))]
    odom_pub = node.create_publisher(Odometry, args.odom_topic, 10)
    deadline = time.monotonic() + args.wait
    while any(p.get_subscription_count() < 1 for p in pubs + [odom_pub]):
        if time.monotonic() > deadline:
            print("subscribers missing", [p.get_subscription_count() for p in pubs], file=sys.stderr)
            return 3
        time.sleep(0.1)
    # the prefix (camera_reliability auto) re-subscribes reliable about a second after it hears us; a frame sent
    # before that meets a best-effort subscription that loses fragments of 26 MB messages: wait for the switch
    # (up to 30 s: slower on a loaded machine; the test's own check then names what is missing)
    from hybrid_vla_ros.ros.graph import wait_for_reliable_subscriptions

    if not wait_for_reliable_subscriptions(node, [args.image_topic.format(i) for i in range(len(cams))], 30.0,
                                           every=True):
        print("camera subscriptions not reliable after 30 s", file=sys.stderr)
    time.sleep(0.5)
    for _ in range(args.frames):
        stamp = time.time_ns()
        for offset in (-50_000_000, 50_000_000):  # odometry around the camera stamp
            set_header_stamp(odom, stamp + offset)
            odom_pub.publish(odom)
        for pub, data in zip(pubs, pixels):
            msg = Image(height=HEIGHT, width=WIDTH, encoding="rgb8", is_bigendian=0, step=3 * WIDTH)
            msg.header.frame_id = "camera"
            set_header_stamp(msg, stamp)
            msg.data = data
            pub.publish(msg)
        print(f"frame {stamp}", flush=True)
        time.sleep(args.period)
    time.sleep(args.linger)  # reliable repairs of the last frames need the writer alive
    node.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
