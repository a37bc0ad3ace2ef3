"""``hybrid-vla gpu-check`` / ``python scripts/gpu_check.py``: the GPU half of the pipeline, measured in one go.

ROS-free: it imports torch, numpy, safetensors, transformers, the standard library and this package's layers
below ``ros/`` (cv2 through :mod:`hybrid_vla_ros.vehicle.image` for the sections that run the prefix runner;
matplotlib, torchvision only where present). The prefix and suffix runners
(:class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner`, :class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner`)
run in two processes (``multiprocessing`` spawn) joined by the real shared-memory ring.

Sections (each in its own try/except: a failure is reported and the rest still run; after ``--budget-s`` seconds
the remaining sections are skipped and the report says so):

1. ``memory_plan``: the prefix at K in {0, L/4, L/2, 3L/4, L} with random weights made on the device
   (:func:`~hybrid_vla_ros.model.checkpoint.random_stage`), one forward: peak allocated, peak reserved and
   driver-level used memory (``torch.cuda.mem_get_info``: total - free) against ``hybrid-vla plan``'s bytes.
   Goal: within 10 %. CPU: the weights' bytes against the plan's; the allocator figures need CUDA.
2. ``paper_table``: end-to-end latency (camera frame -> waypoints, ms) and pipelined frames/s of K = L (every
   block on the device) against the hybrid at the other K, suffix pinned to up to 14 cores in bf16, with the
   prefix's device memory per row.
3. ``live_resplit``: K moved down then up while frames flow: memory returned to the driver (reserved and
   driver-level used before / after the move), frames lost (published - computed - superseded) = 0, frames
   computed at a K other than their slot header's = 0.
4. ``memory_pressure``: a ballast process takes device memory while frames flow; with the auto re-split policy
   (:class:`~hybrid_vla_ros.split.planner.AutoResplitPolicy`, the node's ``auto_resplit_free_mb`` /
   ``auto_resplit_recover_mb``) the prefix moves K down before an allocation fails, and back up once the
   ballast is gone. CPU: the same policy and re-split with the free memory simulated (plan bytes of the
   current K plus the ballast's bytes taken from a device of fixed size).
5. ``handoff``: the device-to-host copy of ``orion``'s hidden states into a ring slot: pageable vs page-locked
   (registered mapping; pinned staging). CPU: a host copy into the slot (the device paths need CUDA).
6. ``camera_decode``: 6 JPEG cameras of 1936 x 1216: nvJPEG (``torchvision.io.decode_jpeg`` on CUDA) against
   the CPU path of the prefix (:func:`~hybrid_vla_ros.vehicle.image.compressed_msg_to_rgb`).
7. ``numerics``: fp16 / bf16 prefix on the device -> CPU suffix (fp32 and bf16) against the fp32 CPU
   monolithic model: trajectory drift at 3 s (cm; goal <= 1 cm). The weights are random: the drift of a
   random-weight head says how the arithmetic differs, not how a trained planner would drift.

Output under ``--out``: ``gpu_check.json`` (everything), ``gpu_check.md`` (tables), PNGs when matplotlib is
installed (else a note), and a summary on stdout. ``--small`` runs reduced sizes (the ``tiny`` preset, few
frames) so ``--device cpu --small`` finishes in about a minute on two cores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

SECTIONS = ("memory_plan", "paper_table", "live_resplit", "memory_pressure", "handoff", "camera_decode",
            "numerics")
TITLES = {"memory_plan": "1. Memory plan vs reality", "paper_table": "2. The paper's table",
          "live_resplit": "3. Live re-split", "memory_pressure": "4. Memory pressure",
          "handoff": "5. Hand-off: pageable vs page-locked", "camera_decode": "6. Camera decode",
          "numerics": "7. Numerics"}
NEEDS_CUDA = "needs CUDA"
#: Ego state fed to models that take one: (speed m/s, acceleration m/s^2, yaw rate rad/s).
EGO_STATE = (5.0, 0.0, 0.0)
#: Camera resolution of the decode section and of the full-size frames (the embedded bag's, px).
CAMERA_WH = (1936, 1216)
GB = 1e9
MIB = 2**20


@dataclass
class Sizes:
    """What a run measures: presets, their image-size overrides, frames per pipeline run, repetitions."""

    memory_presets: tuple = ("orion", "minddrive-0.5b")
    pipeline_presets: tuple = ("orion", "minddrive-0.5b")
    resplit_preset: str = "minddrive-0.5b"
    numerics_preset: str = "minddrive-0.5b"
    overrides: dict = field(default_factory=lambda: {"minddrive-0.5b": {}, "orion": {}})
    numerics_overrides: dict = field(default_factory=lambda: {"image_size": 112})
    pipeline_ks: tuple | None = None  # None: split_points(L); else fractions of L
    frames: int = 12
    warmup: int = 2
    resplit_frames: int = 40
    camera_wh: tuple = CAMERA_WH
    reps: int = 20


def wide_tiny_llm() -> dict:
    """``tiny``'s LLM widened to 1024 (32 MB fp16 blocks): the small CUDA run's blocks are large enough to get
    caching-allocator segments of their own, so a move of K down can return whole segments to the driver."""
    from ..model.config import preset

    llm = dict(preset("tiny").llm, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
               num_key_value_heads=8)
    llm.pop("head_dim", None)
    return llm


def sizes_for(small: bool, cuda: bool = False) -> Sizes:
    """Full sizes (the GPU machine) or ``--small`` ones (tiny preset, few frames: a CPU run in about a minute;
    on CUDA the tiny preset with a wider LLM, :func:`wide_tiny_llm`)."""
    if not small:
        return Sizes()
    return Sizes(memory_presets=("tiny",), pipeline_presets=("tiny",), resplit_preset="tiny", numerics_preset="tiny",
                 overrides={"tiny": {"llm": wide_tiny_llm()} if cuda else {}}, numerics_overrides={},
                 pipeline_ks=(1.0, 0.5), frames=6, warmup=1, resplit_frames=24,
                 camera_wh=(320, 200), reps=5)


def split_points(num_layers: int) -> list[int]:
    """K in {0, L/4, L/2, 3L/4, L} (floored, duplicates dropped), ascending."""
    return sorted({0, num_layers // 4, num_layers // 2, (3 * num_layers) // 4, num_layers})


def core_split(cores: list[int], suffix_max: int = 14) -> tuple[list[int], list[int]]:
    """(prefix cores, suffix cores): the suffix gets up to ``suffix_max`` cores, the prefix the rest (>= 1);
    on one core both share it."""
    cores = sorted(cores)
    if len(cores) < 2:
        return cores, cores
    n_suffix = min(suffix_max, len(cores) - max(1, len(cores) - suffix_max))
    n_suffix = max(1, min(n_suffix, len(cores) - 1))
    return cores[:len(cores) - n_suffix], cores[len(cores) - n_suffix:]


def within(measured: float, planned: float, tol: float = 0.10) -> bool:
    """True when ``measured`` is within ``tol`` (fraction) of ``planned`` (> 0)."""
    return planned > 0 and abs(measured - planned) <= tol * planned


def drift_at(a, b, dt_s: float, t_s: float = 3.0) -> float:
    """Distance (m) between waypoints (N, 2) ``a`` and ``b`` at the waypoint closest to ``t_s`` seconds
    (waypoint i is at (i + 1) * dt_s); the last waypoint when the horizon is shorter."""
    import numpy as np

    i = min(len(a) - 1, max(0, round(t_s / dt_s) - 1))
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64)[i] - np.asarray(b, dtype=np.float64)[i]))


def frames_lost(published: int, computed: int, superseded: int, overwritten: int = 0) -> int:
    """Frames the prefix published that the suffix neither computed nor knowingly dropped: ``superseded``
    (older unread frames freed when a newer one was taken, newest-first delivery) and ``overwritten`` (READY
    frames the producer reused with every slot full: ``RingProducer.stats['dropped_oldest']``) are counted
    apart, as the ring's policy; what is left is lost."""
    return max(0, published - computed - superseded - overwritten)


