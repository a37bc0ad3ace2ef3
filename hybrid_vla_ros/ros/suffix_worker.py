"""The suffix node's frame loop: :class:`~hybrid_vla_ros.runtime.loops.SuffixLoop` with the node's inputs, outputs
and log lines."""
from __future__ import annotations

from ..runtime.loops import SuffixLoop


def suffix_loop(ctx, inputs, outputs) -> SuffixLoop:
    """The node's SuffixLoop: ``inputs``' command, the pose at the camera stamp (else a drop), ``outputs``."""

    def publish(result) -> None:
        outputs.publish_reasoning(result)
        p = ctx.settings()
        try:
            ego, method, why, wait_ms = inputs.pose_at(result.meta.stamp_ns, p.odometry_wait_s, p.max_odometry_age_s)
        except LookupError as e:
            ctx.drop(str(e.args[0]), f"no odometry within {p.max_odometry_age_s} s of the camera stamp")
            return
        if outputs.publish(result, ego, wait_ms):
            inputs.count_placed(method, why)

    def on_attach(attached: bool) -> None:
        runner = ctx.runner()
        if attached:
            ring = runner.ring
            ctx.logger.info(f"attached to the ring '{runner.segment}': {ring.contract.describe()}, conversion to "
                            f"{ctx.settings().dtype}: {ring.conversion}")
        else:
            ctx.logger.info("the prefix's ring went away; waiting for it to come back")

    def on_resplits(result) -> None:
        for e in result.resplits:
            what = (f"loaded {e.blocks_loaded} block(s) (load {e.load_ms:.1f} ms)" if e.blocks_loaded
                    else f"freed {e.blocks_freed} block(s)")
            ctx.logger.info(
                f"re-split: now holding blocks [{e.new_split_layer}, {ctx.runner().cfg.num_layers}) for frame "
                f"seq {result.meta.seq} at K={result.meta.split_layer}: {what}, frame waited {e.duration_ms:.1f} ms, "
                f"weights {e.stage_bytes_before / 2**20:.1f} -> {e.stage_bytes_after / 2**20:.1f} MiB"
                + (" (on demand: this side was not told of the move; set split_layer on both nodes to load ahead)"
                   if e.on_demand else ""))

    return SuffixLoop(ctx, publish=publish, command=lambda: inputs.command, on_attach=on_attach,
                      on_resplits=on_resplits)
