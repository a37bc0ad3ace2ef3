"""Section 7, ``numerics``: fp16 / bf16 prefix on the device -> CPU suffix (fp32 and bf16) against the fp32 CPU
monolithic model: trajectory drift at 3 s (cm; goal <= 1 cm). The weights are random: the drift of a
random-weight head says how the arithmetic differs, not how a trained planner would drift."""
from __future__ import annotations

from pathlib import Path

from .common import EGO_STATE, NEEDS_CUDA, drift_at, numerics_overrides


def run(check) -> dict:
    """The section: :func:`numerics_figures` of an fp32 random-init checkpoint of ``check.sizes.numerics_preset``
    on the check's device."""
    path = check.checkpoint(check.sizes.numerics_preset, numerics_overrides(check.sizes), dtype="fp32")
    return numerics_figures(path, str(check.device))


def numerics_figures(path: Path, device_name: str) -> dict:
    """Trajectory drift of prefix (fp16, bf16 on ``device_name``) -> suffix (CPU, fp32 and bf16) at K = L/2
    against the fp32 CPU monolithic model on the same pixels and ego state (the default command's mode): cm at
    the 3 s waypoint and the largest distance over every waypoint. A dtype the device cannot run is reported as
    such."""
    import torch

    from ...model.checkpoint import check_device_dtype, load_stage, parse_dtype
    from ...model.modeling import example_scene
    from ...runtime.device import resolve_device

    device = resolve_device(device_name)
    ref = load_stage(path, "full", device="cpu", dtype=torch.float32)
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, generator=gen)
    ego = torch.tensor(EGO_STATE, dtype=torch.float32) if cfg.ego_state_input else None
    with torch.inference_mode():
        want = ref(pixels, ego, scene=example_scene(cfg)).double().numpy()
    del ref
    k = cfg.num_layers // 2
    out = {"split_layer": k, "num_layers": cfg.num_layers, "waypoint_dt_s": cfg.waypoint_dt_s,
           "image_size": cfg.image_size,
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
            hidden = prefix(pixels.to(device, pdt), None if ego is None else ego.to(device),
                            scene=example_scene(cfg)).cpu()
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