def _pct(values) -> dict:
    from ..util.stats import percentiles

    return percentiles(values, finite_only=True)


def _torch_device(name: str):
    from ..runtime.device import resolve_device

    return resolve_device(name)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_peak_bytes() -> int:
    """This process's peak resident memory (VmHWM, bytes); 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _nvidia_smi_used(index: int = 0) -> int | None:
    """Used memory of GPU ``index`` by nvidia-smi (bytes), None when nvidia-smi is absent. Read before this
    process creates a CUDA context, so the context's own memory can be told apart."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--id={index}"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return int(float(out.splitlines()[0])) * MIB
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------- checkpoints

def ensure_checkpoint(cache: Path, name: str, overrides: dict, dtype: str = "fp16", log=print) -> Path:
    """A random-init checkpoint of preset ``name`` with ``overrides`` stored in ``dtype`` under ``cache``,
    written once and reused while its config matches (``init_model``; a 7B one takes a minute or two)."""
    from ..model.checkpoint import init_model
    from ..model.config import preset

    import hashlib

    key = f"{name}-{dtype}"
    if overrides:
        key += "-" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cache) / key
    want = preset(name, **overrides).to_dict()
    want["random_init"] = True
    cfg_file = path / "config.json"
    if cfg_file.is_file() and (path / "model.safetensors").is_file():
        try:
            if json.loads(cfg_file.read_text()) == want:
                return path
        except (OSError, ValueError):
            pass
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    init_model(name, path, seed=0, overrides=dict(overrides), dtype=dtype)
    log(f"  wrote the {name} checkpoint ({dtype}) to {path} in {time.perf_counter() - t0:.1f} s")
    return path


# ---------------------------------------------------------------------------------------- frames

