"""What every part of the GPU check shares: the section names, units and sizes of a run, and small pure helpers
(split points, core split, tolerance, drift, lost frames, percentiles, device sync, memory readings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ("memory_plan", "paper_table", "live_resplit", "memory_pressure", "handoff", "camera_decode",
            "numerics", "vehicle", "decode")
TITLES = {"memory_plan": "1. Memory plan vs reality", "paper_table": "2. The paper's table",
          "live_resplit": "3. Live re-split", "memory_pressure": "4. Memory pressure",
          "handoff": "5. Hand-off: pageable vs page-locked", "camera_decode": "6. Camera decode",
          "numerics": "7. Numerics", "vehicle": "8. Vehicle conditions", "decode": "9. Decode across the split"}
#: Each section's part of the time budget, relative (a section's limit: what is left of the budget times its part
#: over the parts of the sections still to run, so time one leaves unused goes to the ones after it). The paper
#: table, with two presets at up to five K each, gets the most; the others' parts follow their measured CPU dry-run
#: times and the GPU estimates in docs/performance.md.
SECTION_SHARES = {"memory_plan": 2.0, "paper_table": 6.0, "live_resplit": 1.5, "memory_pressure": 1.5,
                  "handoff": 0.5, "camera_decode": 0.5, "numerics": 1.0, "vehicle": 5.0, "decode": 0.5}
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
    # the numerics section's cameras (px; None: the preset's own); --small uses 48 (tiny has 64), so the dry run
    # takes the full-size run's path (the size set in the config and its vision encoder alike)
    numerics_image_size: int | None = 112
    pipeline_ks: tuple | None = None  # None: split_points(L); else fractions of L
    frames: int = 12
    warmup: int = 2
    resplit_frames: int = 40
    camera_wh: tuple = CAMERA_WH
    reps: int = 20
    vehicle_neighbours: bool = True  # the vehicle section runs K - 1 and K + 1 beside the planned K


def wide_tiny_llm() -> dict:
    """``tiny``'s LLM widened to 1024 (32 MB fp16 blocks): the small CUDA run's blocks are large enough to get
    caching-allocator segments of their own, so a move of K down can return whole segments to the driver."""
    from ...model.config import preset

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
                 overrides={"tiny": {"llm": wide_tiny_llm()} if cuda else {}}, numerics_image_size=48,
                 pipeline_ks=(1.0, 0.5), frames=6, warmup=1, resplit_frames=24,
                 camera_wh=(320, 200), reps=5, vehicle_neighbours=False)


def image_size_overrides(name: str, size: int, overrides: dict | None = None) -> dict:
    """``overrides`` of preset ``name`` with its cameras at ``size`` px (:func:`~..harness.sized`)."""
    from ..harness import sized

    return sized(name, size, overrides)


def numerics_overrides(sizes: "Sizes") -> dict:
    """The overrides of the numerics section's preset: the run's own for it, with the cameras at
    ``sizes.numerics_image_size`` px where set (:func:`image_size_overrides`)."""
    overrides = dict(sizes.overrides.get(sizes.numerics_preset, {}))
    if sizes.numerics_image_size:
        overrides = image_size_overrides(sizes.numerics_preset, sizes.numerics_image_size, overrides)
    return overrides


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
    frames the producer reused with every slot full: ``RingProducer.stats.dropped_oldest``) are counted
    apart, as the ring's policy; what is left is lost."""
    return max(0, published - computed - superseded - overwritten)



def runs(device, dtype: str) -> bool:
    """True when ``device`` (torch device or name) can run stages in ``dtype`` (``check_device_dtype``)."""
    from ...model.checkpoint import check_device_dtype, parse_dtype

    try:
        check_device_dtype(device, parse_dtype(dtype))
        return True
    except ValueError:
        return False


def pct(values) -> dict:
    """Percentiles of ``values`` (``util.stats.percentiles``, non-finite values left out)."""
    from ...util.stats import percentiles

    return percentiles(values, finite_only=True)


def torch_device(name: str):
    """``--device`` (auto | cpu | cuda[:N]) -> torch.device; ValueError for a device this machine lacks."""
    from ...runtime.device import resolve_device

    return resolve_device(name)


def sync(device) -> None:
    """Wait for the work queued on a CUDA ``device``; nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_peak_bytes() -> int:
    """This process's peak resident memory (VmHWM, bytes); 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def nvidia_smi_used(index: int = 0) -> int | None:
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
