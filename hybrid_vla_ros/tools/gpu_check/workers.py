"""The two child processes of a pipeline run (:class:`~hybrid_vla_ros.tools.gpu_check.pair.Pair`, started with
``multiprocessing`` spawn): a PrefixRunner feeding frames into the shared-memory ring and a SuffixRunner computing
what it takes from it. Each sends its per-frame records (or its error and traceback) to the parent on a pipe;
the shared counters (``multiprocessing.Value``: K, frames, free bytes, ballast bytes, done flags) tell the
parent and the other child how far the run is."""
from __future__ import annotations

import os
import time
import traceback

from .common import EGO_STATE, rss_peak_bytes, sync
from .inputs import raw_items


def _pin(cores) -> None:
    """Pin this process to ``cores`` (nothing when empty, or where CPU affinity cannot be set)."""
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except (AttributeError, OSError):
            pass


def _free_reader(device, sim):
    """Free device memory in bytes: ``torch.cuda.mem_get_info`` on CUDA, else the simulation ``sim`` =
    (total bytes, plan, ballast Value): total - plan total of the current K - ballast."""
    import torch

    if device.type == "cuda":
        return lambda runner: int(torch.cuda.mem_get_info(device)[0])
    total, plan, ballast = sim
    return lambda runner: int(total - plan.row(runner.split_layer).gpu_total_bytes - ballast.value)


def _auto_policy(spec: dict, runner, shared, conn, ctx, on_move):
    """The prefix's split-layer control (runtime.split_control) running the spec's auto re-split on memory
    pressure (``spec['policy']``: ``low`` / ``high`` thresholds and ``margin`` in bytes, ``up_after`` readings),
    after sending the parent the plan's bytes per K; None without one. On the CPU the free memory is simulated: a
    device of ``sim_total`` bytes (set here in the spec's policy) minus the plan total of the current K minus the
    ballast. Each reading is also stored in ``shared['free']``."""
    if not spec.get("policy"):
        return None
    from ...runtime.split_control import SplitLayerControl
    from ...split.planner import AutoResplitPolicy, plan_for_checkpoint
    from ...split.rebalance import SplitPolicy

    dev = runner.device
    pol = spec["policy"]
    plan = plan_for_checkpoint(spec["model"], None, None, spec["dtype"],
                               cuda_overhead_gb=None if dev.type == "cuda" else 0.0)
    if dev.type != "cuda":
        pol["sim_total"] = plan.row(plan.num_layers).gpu_total_bytes + pol["high"] + pol["margin"]
    policy = AutoResplitPolicy(plan, pol["low"], pol["high"], up_after=pol.get("up_after", 3))
    read_free = _free_reader(dev, (pol.get("sim_total", 0), plan, shared["ballast"]))
    conn.send({"type": "plan", "rows": [r.gpu_total_bytes for r in plan.rows],
               "sim_total": pol.get("sim_total", 0), "free": read_free(runner)})

    def reading(r) -> int:
        shared["free"].value = free = read_free(r)
        return free

    return SplitLayerControl.of_policy(ctx, SplitPolicy(plan, memory=policy), read_free=reading, on_move=on_move)


def _frame_record(i: int, r) -> dict:
    """What the parent gets of frame ``i`` (a PrefixRunner result ``r``): seq, K, stage times (ms) and the
    re-split the frame applied, if any (ms, bytes before / after)."""
    rec = {"i": i, "seq": r.seq, "k": r.split_layer, "preprocess_ms": r.preprocess_ms, "prefix_ms": r.prefix_ms}
    e = r.resplit
    if e is not None:
        rec["resplit"] = {"from": e.old_split_layer, "to": e.new_split_layer, "ms": e.duration_ms,
                          "load_ms": e.load_ms, "stage_before": e.stage_bytes_before,
                          "stage_after": e.stage_bytes_after, "allocated_before": e.device_bytes_before,
                          "allocated_after": e.device_bytes_after, "reserved_before": e.reserved_bytes_before,
                          "reserved_after": e.reserved_bytes_after, "used_before": e.driver_used_before,
                          "used_after": e.driver_used_after, "returned": e.returned_to_driver_bytes}
    if r.resplit_error:
        rec["resplit_error"] = r.resplit_error
    return rec


