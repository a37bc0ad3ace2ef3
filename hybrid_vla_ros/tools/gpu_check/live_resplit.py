"""Section 3, ``live_resplit``: K moved down then up while frames flow: memory returned to the driver (reserved and
driver-level used before / after the move), frames lost (published - computed - superseded) = 0, frames computed
at a K other than their slot header's = 0."""
from __future__ import annotations

from .common import NEEDS_CUDA
from .pair import Pair, pipeline_figures


def run(check) -> dict:
    """Start at K = L, move to L/4 at a third of the frames and back to L at two thirds: the moves (ms, bytes
    before / after), frames published / computed / superseded / lost, frames computed at a K other than their
    slot header's, and whether memory went back to the driver (status ``check`` unless both moves happened and
    no frame was lost or mismatched)."""
    from ...model.config import preset

    name = check.sizes.resplit_preset
    overrides = check.sizes.overrides.get(name, {})
    cfg = preset(name, **overrides)
    path = check.checkpoint(name, overrides)
    L = cfg.num_layers
    n = check.sizes.resplit_frames
    down, up = max(0, L // 4), L
    moves = {n // 3: down, (2 * n) // 3: up}
    pair = Pair(path, L, device=str(check.device), prefix_dtype=check.prefix_dtype, suffix_dtype=check.suffix_dtype,
                frames=n, camera_wh=check.sizes.camera_wh, prefix_cores=check.prefix_cores,
                suffix_cores=check.suffix_cores, moves=moves, max_s=max(30.0, check.left_s()))
    pre, suf = pair.results()
    fig = pipeline_figures(pre, suf, 0)
    moves_done = [r["resplit"] | {"frame": r["i"]} for r in pre["records"] if "resplit" in r]
    out = {"preset": name, "num_layers": L, "requested": {str(a): b for a, b in moves.items()},
           "moves": moves_done, "published": fig["published"], "computed": fig["computed"],
           "superseded": fig["superseded"], "overwritten": fig["overwritten"], "lost": fig["lost"],
           "mismatched_k": fig["mismatched_k"],
           "errors": fig["errors"], "ks_seen_by_suffix": sorted({r["k"] for r in suf["records"]})}
    down_moves = [m for m in moves_done if m["to"] < m["from"]]
    if check.cuda and down_moves:
        m = down_moves[0]
        out["returned_to_driver_bytes"] = m["returned"]
        out["reserved_drop_bytes"] = m["reserved_before"] - m["reserved_after"]
        out["memory_returned"] = m["returned"] > 0 and m["reserved_after"] < m["reserved_before"]
        out["reserved_drop_after_next_frame_bytes"] = reserved_drop_after_next_frame(pre["records"])
    else:
        out["memory_returned"] = NEEDS_CUDA if not check.cuda else "no move down happened"
        if down_moves:
            out["stage_bytes_freed"] = down_moves[0]["stage_before"] - down_moves[0]["stage_after"]
    out["status"] = "ok" if len(moves_done) == 2 and fig["lost"] == 0 and fig["mismatched_k"] == 0 else "check"
    return out



def reserved_drop_after_next_frame(records: list[dict]) -> int | None:
    """Reserved device memory given up by the first move of K down, counted once the frame after the move has run
    (bytes: reserved before the move minus the next frame's reserved figure). The figure right after the move also
    counts cached activations that the next frame takes back; this one does not. None without a move down or a
    frame after it, or without per-frame ``reserved`` figures (CPU)."""
    for j, r in enumerate(records):
        m = r.get("resplit")
        if m and m["to"] < m["from"]:
            nxt = next((q for q in records[j + 1:] if q.get("reserved") is not None), None)
            if nxt is None or m.get("reserved_before") is None:
                return None
            return int(m["reserved_before"] - nxt["reserved"])
    return None
