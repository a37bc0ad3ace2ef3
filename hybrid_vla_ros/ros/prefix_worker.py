"""The prefix node's worker thread: the newest synchronized frame -> ego state -> PrefixRunner.run -> ring.

It makes no ROS calls of its own: it reads the runner and settings of its node's PartContext and counts drops
through it.
"""
from __future__ import annotations

import math
import threading
from typing import Callable

from ..model.config import takes_scene
from ..vehicle.camera_geometry import CalibrationError
from ..vehicle.ego_input import ACCEL_SOURCES
from ..vehicle.image import ImageDecodeError
from ..vehicle.sync import SyncedSet
from .prefix_inputs import EGO_DROP_REASONS
from .prefix_scene import CALIBRATION_DROP_REASONS


class PrefixWorker:
    """One thread that computes the prefix, frame after frame, so that no callback ever waits on the model.

    :meth:`offer` keeps only the newest synchronized frame: one the thread had not started yet is dropped as
    ``superseded`` (the prefix is slower than the cameras), and one still waiting at :meth:`stop` as
    ``deactivated``. With ``pace_to_suffix`` the thread waits before a frame while the suffix would leave it
    unread in the ring (``PrefixRunner.pacing_delay_s``), so the frame it starts is fresher. Between frames it
    applies a requested split layer (:meth:`wake` after ``PrefixRunner.request_split_layer``). A frame without
    a usable ego state (``ego_inputs``) or, for the published query heads, without its camera geometry and ego
    frame (``scene``: prefix_scene.SceneSource), or one the runner fails on, is a counted drop and the thread
    goes on.
    Counts ``frames_out``, ``ego_accel_sources`` (frames out by acceleration source) and ``resplits``.
    """

    #: Longest wait (s) before the pacing delay is asked again (it shrinks as time passes; the suffix's
    #: announcement may change).
    PACE_RECHECK_S = 0.1

    def __init__(self, ctx, ego_inputs, scene=None, on_frame: Callable[[], None] | None = None):
        """``ctx``: the node's node_base.PartContext; ``ego_inputs``: prefix_inputs.EgoStateInputs; ``scene``:
        prefix_scene.SceneSource (checkpoints with the query heads); ``on_frame``: called on this thread after
        each frame published (the split-layer policy judges the stage times)."""
        self._ctx = ctx
        self._ego_inputs = ego_inputs
        self._scene = scene
        self._on_frame = on_frame
        self._pending: SyncedSet | None = None  # newest synchronized frame waiting for the worker
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.frames_out = 0
        self.ego_accel_sources = {source: 0 for source in ACCEL_SOURCES}  # frames out, by acceleration source
        self.resplits = 0  # live moves of the split layer applied
        self._handoff_path = ""  # the runner's hand-off path after the last move ('' before any)

    @property
    def running(self) -> bool:
        """True from :meth:`start` to :meth:`stop`."""
        return self._running

    def start(self) -> None:
        """Start the thread ('prefix_worker', daemon)."""
        self._running = True
        self._handoff_path = self._ctx.runner().handoff_path  # as the configure log said
        self._thread = threading.Thread(target=self._work, name="prefix_worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the frame in progress (idempotent); a frame not started is ``deactivated``."""
        with self._cv:
            self._running = False
            if self._pending is not None:  # a synchronized frame the worker had not started: count it
                self._ctx.count("deactivated")
            self._pending = None
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def offer(self, frame: SyncedSet) -> None:
        """Make ``frame`` the next one to compute, in place of any still waiting (that one is ``superseded``)."""
        with self._cv:
            if self._pending is not None:
                self._ctx.drop("superseded", "a newer synchronized frame arrived before the worker took this "
                                 "one (the prefix is slower than the camera rate)")
            self._pending = frame
            self._cv.notify()

    def wake(self) -> None:
        """Wake an idle thread, e.g. to apply a split layer just requested at once."""
        with self._cv:
            self._cv.notify()

    def _work(self) -> None:
        runner = self._ctx.runner()
        pace = self._ctx.settings().pace_to_suffix
        while True:
            with self._cv:
                while self._running and self._pending is None and not runner.split_requested:
                    self._cv.wait()
                # Pace to a slower suffix: a frame started now would wait in the ring; newer frames replace
                # _pending meanwhile (the older one counts as superseded), so the one started is fresher. The delay
                # is asked again at every wake-up and at least every PACE_RECHECK_S (the suffix may take a frame,
                # die or restart meanwhile), and a requested split layer ends the wait (it is applied first).
                while self._running and self._pending is not None and pace and not runner.split_requested:
                    delay = runner.pacing_delay_s()
                    if delay <= 0:
                        break
                    self._cv.wait(min(delay, self.PACE_RECHECK_S))
                if not self._running:
                    return
                frame, self._pending = self._pending, None
            if frame is None:  # a split layer change while no frame waits: apply it now (frees memory now)
                self._apply_split_request(runner)
            else:
                self._compute(runner, frame)

    def _apply_split_request(self, runner) -> None:
        try:  # blocks for a move up load in the background: check back every 50 ms (frames may come)
            event = runner.apply_split_request(timeout=0.05)
        except Exception as e:  # noqa: BLE001 - e.g. a missing block in the checkpoint: counted, K stays
            self._ctx.drop("resplit_error", str(e))
            return
        if event is not None:
            self._log_resplit(event)

    def _compute(self, runner, frame: SyncedSet) -> None:
        ctx, p = self._ctx, self._ctx.settings()
        stamp, items = frame
        scene = None
        try:
            if takes_scene(runner.cfg):
                ego = None
                scene, accel_source, ego_wait_ms = self._scene.scene_at(stamp, items, p)
            else:
                ego, accel_source, ego_wait_ms = (
                    self._ego_inputs.state_at(stamp, p.ego_state_wait_s, p.max_ego_state_age_s)
                    if runner.cfg.ego_state_input else (None, None, math.nan))
        except CalibrationError as e:
            ctx.drop(e.cause, f"frame stamped {stamp} ns: {CALIBRATION_DROP_REASONS[e.cause]}: {e.reason}")
            return
        except LookupError as e:
            cause = str(e.args[0])
            ctx.drop(cause, f"frame stamped {stamp} ns: " + EGO_DROP_REASONS[cause].format(age=p.max_ego_state_age_s))
            return
        try:
            result = runner.run(items, stamp, ego_state=ego, ego_wait_ms=ego_wait_ms, scene=scene)
        except ImageDecodeError as e:
            ctx.drop("decode_error", str(e))
            return
        except (ValueError, FloatingPointError) as e:
            ctx.drop("model_error", str(e))
            return
        except Exception as e:  # noqa: BLE001 - the node keeps running, the error is counted and reported
            ctx.drop("internal_error", f"{type(e).__name__}: {e}")
            return
        self.frames_out += 1
        if result.resplit is not None:
            self._log_resplit(result.resplit)
        if self._on_frame is not None:
            try:
                self._on_frame()
            except Exception as e:  # noqa: BLE001 - the frame is out; a failing judgement must not stop the worker
                if ctx.log_every("split_policy"):  # not a dropped frame: that one was published
                    ctx.logger.error(f"split-layer policy failed, K stays: {type(e).__name__}: {e}")
        if result.resplit_error is not None:
            ctx.drop("resplit_error", result.resplit_error)
        if accel_source is not None:
            self.ego_accel_sources[accel_source] += 1
        ctx.times.add("preprocess", result.preprocess_ms)
        ctx.times.add("prefix", result.prefix_ms)

    def _log_resplit(self, e) -> None:
        self.resplits += 1
        path = self._ctx.runner().handoff_path  # a move can change the last block's class: say the new path
        if path != self._handoff_path:
            if self._handoff_path:
                self._ctx.logger.info(f"hand-off path now: {path} (was: {self._handoff_path})")
            self._handoff_path = path
        moved = f"loaded {e.blocks_loaded}" if e.blocks_loaded else f"freed {e.blocks_freed}"
        self._ctx.logger.info(
            f"re-split K {e.old_split_layer} -> {e.new_split_layer}: {moved} block(s) in {e.duration_ms:.1f} ms"
            + (f" (loaded in the background in {e.load_ms:.1f} ms)" if e.blocks_loaded else "") + "; "
            f"prefix weights {e.stage_bytes_before / 2**20:.1f} -> {e.stage_bytes_after / 2**20:.1f} MiB"
            + (f", device memory allocated {e.device_bytes_before / 2**20:.1f} -> "
               f"{e.device_bytes_after / 2**20:.1f} MiB, "
               f"reserved {e.reserved_bytes_before / 2**20:.1f} -> {e.reserved_bytes_after / 2**20:.1f} MiB, "
               f"driver-level used {e.driver_used_before / 2**20:.1f} -> {e.driver_used_after / 2**20:.1f} MiB "
               f"({e.returned_to_driver_bytes / 2**20:.1f} MiB returned)"
               if self._ctx.runner().device.type == "cuda" else ""))