def prefix_process(conn, ev_attached, shared, spec: dict) -> None:
    """Child process: a PrefixRunner feeding ``spec['frames']`` frames into the ring, applying the spec's
    re-split moves (``moves``: {frame index: K}) or auto policy (``policy``), reporting records on ``conn``."""
    _pin(spec.get("cores"))
    try:
        import torch

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        from ...runtime.device import cuda_memory
        from ...runtime.loops import FrameInputs, PrefixLoop, counting_context
        from ...runtime.prefix import PrefixRunner
        from ...runtime.settings import PrefixRunnerSettings

        runner = PrefixRunner(spec["model"], PrefixRunnerSettings(
            spec["k"], device=spec["device"], dtype=spec["dtype"], ring_name=spec["ring"], ring_slots=4,
            gpu_budget_bytes=spec.get("gpu_budget_bytes", 0)))
        dev = runner.device
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        shared["k"].value = runner.split_layer
        mem_loaded = cuda_memory(dev)
        if not ev_attached.wait(300):
            raise TimeoutError("the suffix did not attach to the ring within 300 s")
        items = raw_items(runner.cfg.n_cameras, tuple(spec["camera_wh"]))
        ego = EGO_STATE if runner.cfg.ego_state_input else None
        ctx, drops = counting_context(runner)
        records, decisions, errors = [], [], []
        control = _auto_policy(spec, runner, shared, conn, ctx, on_move=lambda move, k: decisions.append(
            {"frame": i, "free": shared["free"].value, "from": k, "to": move.k, "why": move.reason}))
        loop = PrefixLoop(ctx, pace=spec.get("pace", True), frame_inputs=lambda stamp, frame: FrameInputs(ego))
        last_read = 0.0
        stop_at = time.monotonic() + spec.get("max_s", 600)
        i = 0
        # a requested move up is applied by run() once its blocks are loaded in the background (frames keep
        # flowing meanwhile, as in the node); frames continue past `frames` until it is
        while (i < spec["frames"] or runner.split_requested
               or (control is not None and not shared["done"].value)):
            if time.monotonic() > stop_at:
                errors.append("stopped: the run's time limit")
                break
            k_req = spec.get("moves", {}).get(str(i))
            if k_req is not None:
                runner.request_split_layer(int(k_req))
            if control is not None and time.monotonic() - last_read >= spec["policy"].get("period_s", 0.2):
                last_read = time.monotonic()
                control.check_memory()  # the node's 2 s timer, at the spec's period
            r = loop.process((i + 1, items))
            if r is None:  # out of memory, or another failure: counted by the loop, the run goes on
                errors.append(f"frame {i}: {drops.last}")
                if dev.type == "cuda":
                    sync(dev)
                    torch.cuda.empty_cache()
                i += 1
                continue
            shared["k"].value = runner.split_layer
            shared["frames"].value = i + 1
            records.append(_frame_record(i, r))
            if dev.type == "cuda":  # after the frame: what the allocator holds once its activations are cached
                records[-1]["reserved"] = int(torch.cuda.memory_reserved(dev))
            i += 1
        mem = cuda_memory(dev)
        conn.send({"type": "result", "records": records, "decisions": decisions, "errors": errors,
                   "mem_loaded": mem_loaded, "mem_end": mem, "device": str(dev),
                   "copier": None if runner.copier is None else runner.copier.mode,
                   "ring_stats": runner.ring.stats.as_dict(),
                   "stage_bytes": sum(p.numel() * p.element_size() for p in runner.stage.parameters()),
                   "rss_peak": rss_peak_bytes()})
        shared["prefix_done"].value = 1
        # keep the ring until the suffix has drained it
        deadline = time.monotonic() + 60
        while not shared["suffix_done"].value and time.monotonic() < deadline:
            time.sleep(0.02)
        runner.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        shared["prefix_done"].value = 1
        conn.send({"type": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def suffix_process(conn, ev_attached, shared, spec: dict) -> None:
    """Child process: a SuffixRunner computing every frame it takes until the prefix is done and the ring is
    drained; sends the per-frame records on ``conn``."""
    _pin(spec.get("cores"))
    try:
        import torch

        from ...runtime.loops import SuffixLoop, counting_context
        from ...runtime.settings import SuffixRunnerSettings
        from ...runtime.suffix import SuffixRunner

        runner = SuffixRunner(spec["model"], SuffixRunnerSettings(
            spec["k"], dtype=spec["dtype"], ring_name=spec["ring"], threads=spec.get("threads", 0),
            delivery=spec.get("delivery", "newest"), background_build=False))
        records, errors = [], []
        runner.wait_attached(300)
        ev_attached.set()
        def record(r) -> None:
            records.append({"seq": r.meta.seq, "k": r.meta.split_layer, "stamp": r.meta.stamp_ns,
                            "suffix_ms": r.suffix_ms, "handoff_ms": r.handoff_ms,
                            "e2e_ms": (r.t_suffix_end_ns - r.t_prefix_start_ns) / 1e6 if r.t_prefix_start_ns else None,
                            "t_end_ns": r.t_suffix_end_ns, "suffix_k_held": runner.split.first_held,
                            "superseded": r.superseded, "waypoints": r.waypoints.tolist(),
                            "resplits": len(r.resplits)})

        ctx, drops = counting_context(runner)
        loop = SuffixLoop(ctx, publish=record)
        idle_since, seen = None, 0
        while True:
            r = loop.poll_once(0.2)
            dropped = sum(n for cause, n in drops.items() if cause != "superseded")
            if dropped > seen:  # a frame dropped (rejected, stale, a compute error): said, the run goes on
                seen = dropped
                errors.append(drops.last)
            if r is None:
                if shared["prefix_done"].value:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 1.0:
                        break
                continue
            idle_since = None
        conn.send({"type": "result", "records": records, "errors": errors, "superseded": runner.superseded,
                   "ring_stats": runner.ring_stats().as_dict(),
                   "rss_peak": rss_peak_bytes(), "threads": torch.get_num_threads()})
        shared["suffix_done"].value = 1
        runner.close()
    except BaseException as e:  # noqa: BLE001
        shared["suffix_done"].value = 1
        conn.send({"type": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})

