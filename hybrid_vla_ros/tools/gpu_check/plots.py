"""The check's PNGs under ``--out`` (matplotlib, where installed; else a note in the report): plan vs measured
memory per K (section 1) and end-to-end latency per K (section 2)."""
from __future__ import annotations

from .common import GB


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _no_plot(check, what: str) -> None:
    """Note (once) in ``check.notes`` that section ``what`` has no PNG."""
    note = f"{what}: no PNG (matplotlib is not installed here); the figures are in gpu_check.json / .md"
    if note not in check.notes:
        check.notes.append(note)


def _save(check, plt, fig, ax, ylabel: str, filename: str) -> None:
    """Label and write ``fig`` as ``check.out / filename``; its name goes into ``check.plots``."""
    ax.set_xlabel("split layer K")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = check.out / filename
    fig.savefig(path, dpi=90)
    plt.close(fig)
    check.plots.append(path.name)


def plot_memory(check, out: dict) -> None:
    """``memory_plan.png``: per preset of section 1's ``out``, the plan total and the measured bytes (driver-level
    total on CUDA, the weights' bytes on the CPU) per K, GB."""
    plt = _pyplot()
    if plt is None:
        _no_plot(check, "memory_plan")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in out["presets"].items():
        rows = data.get("rows") or []
        ks = [r["k"] for r in rows]
        ax.plot(ks, [r["plan_total"] / GB for r in rows], "--", label=f"{name} plan")
        key = "driver_total" if check.cuda else "weight_bytes"
        ax.plot(ks, [(r.get(key) or 0) / GB for r in rows], "o-", label=f"{name} measured ({key})")
    _save(check, plt, fig, ax, "GB", "memory_plan.png")


def plot_paper(check, out: dict) -> None:
    """``paper_table.png``: per preset of section 2's ``out``, the end-to-end p50 (ms) per K."""
    plt = _pyplot()
    if plt is None:
        _no_plot(check, "paper_table")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in out["presets"].items():
        rows = [r for r in data.get("rows", []) if "e2e_ms" in r]
        ax.plot([r["k"] for r in rows], [r["e2e_ms"].get("p50", float("nan")) for r in rows], "o-", label=name)
    _save(check, plt, fig, ax, "end-to-end p50, ms", "paper_table.png")
