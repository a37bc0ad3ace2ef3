"""The prefix node's frame loop: :class:`~hybrid_vla_ros.runtime.loops.PrefixLoop` with the node's ego state,
scene inputs and re-split log lines."""
from __future__ import annotations

import math
from typing import Callable

from ..model.config import takes_scene
from ..runtime.loops import FrameInputError, FrameInputs, PrefixLoop
from ..vehicle.camera_geometry import CalibrationError
from .prefix_inputs import EGO_DROP_REASONS
from .prefix_scene import CALIBRATION_DROP_REASONS


def prefix_loop(ctx, ego_inputs, scene=None, after_frame: Callable[[], None] | None = None) -> PrefixLoop:
    """The node's PrefixLoop: each frame's ego state (``ego_inputs``) or scene (``scene``), a missing one a drop by
    cause; ``after_frame`` runs after each frame out."""
    handoff = {"path": ""}

    def frame_inputs(stamp: int, items: list) -> FrameInputs:
        runner, p = ctx.runner(), ctx.settings()
        try:
            if takes_scene(runner.cfg):
                got, accel, wait_ms = scene.scene_at(stamp, items, p)
                return FrameInputs(scene=got, accel_source=accel, ego_wait_ms=wait_ms)
            if runner.cfg.ego_state_input:
                ego, accel, wait_ms = ego_inputs.state_at(stamp, p.ego_state_wait_s, p.max_ego_state_age_s)
                return FrameInputs(ego_state=ego, accel_source=accel, ego_wait_ms=wait_ms)
            return FrameInputs(ego_wait_ms=math.nan)
        except CalibrationError as e:
            raise FrameInputError(e.cause, f"frame stamped {stamp} ns: {CALIBRATION_DROP_REASONS[e.cause]}: "
                                           f"{e.reason}") from None
        except LookupError as e:
            cause = str(e.args[0])
            raise FrameInputError(cause, f"frame stamped {stamp} ns: "
                                         + EGO_DROP_REASONS[cause].format(age=p.max_ego_state_age_s)) from None

    def log_resplit(e) -> None:
        runner = ctx.runner()
        path = runner.handoff_path  # a move can change the last block's class: say the new path
        if path != handoff["path"]:
            if handoff["path"]:
                ctx.logger.info(f"hand-off path now: {path} (was: {handoff['path']})")
            handoff["path"] = path
        moved = f"loaded {e.blocks_loaded}" if e.blocks_loaded else f"freed {e.blocks_freed}"
        mib = 2**20
        ctx.logger.info(
            f"re-split K {e.old_split_layer} -> {e.new_split_layer}: {moved} block(s) in {e.duration_ms:.1f} ms"
            + (f" (loaded in the background in {e.load_ms:.1f} ms)" if e.blocks_loaded else "") + "; "
            f"prefix weights {e.stage_bytes_before / mib:.1f} -> {e.stage_bytes_after / mib:.1f} MiB"
            + (f", device memory allocated {e.device_bytes_before / mib:.1f} -> {e.device_bytes_after / mib:.1f} MiB, "
               f"reserved {e.reserved_bytes_before / mib:.1f} -> {e.reserved_bytes_after / mib:.1f} MiB, "
               f"driver-level used {e.driver_used_before / mib:.1f} -> {e.driver_used_after / mib:.1f} MiB "
               f"({e.returned_to_driver_bytes / mib:.1f} MiB returned)" if runner.device.type == "cuda" else ""))

    loop = PrefixLoop(ctx, frame_inputs=frame_inputs, after_frame=after_frame, resplit=log_resplit)
    loop.handoff = handoff  # the path the configure log said, set at each start (see PrefixNode.on_activate)
    return loop