def synthetic_rgb(width: int, height: int, seed: int = 0):
    """An (H, W, 3) uint8 image with smooth gradients and noise (compresses like a camera frame)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([(x / width) * 200, (y / height) * 200, ((x + y) / (width + height)) * 255], axis=-1)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def raw_items(n_cameras: int, wh: tuple[int, int]) -> list:
    """One synchronized frame of ``n_cameras`` raw ``rgb8`` Image-like messages of ``wh`` (W, H) px."""
    items = []
    for cam in range(n_cameras):
        img = synthetic_rgb(wh[0], wh[1], seed=cam)
        msg = SimpleNamespace(encoding="rgb8", height=img.shape[0], width=img.shape[1], step=img.shape[1] * 3,
                              is_bigendian=0, data=img.tobytes())
        items.append(("raw", msg))
    return items


# ---------------------------------------------------------------------------------------- processes

def _pin(cores) -> None:
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


def prefix_process(conn, ev_attached, shared, spec: dict) -> None:
    """Child process: a PrefixRunner feeding ``spec['frames']`` frames into the ring, applying the spec's
    re-split moves (``moves``: {frame index: K}) or auto policy (``policy``), reporting records on ``conn``."""
    _pin(spec.get("cores"))
    try:
        import torch

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        from ..runtime.device import cuda_memory
        from ..runtime.prefix import PrefixRunner

        runner = PrefixRunner(spec["model"], spec["k"], device=spec["device"], dtype=spec["dtype"],
                              ring_name=spec["ring"], ring_slots=4)
        dev = runner.device
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        shared["k"].value = runner.split_layer
        mem_loaded = cuda_memory(dev)
        if not ev_attached.wait(300):
            raise TimeoutError("the suffix did not attach to the ring within 300 s")
        items = raw_items(runner.cfg.n_cameras, tuple(spec["camera_wh"]))
        ego = EGO_STATE if runner.cfg.ego_state_input else None
        policy = None
        read_free = None
        if spec.get("policy"):
            from ..split.planner import AutoResplitPolicy, plan_for_checkpoint

            pol = spec["policy"]
            plan = plan_for_checkpoint(spec["model"], None, None, spec["dtype"],
                                       cuda_overhead_gb=None if dev.type == "cuda" else 0.0)
            if dev.type != "cuda":
                pol["sim_total"] = plan.row(plan.num_layers).gpu_total_bytes + pol["high"] + pol["margin"]
            policy = AutoResplitPolicy(plan, pol["low"], pol["high"], up_after=pol.get("up_after", 3))
            read_free = _free_reader(dev, (pol.get("sim_total", 0), plan, shared["ballast"]))
            conn.send({"type": "plan", "rows": [r.gpu_total_bytes for r in plan.rows],
                       "sim_total": pol.get("sim_total", 0), "free": read_free(runner)})
        records, decisions, errors = [], [], []
        last_read = 0.0
        stop_at = time.monotonic() + spec.get("max_s", 600)
        i = 0
        # a requested move up is applied by run() once its blocks are loaded in the background (frames keep
        # flowing meanwhile, as in the node); frames continue past `frames` until it is
        while (i < spec["frames"] or runner.split_requested
               or (policy is not None and not shared["done"].value)):
            if time.monotonic() > stop_at:
                errors.append("stopped: the run's time limit")
                break
            k_req = spec.get("moves", {}).get(str(i))
            if k_req is not None:
                runner.request_split_layer(int(k_req))
            if policy is not None and time.monotonic() - last_read >= spec["policy"].get("period_s", 0.2):
                last_read = time.monotonic()
                free = read_free(runner)
                shared["free"].value = free
                try:
                    k_new, why = policy.decide(runner.split_layer, free)
                except ValueError as e:
                    k_new, why = None, f"no K fits: {e}"
                if k_new is not None:
                    decisions.append({"frame": i, "free": free, "from": runner.split_layer, "to": k_new, "why": why})
                    runner.request_split_layer(k_new)
            if spec.get("pace", True):
                delay = runner.pacing_delay_s()
                if delay > 0:
                    time.sleep(delay)
            try:
                r = runner.run(items, stamp_ns=i + 1, ego_state=ego)
            except torch.cuda.OutOfMemoryError as e:
                errors.append(f"frame {i}: out of memory: {e}")
                _sync(dev)
                torch.cuda.empty_cache()
                i += 1
                continue
            shared["k"].value = runner.split_layer
            shared["frames"].value = i + 1
            rec = {"i": i, "seq": r.seq, "k": r.split_layer, "preprocess_ms": r.preprocess_ms,
                   "prefix_ms": r.prefix_ms}
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
            records.append(rec)
            i += 1
        mem = cuda_memory(dev)
        conn.send({"type": "result", "records": records, "decisions": decisions, "errors": errors,
                   "mem_loaded": mem_loaded, "mem_end": mem, "device": str(dev),
                   "copier": None if runner.copier is None else runner.copier.mode,
                   "ring_stats": dict(runner.ring.stats),
                   "stage_bytes": sum(p.numel() * p.element_size() for p in runner.stage.parameters()),
                   "rss_peak": _rss_peak_bytes()})
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

        from ..runtime.suffix import SuffixRunner

        runner = SuffixRunner(spec["model"], spec["k"], dtype=spec["dtype"], ring_name=spec["ring"],
                              threads=spec.get("threads", 0), delivery=spec.get("delivery", "newest"),
                              background_build=False)
        records, errors = [], []
        t_attach = time.monotonic() + 300
        while not runner.attached and time.monotonic() < t_attach:
            runner.poll(0.05)
        if not runner.attached:
            raise TimeoutError(f"could not attach: {runner.attach_error}")
        ev_attached.set()
        idle_since = None
        while True:
            try:
                r = runner.poll(0.2)
            except (RuntimeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if r is None:
                if shared["prefix_done"].value:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 1.0:
                        break
                continue
            idle_since = None
            records.append({"seq": r.meta.seq, "k": r.meta.split_layer, "stamp": r.meta.stamp_ns,
                            "suffix_ms": r.suffix_ms, "handoff_ms": r.handoff_ms,
                            "e2e_ms": (r.t_suffix_end_ns - r.t_prefix_start_ns) / 1e6 if r.t_prefix_start_ns else None,
                            "t_end_ns": r.t_suffix_end_ns, "suffix_k_held": runner.split.first_held,
                            "superseded": r.superseded, "waypoints": r.waypoints.tolist(),
                            "resplits": len(r.resplits)})
        conn.send({"type": "result", "records": records, "errors": errors, "superseded": runner.superseded,
                   "ring_stats": {k: v for k, v in runner.ring_stats().items() if isinstance(v, (int, float))},
                   "rss_peak": _rss_peak_bytes(), "threads": torch.get_num_threads()})
        shared["suffix_done"].value = 1
        runner.close()
    except BaseException as e:  # noqa: BLE001
        shared["suffix_done"].value = 1
        conn.send({"type": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def ballast_process(conn, device_name: str) -> None:
    """Child process: takes device memory on command (``{"take": bytes}`` in chunks, ``{"free": True}``,
    ``{"exit": True}``), answering each command with what it holds and any allocation failure."""
    import torch

    dev = torch.device(device_name)
    held = []
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)  # the context exists before the measurement starts
    conn.send({"ready": True})
    while True:
        cmd = conn.recv()
        if cmd.get("exit"):
            break
        if cmd.get("free"):
            held.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            conn.send({"held": 0})
            continue
        n = int(cmd.get("take", 0))
        err = ""
        try:
            if n > 0 and dev.type == "cuda":
                held.append(torch.empty(n, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError as e:
            err = str(e).splitlines()[0]
        conn.send({"held": sum(t.numel() for t in held), "error": err})


class Pair:
    """A prefix and a suffix process on one ring (and the shared counters the parent watches)."""

    def __init__(self, model: str, k: int, *, device: str, prefix_dtype: str, suffix_dtype: str, frames: int,
                 camera_wh, prefix_cores, suffix_cores, moves: dict | None = None, policy: dict | None = None,
                 pace: bool = True, max_s: float = 300):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        ring = f"gpucheck_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.shared = {name: self.ctx.Value("q", 0) for name in
                       ("k", "frames", "free", "ballast", "done", "prefix_done", "suffix_done")}
        self.ev = self.ctx.Event()
        self.pconn, pchild = self.ctx.Pipe()
        self.sconn, schild = self.ctx.Pipe()
        pspec = dict(model=str(model), k=k, device=device, dtype=prefix_dtype, ring=ring, frames=frames,
                     camera_wh=list(camera_wh), cores=prefix_cores, threads=len(prefix_cores),
                     moves={str(a): b for a, b in (moves or {}).items()}, policy=policy, pace=pace, max_s=max_s)
        sspec = dict(model=str(model), k=k, dtype=suffix_dtype, ring=ring, cores=suffix_cores,
                     threads=len(suffix_cores))
        self.suffix = self.ctx.Process(target=suffix_process, args=(schild, self.ev, self.shared, sspec), daemon=True)
        self.prefix = self.ctx.Process(target=prefix_process, args=(pchild, self.ev, self.shared, pspec), daemon=True)
        self.prefix.start()
        self.suffix.start()
        self.max_s = max_s
        self.plan_msg = None

    def results(self) -> tuple[dict, dict]:
        """Wait for both processes; (prefix result, suffix result). Raises RuntimeError with a child's error or
        when a child exits (or the run overruns its limit) without a result."""
        deadline = time.monotonic() + self.max_s + 120
        out = {}
        for name, conn, proc in (("prefix", self.pconn, self.prefix), ("suffix", self.sconn, self.suffix)):
            while name not in out:
                if conn.poll(0.5):
                    msg = conn.recv()
                    if msg["type"] == "plan":
                        self.plan_msg = msg
                    elif msg["type"] == "error":
                        self.kill()
                        raise RuntimeError(f"{name} process: {msg['error']}\n{msg.get('traceback', '')}")
                    else:
                        out[name] = msg
                elif not proc.is_alive() and not conn.poll(0.5):
                    self.kill()
                    raise RuntimeError(f"the {name} process exited without a result (exit code {proc.exitcode})")
                elif time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"the {name} process gave no result within {self.max_s + 120:.0f} s")
        for proc in (self.prefix, self.suffix):
            proc.join(30)
        return out["prefix"], out["suffix"]

    def kill(self) -> None:
        for proc in (self.prefix, self.suffix):
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def pipeline_figures(prefix: dict, suffix: dict, warmup: int) -> dict:
    """Latency / rate figures of one pipeline run: e2e (camera frame -> waypoints) percentiles over the frames
    after ``warmup``, fps (output rate over those frames), stage times, frames published / computed /
    superseded / lost, and frames whose suffix K differs from the prefix's record of the same seq."""
    prec = {r["seq"]: r for r in prefix["records"]}
    srec = suffix["records"]
    measured = [r for r in srec if r["stamp"] > warmup]
    ends = [r["t_end_ns"] for r in measured]
    fps = (len(ends) - 1) / ((ends[-1] - ends[0]) / 1e9) if len(ends) > 1 and ends[-1] > ends[0] else float("nan")
    mismatched = sum(1 for r in srec if r["seq"] in prec and prec[r["seq"]]["k"] != r["k"])
    computed_below_held = sum(1 for r in srec if r["suffix_k_held"] > r["k"])
    superseded = suffix.get("superseded", 0)
    overwritten = int(prefix.get("ring_stats", {}).get("dropped_oldest", 0))
    return {
        "e2e_ms": _pct([r["e2e_ms"] for r in measured if r["e2e_ms"] is not None]),
        "fps": fps,
        "prefix_ms": _pct([prec[r["seq"]]["prefix_ms"] for r in measured if r["seq"] in prec]),
        "preprocess_ms": _pct([prec[r["seq"]]["preprocess_ms"] for r in measured if r["seq"] in prec]),
        "suffix_ms": _pct([r["suffix_ms"] for r in measured]),
        "handoff_ms": _pct([r["handoff_ms"] for r in measured]),
        "published": len(prefix["records"]), "computed": len(srec), "superseded": superseded,
        "overwritten": overwritten, "lost": frames_lost(len(prefix["records"]), len(srec), superseded, overwritten),
        "mismatched_k": mismatched + computed_below_held,
        "errors": prefix.get("errors", []) + suffix.get("errors", []),
    }


# ---------------------------------------------------------------------------------------- sections

class Check:
    """One run of the check: options, sizes, the report being built and the global time budget."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = _torch_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sizes = sizes_for(args.small, self.cuda)
        self.cache = Path(args.cache) if args.cache else self.out / "models"
        self.t0 = time.monotonic()
        cores = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else list(range(os.cpu_count() or 1)))
        self.prefix_cores, self.suffix_cores = core_split(cores)
        self.prefix_dtype = "bf16" if self._runs("bf16") else "fp32"
        self.suffix_dtype = "bf16" if self._runs_cpu("bf16") else "fp32"
        if self.prefix_dtype == "bf16" and self.suffix_dtype == "fp32":
            pass  # bf16 -> fp32 is an exact ring conversion
        if self.prefix_dtype == "fp32" and self.suffix_dtype == "bf16":
            self.suffix_dtype = "fp32"
        self.report = {"machine": machine_info(self.device), "options": {
            "device": str(self.device), "small": bool(args.small), "budget_s": args.budget_s,
            "prefix_cores": self.prefix_cores, "suffix_cores": self.suffix_cores,
            "prefix_dtype": self.prefix_dtype, "suffix_dtype": self.suffix_dtype}, "sections": {}}
        self.plots: list[str] = []
        self.notes: list[str] = []

    def _runs(self, dtype: str) -> bool:
        from ..model.checkpoint import check_device_dtype, parse_dtype

        try:
            check_device_dtype(self.device, parse_dtype(dtype))
            return True
        except ValueError:
            return False

    def _runs_cpu(self, dtype: str) -> bool:
        from ..model.checkpoint import check_device_dtype, parse_dtype

        try:
            check_device_dtype("cpu", parse_dtype(dtype))
            return True
        except ValueError:
            return False

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def log(self, text: str) -> None:
        print(text, flush=True)

    def checkpoint(self, name: str, overrides: dict, dtype: str = "fp16") -> Path:
        return ensure_checkpoint(self.cache, name, overrides, dtype, log=self.log)

    def run(self) -> dict:
        wanted = [s for s in SECTIONS if not self.args.sections or s in self.args.sections]
        for name in SECTIONS:
            if name not in wanted:
                self.report["sections"][name] = {"status": "not requested"}
                continue
            if self.left_s() <= 0:
                self.report["sections"][name] = {"status": "skipped",
                                                 "reason": f"the {self.args.budget_s:.0f} s budget was spent"}
                self.log(f"[{name}] skipped: time budget spent")
                continue
            self.log(f"[{name}] {TITLES[name]} ...")
            t = time.monotonic()
            try:
                data = getattr(self, f"section_{name}")()
                data.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
                data = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                self.log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            data["seconds"] = round(time.monotonic() - t, 2)
            self.report["sections"][name] = data
            self.log(f"[{name}] {data['status']} in {data['seconds']:.1f} s")
        self.report["total_s"] = round(time.monotonic() - self.t0, 2)
        self.report["plots"] = self.plots
        self.report["notes"] = self.notes
        return self.report

    # ------------------------------------------------------------------------------ 1. memory plan
    def section_memory_plan(self) -> dict:
        from ..model.config import preset
        from ..split.planner import plan_split

        out = {"presets": {}}
        for name in self.sizes.memory_presets:
            if self.left_s() <= 0:
                out["presets"][name] = {"status": "skipped", "reason": "time budget spent"}
                continue
            cfg = preset(name, **self.sizes.overrides.get(name, {}))
            dtype = "fp16" if self._runs("fp16") else "fp32"
            plan = plan_split(cfg, dtype, cuda_overhead_bytes=None if self.cuda else 0, model_name=name)
            ks = split_points(cfg.num_layers)
            rows = self._memory_rows(name, ks, dtype)
            for row in rows:
                p = plan.row(row["k"])
                row["plan_total"] = p.gpu_total_bytes
                row["plan_weights"] = p.gpu_weight_bytes
                row["plan_without_overhead"] = p.gpu_total_bytes - p.gpu_overhead_bytes
                row["weights_within_10pct"] = within(row["weight_bytes"], p.gpu_weight_bytes)
                if self.cuda:
                    row["reserved_vs_plan"] = row["peak_reserved"] / max(1, row["plan_without_overhead"])
                    row["reserved_within_10pct"] = within(row["peak_reserved"], row["plan_without_overhead"])
                    if row.get("driver_total") is not None:
                        row["driver_vs_plan"] = row["driver_total"] / max(1, p.gpu_total_bytes)
                        row["driver_within_10pct"] = within(row["driver_total"], p.gpu_total_bytes)
            out["presets"][name] = {"dtype": dtype, "num_layers": cfg.num_layers, "cuda_overhead_allowance":
                                    plan.cuda_overhead_bytes, "rows": rows}
        if not self.cuda:
            out["note"] = (f"peak allocated / reserved and driver-level used memory: {NEEDS_CUDA}; on the CPU the "
                           "weights' bytes of the stage made on the device are compared with the plan's")
        self._plot_memory(out)
        return out

    def _memory_rows(self, name: str, ks: list[int], dtype: str) -> list[dict]:
        """Per K: the prefix made with random weights on the device, one forward; figures in bytes. On CUDA each
        preset runs in a fresh process so the driver-level figure starts from an empty device."""
        if not self.cuda:
            return memory_rows(name, self.sizes.overrides.get(name, {}), ks, dtype, str(self.device))
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            rows = pool.apply(memory_rows, (name, self.sizes.overrides.get(name, {}), ks, dtype, str(self.device)))
        return rows

    # ------------------------------------------------------------------------------ 2. paper table
    def section_paper_table(self) -> dict:
        out = {"presets": {}, "prefix_dtype": self.prefix_dtype, "suffix_dtype": self.suffix_dtype,
               "suffix_cores": self.suffix_cores, "prefix_cores": self.prefix_cores,
               "paper": {"orion": "521 -> 408 ms, 45 -> 29 GB", "minddrive-0.5b": "443 -> 306 ms"}}
        if self.prefix_dtype != "fp16":
            out["dtype_note"] = ("the prefix runs in " + self.prefix_dtype + ": fp16 -> bf16 is not an allowed ring "
                                 "conversion (transport.contract.CONVERSIONS), and bf16 has fp16's bytes")
        # this section may take half of what is left, so the sections after it still run
        t_end = time.monotonic() + 0.5 * self.left_s()
        out["share_s"] = round(t_end - time.monotonic(), 1)

        def left() -> float:
            return min(self.left_s(), t_end - time.monotonic())

        presets = list(self.sizes.pipeline_presets)
        for n_done, name in enumerate(presets):
            rows = []
            out["presets"][name] = {"rows": rows}
            # each preset gets an equal part of what is left of the share, so the last one still runs
            p_end = time.monotonic() + left() / (len(presets) - n_done)

            def row_left() -> float:
                return min(left(), p_end - time.monotonic())

            try:
                if row_left() <= (90 if name == "orion" else 20):  # orion: writing its 14 GB checkpoint takes ~1 min
                    out["presets"][name]["status"] = "skipped: this section's share of the time budget is spent"
                    continue
                if self.left_s() <= 30:
                    out["presets"][name]["status"] = "skipped: time budget spent"
                    continue
                from ..model.config import preset

                cfg = preset(name, **self.sizes.overrides.get(name, {}))
                path = self.checkpoint(name, self.sizes.overrides.get(name, {}))
                ks = (split_points(cfg.num_layers) if self.sizes.pipeline_ks is None
                      else {int(f * cfg.num_layers) for f in self.sizes.pipeline_ks})
                for k in sorted(ks, reverse=True):
                    if row_left() <= 10:
                        rows.append({"k": k, "status": "skipped: this section's share of the time budget is spent"})
                        continue
                    pair = Pair(path, k, device=str(self.device), prefix_dtype=self.prefix_dtype,
                                suffix_dtype=self.suffix_dtype, frames=self.sizes.frames + self.sizes.warmup,
                                camera_wh=self.sizes.camera_wh, prefix_cores=self.prefix_cores,
                                suffix_cores=self.suffix_cores, max_s=max(30.0, row_left()))
                    pre, suf = pair.results()
                    row = {"k": k, "label": "GPU-only (K = L)" if k == cfg.num_layers else "hybrid"}
                    row.update(pipeline_figures(pre, suf, self.sizes.warmup))
                    mem = pre.get("mem_end") or {}
                    row["gpu_peak_reserved"] = mem.get("peak_reserved")
                    row["gpu_used"] = mem.get("used")
                    row["prefix_stage_bytes"] = pre["stage_bytes"]
                    row["suffix_rss_peak"] = suf["rss_peak"]
                    row["copier"] = pre.get("copier")
                    rows.append(row)
                    self.log(f"  {name} K={k}: e2e p50 {row['e2e_ms'].get('p50', float('nan')):.1f} ms, "
                             f"{row['fps']:.2f} fps, lost {row['lost']}")
                out["presets"][name]["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - the next preset still runs
                out["presets"][name]["status"] = f"failed: {type(e).__name__}: {e}"
                out["presets"][name]["traceback"] = traceback.format_exc()
        if not self.cuda:
            out["note"] = "the prefix runs on the CPU: GPU memory per row " + NEEDS_CUDA
        self._plot_paper(out)
        return out

    # ------------------------------------------------------------------------------ 3. live re-split
    def section_live_resplit(self) -> dict:
        from ..model.config import preset

        name = self.sizes.resplit_preset
        overrides = self.sizes.overrides.get(name, {})
        cfg = preset(name, **overrides)
        path = self.checkpoint(name, overrides)
        L = cfg.num_layers
        n = self.sizes.resplit_frames
        down, up = max(0, L // 4), L
        moves = {n // 3: down, (2 * n) // 3: up}
        pair = Pair(path, L, device=str(self.device), prefix_dtype=self.prefix_dtype, suffix_dtype=self.suffix_dtype,
                    frames=n, camera_wh=self.sizes.camera_wh, prefix_cores=self.prefix_cores,
                    suffix_cores=self.suffix_cores, moves=moves, max_s=max(30.0, self.left_s()))
        pre, suf = pair.results()
        fig = pipeline_figures(pre, suf, 0)
        moves_done = [r["resplit"] | {"frame": r["i"]} for r in pre["records"] if "resplit" in r]
        out = {"preset": name, "num_layers": L, "requested": {str(a): b for a, b in moves.items()},
               "moves": moves_done, "published": fig["published"], "computed": fig["computed"],
               "superseded": fig["superseded"], "overwritten": fig["overwritten"], "lost": fig["lost"],
               "mismatched_k": fig["mismatched_k"],
               "errors": fig["errors"], "ks_seen_by_suffix": sorted({r["k"] for r in suf["records"]})}
        down_moves = [m for m in moves_done if m["to"] < m["from"]]
        if self.cuda and down_moves:
            m = down_moves[0]
            out["returned_to_driver_bytes"] = m["returned"]
            out["reserved_drop_bytes"] = m["reserved_before"] - m["reserved_after"]
            out["memory_returned"] = m["returned"] > 0 and m["reserved_after"] < m["reserved_before"]
        else:
            out["memory_returned"] = NEEDS_CUDA if not self.cuda else "no move down happened"
            if down_moves:
                out["stage_bytes_freed"] = down_moves[0]["stage_before"] - down_moves[0]["stage_after"]
        out["status"] = "ok" if len(moves_done) == 2 and fig["lost"] == 0 and fig["mismatched_k"] == 0 else "check"
        return out

    # ------------------------------------------------------------------------------ 4. memory pressure
    def section_memory_pressure(self) -> dict:
        from ..model.config import preset
        from ..split.planner import plan_split

        name = self.sizes.resplit_preset
        overrides = self.sizes.overrides.get(name, {})
        cfg = preset(name, **overrides)
        path = self.checkpoint(name, overrides)
        L = cfg.num_layers
        plan = plan_split(cfg, self.prefix_dtype, cuda_overhead_bytes=None if self.cuda else 0)
        block = max(1, plan.row(L).gpu_total_bytes - plan.row(L - 1).gpu_total_bytes)
        # the ballast leaves free memory `shortfall` under the low threshold: about half the blocks above L/2
        shortfall = max(block, (plan.row(L).gpu_total_bytes - plan.row(L // 2).gpu_total_bytes) // 2)
        low = max(512 * MIB, 2 * shortfall) if self.cuda else 2 * shortfall
        high = low + 2 * shortfall + block
        policy = {"low": low, "high": high, "margin": block, "up_after": 3, "period_s": 0.2 if self.cuda else 0.05}
        ballast = None
        if self.cuda:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            bconn, bchild = ctx.Pipe()
            ballast = ctx.Process(target=ballast_process, args=(bchild, str(self.device)), daemon=True)
            ballast.start()
            if not bconn.poll(120):
                raise RuntimeError("the ballast process did not start")
            bconn.recv()
        pair = Pair(path, L, device=str(self.device), prefix_dtype=self.prefix_dtype, suffix_dtype=self.suffix_dtype,
                    frames=0, camera_wh=self.sizes.camera_wh, prefix_cores=self.prefix_cores,
                    suffix_cores=self.suffix_cores, policy=policy, max_s=max(30.0, min(180.0, self.left_s())))
        timeline, ballast_errors = [], []
        try:
            sh = pair.shared
            limit = time.monotonic() + max(20.0, min(150.0, self.left_s()))

            def wait(cond, seconds):
                end = min(limit, time.monotonic() + seconds)
                while time.monotonic() < end and not cond() and pair.prefix.is_alive():
                    time.sleep(0.02)
                return cond()

            wait(lambda: sh["frames"].value >= 3, 120)
            k0 = sh["k"].value
            # take memory so free falls under the low threshold by about half the blocks above L/2
            want_free = low - shortfall
            take = max(0, sh["free"].value - want_free) if self.cuda else 0
            if self.cuda:
                steps = 8
                for _ in range(steps):
                    bconn.send({"take": take // steps})
                    msg = bconn.recv()
                    if msg.get("error"):
                        ballast_errors.append(msg["error"])
                    timeline.append({"t": round(time.monotonic() - self.t0, 2), "ballast": msg["held"],
                                     "k": sh["k"].value, "free": sh["free"].value})
                    time.sleep(policy["period_s"] * 2)
            else:
                sim_total = plan.row(L).gpu_total_bytes + high + block
                sh["ballast"].value = int(sim_total - plan.row(L).gpu_total_bytes - want_free)
                timeline.append({"t": round(time.monotonic() - self.t0, 2), "ballast": sh["ballast"].value,
                                 "k": sh["k"].value})
            moved_down = wait(lambda: sh["k"].value < k0, 30)
            k_low = sh["k"].value
            timeline.append({"t": round(time.monotonic() - self.t0, 2), "event": "after pressure", "k": k_low,
                             "free": sh["free"].value})
            wait(lambda: False, 1.0)  # frames at the lower K
            if self.cuda:
                bconn.send({"free": True})
                bconn.recv()
            else:
                sh["ballast"].value = 0
            timeline.append({"t": round(time.monotonic() - self.t0, 2), "event": "ballast released"})
            moved_up = wait(lambda: sh["k"].value > k_low, 30)
            timeline.append({"t": round(time.monotonic() - self.t0, 2), "event": "after release", "k": sh["k"].value,
                             "free": sh["free"].value})
            wait(lambda: False, 0.5)
        finally:
            pair.shared["done"].value = 1
            if ballast is not None:
                try:
                    bconn.send({"exit": True})
                except OSError:
                    pass
                ballast.join(10)
        pre, suf = pair.results()
        fig = pipeline_figures(pre, suf, 0)
        ooms = [e for e in pre["errors"] if "out of memory" in e]
        out = {"preset": name, "num_layers": L, "low_threshold": low, "high_threshold": high,
               "free_source": "torch.cuda.mem_get_info" if self.cuda else
               "simulated: a device of fixed size minus the plan total at the current K minus the ballast",
               "decisions": pre["decisions"], "timeline": timeline, "moved_down": moved_down, "moved_up": moved_up,
               "prefix_out_of_memory": len(ooms), "ballast_errors": ballast_errors, "published": fig["published"],
               "computed": fig["computed"], "superseded": fig["superseded"], "overwritten": fig["overwritten"],
               "lost": fig["lost"],
               "mismatched_k": fig["mismatched_k"], "errors": fig["errors"]}
        if not self.cuda:
            out["note"] = (f"a real ballast on the device {NEEDS_CUDA}; the policy and the live re-split are the "
                           "real ones")
        out["status"] = "ok" if moved_down and moved_up and not ooms and fig["mismatched_k"] == 0 else "check"
        return out

    # ------------------------------------------------------------------------------ 5. hand-off
    def section_handoff(self) -> dict:
        return handoff_figures(str(self.device), reps=self.sizes.reps)

    # ------------------------------------------------------------------------------ 6. camera decode
    def section_camera_decode(self) -> dict:
        return decode_figures(str(self.device), CAMERA_WH,
                              reps=self.sizes.reps)

    # ------------------------------------------------------------------------------ 7. numerics
    def section_numerics(self) -> dict:
        name = self.sizes.numerics_preset
        overrides = dict(self.sizes.overrides.get(name, {}), **self.sizes.numerics_overrides)
        path = self.checkpoint(name, overrides, dtype="fp32")
        return numerics_figures(path, str(self.device))

    # ------------------------------------------------------------------------------ plots
    def _plot_memory(self, out: dict) -> None:
        plt = _pyplot()
        if plt is None:
            self._no_plot("memory_plan")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in out["presets"].items():
            rows = data.get("rows") or []
            ks = [r["k"] for r in rows]
            ax.plot(ks, [r["plan_total"] / GB for r in rows], "--", label=f"{name} plan")
            key = "driver_total" if self.cuda else "weight_bytes"
            ax.plot(ks, [(r.get(key) or 0) / GB for r in rows], "o-", label=f"{name} measured ({key})")
        ax.set_xlabel("split layer K")
        ax.set_ylabel("GB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = self.out / "memory_plan.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        self.plots.append(path.name)

    def _plot_paper(self, out: dict) -> None:
        plt = _pyplot()
        if plt is None:
            self._no_plot("paper_table")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in out["presets"].items():
            rows = [r for r in data.get("rows", []) if "e2e_ms" in r]
            ax.plot([r["k"] for r in rows], [r["e2e_ms"].get("p50", float("nan")) for r in rows], "o-", label=name)
        ax.set_xlabel("split layer K")
        ax.set_ylabel("end-to-end p50, ms")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = self.out / "paper_table.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        self.plots.append(path.name)

    def _no_plot(self, what: str) -> None:
        note = f"{what}: no PNG (matplotlib is not installed here); the figures are in gpu_check.json / .md"
        if note not in self.notes:
            self.notes.append(note)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# ---------------------------------------------------------------------------------------- measurements

def memory_rows(name: str, overrides: dict, ks: list[int], dtype: str, device_name: str,
                smi_used_before: int | None = None) -> list[dict]:
    """Per K: the prefix of preset ``name`` with random weights made on ``device_name`` in ``dtype`` and one
    forward on random pixels. Bytes: ``weight_bytes`` (parameters), and on CUDA ``peak_allocated``,
    ``peak_reserved``, ``driver_used`` (total - free after the forward, the allocator's cache still held),
    ``driver_delta`` (that minus the figure before the stage was made), ``cuda_context`` (this process's context:
    used after it was created minus nvidia-smi's reading before; without nvidia-smi the whole used figure at
    start, other processes included) and ``driver_total`` = delta + context. ``smi_used_before``: ignored on
    CUDA (read here, before this process creates its context)."""
    import gc

    import torch

    from ..model.checkpoint import parse_dtype, random_stage
    from ..model.config import preset
    from ..runtime.device import resolve_device

    cfg = preset(name, **overrides)
    if device_name.startswith("cuda") or device_name == "auto":
        # this process's own context is told apart by nvidia-smi's reading before it exists (the parent's
        # context, if any, is then counted as another process's memory, not this one's)
        index = int(device_name.partition(":")[2] or 0) if device_name.startswith("cuda") else 0
        smi_used_before = _nvidia_smi_used(index)
    device = resolve_device(device_name)
    dt = parse_dtype(dtype)
    cuda = device.type == "cuda"
    if cuda:
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    base_used = int(torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0]) if cuda else 0
    rows = []
    for k in ks:
        row = {"k": k}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = int(torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0])
        t0 = time.perf_counter()
        stage = random_stage(cfg, "prefix", k, device=device, dtype=dt)
        row["make_s"] = round(time.perf_counter() - t0, 3)
        row["weight_bytes"] = sum(p.numel() * p.element_size() for p in stage.parameters())
        pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, device=device).to(dt)
        ego = torch.tensor(EGO_STATE, dtype=torch.float32, device=device) if cfg.ego_state_input else None
        with torch.inference_mode():
            t0 = time.perf_counter()
            hidden = stage(pixels, ego)
            _sync(device)
            row["forward_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        row["finite"] = bool(torch.isfinite(hidden).all())
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            row["peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
            row["peak_reserved"] = int(torch.cuda.max_memory_reserved(device))
            row["driver_used"] = int(total - free)
            row["driver_delta"] = row["driver_used"] - before
            context = (base_used - smi_used_before) if smi_used_before is not None else base_used
            row["cuda_context"] = context
            row["driver_total"] = row["driver_delta"] + context
        del stage, hidden, pixels
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def handoff_figures(device_name: str, reps: int = 20) -> dict:
    """The hand-off of ``orion``'s hidden states (its ``prefix_state_shape``, fp16) into a ring slot, ms per
    copy (median of ``reps``) and GB/s: on CUDA pageable (a plain tensor), the slot with the registered
    (page-locked) mapping, the pinned staging fallback and an unregistered slot; on the CPU a host copy into
    the slot (the device modes need CUDA)."""
    import torch

    from ..model.config import preset
    from ..runtime.device import resolve_device
    from ..transport.pinned import SlotCopier
    from ..transport.ring import RingProducer, segment_name, slot_bytes_for

    cfg = preset("orion")
    shape, dtype = tuple(cfg.prefix_state_shape), torch.float16
    device = resolve_device(device_name)
    nbytes = math.prod(shape) * 2
    out = {"state_shape": list(shape), "dtype": "fp16", "bytes": nbytes, "modes": {}}
    ring = RingProducer(segment_name(f"gpucheck_ho_{os.getpid()}_{uuid.uuid4().hex[:6]}", "/"), 3,
                        slot_bytes_for(shape, dtype), 1,
                        dtype=dtype, state_shape=shape, device=device)

    def timed(fn) -> dict:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        med = sorted(times)[len(times) // 2]
        return {"ms_p50": round(med, 4), "gb_per_s": round(nbytes / (med / 1e3) / GB, 2), "ms": _pct(times)}

    try:
        src = torch.randn(shape, device=device).to(dtype)
        slot = ring.acquire(shape, dtype)
        try:
            if device.type != "cuda":
                out["modes"]["cpu_copy_into_slot"] = timed(lambda: slot.tensor.copy_(src))
                out["note"] = (f"pageable vs page-locked device-to-host copies {NEEDS_CUDA}; this is the CPU "
                               "prefix's host copy into the slot (a CPU prefix normally writes in the slot: no copy)")
                return out
            pageable = torch.empty(shape, dtype=dtype)
            out["modes"]["pageable_tensor"] = timed(lambda: pageable.copy_(src))

            class _Refuse:
                @staticmethod
                def cudaHostRegister(ptr, size, flags):
                    return 1  # cudaErrorInvalidValue: forces the fallback

            for label, kwargs in (("registered_slot", {}), ("pinned_staging", {"cudart": _Refuse()}),
                                  ("pageable_slot", {"cudart": _Refuse(), "pinned_alloc": _no_pin})):
                copier = SlotCopier(ring, device, **kwargs)
                try:
                    row = timed(lambda: copier.copy(src, slot.tensor))
                    row["mode"] = copier.mode
                    row["exact"] = bool(torch.equal(slot.tensor, src.cpu()))
                    out["modes"][label] = row
                finally:
                    copier.close()
        finally:
            ring.abort(slot)
    finally:
        ring.close()
    return out


def _no_pin(nbytes: int):
    raise RuntimeError("no pinned memory (forced by the check)")


def _jpegs(wh: tuple[int, int], n: int = 6) -> tuple[list[bytes], str]:
    """``n`` JPEG camera frames of ``wh`` px and the encoder used (cv2, else torchvision, else PIL)."""
    import numpy as np

    images = [synthetic_rgb(wh[0], wh[1], seed=i) for i in range(n)]
    try:
        import cv2

        return [cv2.imencode(".jpg", img[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
                for img in images], "cv2"
    except ImportError:
        pass
    try:
        import torch
        from torchvision.io import encode_jpeg

        return [encode_jpeg(torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), quality=90)
                .numpy().tobytes()
                for img in images], "torchvision"
    except ImportError:
        import io

        from PIL import Image

        outs = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            outs.append(buf.getvalue())
        return outs, "PIL"


def decode_figures(device_name: str, wh: tuple[int, int], reps: int = 10) -> dict:
    """6 JPEG cameras of ``wh`` px decoded per frame, ms (median of ``reps``): the prefix's CPU path
    (``compressed_msg_to_rgb``, cv2), torchvision's CPU decoder where installed and nvJPEG
    (``torchvision.io.decode_jpeg(..., device='cuda')``, batched) on CUDA."""
    import torch

    from ..runtime.device import resolve_device

    device = resolve_device(device_name)
    jpegs, encoder = _jpegs(wh)
    out = {"cameras": len(jpegs), "width": wh[0], "height": wh[1], "encoder": encoder,
           "jpeg_bytes": sum(len(j) for j in jpegs), "paths": {}}

    def timed(fn, sync=False) -> dict:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms_p50": round(sorted(times)[len(times) // 2], 3), "ms": _pct(times)}

    try:
        from ..vehicle.image import compressed_msg_to_rgb

        msgs = [SimpleNamespace(format="rgb8; jpeg compressed bgr8", data=j) for j in jpegs]
        out["paths"]["cpu_prefix_path"] = timed(lambda: [compressed_msg_to_rgb(m) for m in msgs])
    except ImportError as e:
        out["paths"]["cpu_prefix_path"] = {"status": f"not available: {e}"}
    try:
        from torchvision.io import decode_jpeg

        datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        out["paths"]["torchvision_cpu"] = timed(lambda: [decode_jpeg(d) for d in datas])
        if device.type == "cuda":
            out["paths"]["nvjpeg_cuda"] = timed(lambda: decode_jpeg(datas, device=str(device)), sync=True)
        else:
            out["paths"]["nvjpeg_cuda"] = {"status": NEEDS_CUDA}
    except ImportError:
        out["paths"]["torchvision_cpu"] = {"status": "torchvision is not installed"}
        out["paths"]["nvjpeg_cuda"] = {"status": "torchvision is not installed" + ("" if device.type == "cuda"
                                                                                  else f"; {NEEDS_CUDA}")}
    return out


def numerics_figures(path: Path, device_name: str) -> dict:
    """Trajectory drift of prefix (fp16, bf16 on ``device_name``) -> suffix (CPU, fp32 and bf16) at K = L/2
    against the fp32 CPU monolithic model on the same pixels and ego state (the default command's mode): cm at
    the 3 s waypoint and the largest distance over every waypoint. A dtype the device cannot run is reported as such."""
    import torch

    from ..model.checkpoint import check_device_dtype, load_stage, parse_dtype
    from ..runtime.device import resolve_device

    device = resolve_device(device_name)
    ref = load_stage(path, "full", device="cpu", dtype=torch.float32)
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, generator=gen)
    ego = torch.tensor(EGO_STATE, dtype=torch.float32) if cfg.ego_state_input else None
    with torch.inference_mode():
        want = ref(pixels, ego).double().numpy()
    del ref
    k = cfg.num_layers // 2
    out = {"split_layer": k, "num_layers": cfg.num_layers, "waypoint_dt_s": cfg.waypoint_dt_s,
           "reference": "fp32 monolithic model on the CPU", "random_weights": bool(cfg.random_init),
           "goal_cm": 1.0, "pairs": []}
    for pname in ("fp16", "bf16"):
        pdt = parse_dtype(pname)
        try:
            check_device_dtype(device, pdt)
        except ValueError as e:
            out["pairs"].append({"prefix": f"{pname} on {device}", "status": f"cannot run: {e}"})
            continue
        prefix = load_stage(path, "prefix", k, device=device, dtype=pdt)
        with torch.inference_mode():
            hidden = prefix(pixels.to(device, pdt), None if ego is None else ego.to(device)).cpu()
        del prefix
        for sname in ("fp32", "bf16"):
            sdt = parse_dtype(sname)
            suffix = load_stage(path, "suffix", k, device="cpu", dtype=sdt)
            with torch.inference_mode():
                got = suffix(hidden.to(sdt)).double().numpy()
            drift3 = drift_at(got, want, cfg.waypoint_dt_s)
            out["pairs"].append({"prefix": f"{pname} on {device}", "suffix": f"{sname} on cpu",
                                 "drift_3s_cm": round(drift3 * 100, 4),
                                 "max_drift_cm": round(float(((got - want) ** 2).sum(-1).max() ** 0.5) * 100, 4),
                                 "within_goal": drift3 * 100 <= 1.0})
            del suffix
    if device.type != "cuda":
        out["note"] = f"the prefix ran on the CPU (a GPU prefix {NEEDS_CUDA}): the drift is the CPU's in these dtypes"
    if cfg.random_init:
        out["random_note"] = ("random weights: the drift shows how the arithmetic differs; a trained head's "
                              "drift can be larger or smaller")
    return out


# ---------------------------------------------------------------------------------------- report

def machine_info(device) -> dict:
    """Host, Python, library versions and the device."""
    import numpy
    import torch

    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "cpus": os.cpu_count(),
            "device": str(device), "cuda_available": torch.cuda.is_available()}
    for mod in ("transformers", "safetensors", "torchvision", "cv2", "matplotlib"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            info[mod] = None
    try:  # which code measured: the repository's commit, when it is a git checkout
        import subprocess

        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    if torch.cuda.is_available() and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory=props.total_memory, cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    return info


def _fmt_bytes(v) -> str:
    """Bytes as MB (1e6 bytes), 'n/a' for None."""
    return "n/a" if v is None else f"{v / 1e6:.1f}"


def _p50(d) -> str:
    v = d.get("p50") if isinstance(d, dict) else None
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def markdown(report: dict) -> str:
    """The report as Markdown: machine, one table or list per section, skips and failures said as such."""
    m = report["machine"]
    lines = ["# GPU check", "", f"Device: {m['device']}" + (f" ({m.get('gpu')}, {m.get('gpu_memory', 0) / GB:.0f} GB, "
                                                          f"CUDA {m.get('cuda')})" if m.get("gpu") else ""),
             f"Host {m['host']}: {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, transformers "
             f"{m.get('transformers')}, torchvision {m.get('torchvision')}, cv2 {m.get('cv2')}",
             f"Code: commit {m.get('commit')}", f"Options: {json.dumps(report['options'])}",
             f"Total: {report.get('total_s', 0):.1f} s", ""]
    for name in SECTIONS:
        s = report["sections"].get(name, {"status": "missing"})
        lines += [f"## {TITLES[name]}", "", f"status: **{s.get('status')}**"
                  + (f" ({s['seconds']:.1f} s)" if "seconds" in s else ""), ""]
        if s.get("status") == "failed":
            lines += [f"error: `{s.get('error')}`", ""]
            continue
        if s.get("status") in ("skipped", "not requested"):
            lines += [s.get("reason", ""), ""]
            continue
        lines += _section_md(name, s)
        for key in ("note", "dtype_note", "random_note"):
            if s.get(key):
                lines += [f"note: {s[key]}", ""]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    for plot in report.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"


def _section_md(name: str, s: dict) -> list[str]:
    out = []
    if name == "memory_plan":
        for preset_name, d in s.get("presets", {}).items():
            out += [f"**{preset_name}** ({d.get('dtype')}, L = {d.get('num_layers')}), MB:", "",
                    "| K | plan total | plan weights | weights | peak allocated | peak reserved | driver used (+ctx) "
                    "| driver / plan |", "|---|---|---|---|---|---|---|---|"]
            for r in d.get("rows", []):
                ratio = r.get("driver_vs_plan")
                out.append(f"| {r['k']} | {_fmt_bytes(r.get('plan_total'))} | {_fmt_bytes(r.get('plan_weights'))} | "
                           f"{_fmt_bytes(r.get('weight_bytes'))} | {_fmt_bytes(r.get('peak_allocated'))} | "
                           f"{_fmt_bytes(r.get('peak_reserved'))} | {_fmt_bytes(r.get('driver_total'))} | "
                           + ("n/a" if ratio is None else f"{ratio:.2f}") + " |")
            out.append("")
    elif name == "paper_table":
        for preset_name, d in s.get("presets", {}).items():
            out += [f"**{preset_name}** ({d.get('status')}); paper: {s.get('paper', {}).get(preset_name, '-')}", "",
                    "| K | e2e p50 ms | fps | prefix p50 ms | hand-off p50 ms | suffix p50 ms | GPU reserved MB "
                    "| published | lost |", "|---|---|---|---|---|---|---|---|---|"]
            for r in d.get("rows", []):
                if "e2e_ms" not in r:
                    out.append(f"| {r['k']} | {r.get('status')} | | | | | | | |")
                    continue
                out.append(f"| {r['k']} | {_p50(r['e2e_ms'])} | {r['fps']:.2f} | {_p50(r['prefix_ms'])} | "
                           f"{_p50(r['handoff_ms'])} | {_p50(r['suffix_ms'])} | {_fmt_bytes(r.get('gpu_peak_reserved'))} "
                           f"| {r['published']} | {r['lost']} |")
            out.append("")
    elif name in ("live_resplit", "memory_pressure"):
        keys = ("published", "computed", "superseded", "overwritten", "lost", "mismatched_k", "memory_returned",
                "returned_to_driver_bytes", "moved_down", "moved_up", "prefix_out_of_memory")
        out += [f"- {k}: {s[k]}" for k in keys if k in s]
        for mv in s.get("moves", []):
            out.append(f"- move K {mv['from']} -> {mv['to']} at frame {mv['frame']}: {mv['ms']:.1f} ms, reserved "
                       f"{_fmt_bytes(mv['reserved_before'])} -> {_fmt_bytes(mv['reserved_after'])} MB, driver used "
                       f"{_fmt_bytes(mv['used_before'])} -> {_fmt_bytes(mv['used_after'])} MB")
        for d in s.get("decisions", []):
            out.append(f"- decision at frame {d['frame']}: K {d['from']} -> {d['to']} ({d['why']})")
        out.append("")
    elif name == "handoff":
        out += [f"state {s.get('state_shape')} {s.get('dtype')} ({s.get('bytes', 0) / 1e6:.2f} MB)", "",
                "| mode | ms p50 | GB/s |", "|---|---|---|"]
        for mode, r in s.get("modes", {}).items():
            out.append(f"| {mode} | {r['ms_p50']} | {r['gb_per_s']} |")
        out.append("")
    elif name == "camera_decode":
        out += [f"{s.get('cameras')} cameras {s.get('width')}x{s.get('height')}, {s.get('jpeg_bytes', 0) / 1e6:.2f} MB "
                f"of JPEG ({s.get('encoder')})", "", "| path | ms p50 per frame |", "|---|---|"]
        for p, r in s.get("paths", {}).items():
            out.append(f"| {p} | {r.get('ms_p50', r.get('status'))} |")
        out.append("")
    elif name == "numerics":
        out += [f"K = {s.get('split_layer')} of {s.get('num_layers')}, against the {s.get('reference')}", "",
                "| prefix | suffix | drift at 3 s, cm | max drift, cm | <= 1 cm |", "|---|---|---|---|---|"]
        for p in s.get("pairs", []):
            if "drift_3s_cm" in p:
                out.append(f"| {p['prefix']} | {p['suffix']} | {p['drift_3s_cm']} | {p['max_drift_cm']} | "
                           f"{'yes' if p['within_goal'] else 'no'} |")
            else:
                out.append(f"| {p['prefix']} | - | {p.get('status')} | | |")
        out.append("")
    return out


def summary(report: dict) -> str:
    """A few lines for stdout: each section's status and headline figure."""
    lines = [f"gpu-check on {report['machine']['device']} in {report.get('total_s', 0):.0f} s:"]
    for name in SECTIONS:
        s = report["sections"].get(name, {})
        head = ""
        if name == "paper_table" and s.get("presets"):
            parts = []
            for p, d in s["presets"].items():
                rows = [r for r in d.get("rows", []) if "e2e_ms" in r]
                parts += [f"{p} K={r['k']}: {_p50(r['e2e_ms'])} ms {r['fps']:.2f} fps" for r in rows[:2]]
            head = "; ".join(parts)
        elif name in ("live_resplit", "memory_pressure") and "lost" in s:
            head = f"lost {s['lost']}, mismatched K {s['mismatched_k']}"
        elif name == "numerics" and s.get("pairs"):
            head = ", ".join(f"{p['prefix'].split()[0]}->{p['suffix'].split()[0]} {p['drift_3s_cm']} cm"
                             for p in s["pairs"] if "drift_3s_cm" in p)
        elif s.get("status") == "failed":
            head = s.get("error", "")
        lines.append(f"  {TITLES[name]}: {s.get('status')}" + (f" -- {head}" if head else ""))
    return "\n".join(lines)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` under ``out``; returns their paths."""
    jpath, mpath = Path(out) / "gpu_check.json", Path(out) / "gpu_check.md"
    jpath.write_text(json.dumps(_finite(report), indent=2, default=_json_default) + "\n")
    mpath.write_text(markdown(report))
    return jpath, mpath


def _finite(o):
    """NaN / inf as None (strict JSON)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``hybrid-vla gpu-check`` and ``scripts/gpu_check.py``."""
    p = parser or argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check_out", help="output folder (JSON, Markdown, PNGs, model cache)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--small", action="store_true", help="reduced sizes: tiny preset, few frames (CPU test run)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="time budget, s: sections not started by then are skipped (default 420)")
    p.add_argument("--sections", nargs="*", choices=SECTIONS, default=None, help="run only these sections")
    p.add_argument("--cache", default="", help="checkpoint cache folder (default OUT/models; reused on a rerun)")
    return p


#: Modules the check imports when it runs (``import name`` -> what to install).
REQUIREMENTS = ("torch", "transformers", "safetensors", "numpy")
#: Refusal of a full-size run on a machine where ``--device auto`` finds no CUDA device.
NO_CUDA_FULL = ("no CUDA device: the full-size check is meant for a GPU machine (it writes about 20 GB of "
                "checkpoints and runs for a long time); use --device cpu --small here (or --device cpu for the "
                "full sizes on the CPU anyway)")


def missing_requirements(find=None) -> list[str]:
    """Names in :data:`REQUIREMENTS` this Python cannot import (``importlib.util.find_spec`` is None, or ``find``
    standing in for it); an empty list when all are there. Nothing is imported."""
    import importlib.util

    find = find or importlib.util.find_spec
    missing = []
    for name in REQUIREMENTS:
        try:
            if find(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def preflight(args: argparse.Namespace, cuda_available: bool | None = None, device_count: int | None = None) -> str:
    """Checks before anything is written: the requirements import, ``--device`` names a device this machine has,
    and ``auto`` resolving to the CPU is refused without ``--small`` (:data:`NO_CUDA_FULL`; ``--device cpu``
    given explicitly runs the full sizes). ``cuda_available`` / ``device_count`` default to torch's answers.
    Returns the error message, or ``""`` when the run may start."""
    missing = missing_requirements()
    if missing:
        return (f"gpu_check needs torch (and transformers, safetensors, numpy): {', '.join(missing)} "
                f"cannot be imported by {sys.executable}; run it with the Python that has them (e.g. the "
                f"repository's .venv/bin/python)")
    from ..runtime.device import parse_device

    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
        device_count = torch.cuda.device_count() if cuda_available else 0
    try:
        name = parse_device(args.device, cuda_available, device_count or 0)
    except ValueError as e:
        return f"--device: {e}"
    if name == "cpu" and str(args.device).strip().lower() == "auto" and not args.small:
        return NO_CUDA_FULL
    return ""


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    """Run the check; returns 0 when every section ran (ok or check), 1 when one failed, 2 when it cannot start
    (:func:`preflight`: a missing requirement, a device this machine lacks, a full-size run without CUDA)."""
    if args is None:
        args = build_parser().parse_args(argv)
    problem = preflight(args)
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    check = Check(args)
    report = check.run()
    jpath, mpath = write_report(report, check.out)
    print(summary(report))
    print(f"report: {jpath} and {mpath}")
    return 1 if any(s.get("status") == "failed" for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
