"""Roofline pictures: attainable FLOP/s against arithmetic intensity, with a workload's phases on it.

A point under the sloped roof is bandwidth-bound, under the flat one compute-bound; its distance below
the roof is what the kernels (or the overhead between them) lose. Labels carry the numbers, so the PNG
reads without the terminal.
"""

from __future__ import annotations

from dataclasses import dataclass

from ridge.plan.specs import HardwareSpec


@dataclass(frozen=True)
class RooflinePoint:
    label: str
    intensity: float  # FLOPs per byte
    flops_per_second: float  # achieved, or the bound's
    measured: bool = False


def plot_roofline(hw: HardwareSpec, dtype: str, path: str, points: list[RooflinePoint] = (),
                  curve: list[RooflinePoint] = (), curve_label: str = "", title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    peak, bandwidth = hw.flops(dtype), hw.bandwidth_gb_s * 1e9
    ridge = peak / bandwidth
    intensities = [p.intensity for p in (*points, *curve)] + [ridge]
    low, high = min(min(intensities) / 4, 0.1), max(max(intensities) * 4, ridge * 30)
    x = np.logspace(np.log10(low), np.log10(high), 400)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(x, np.minimum(peak, bandwidth * x), color="black", lw=2,
              label=f"roof: {hw.bandwidth_gb_s:,.0f} GB/s x intensity, capped at {peak / 1e12:,.3g} TFLOP/s ({dtype})")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge point {ridge:,.0f} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(6, -14),
                fontsize=8, color="gray")
    if curve:
        ax.plot([p.intensity for p in curve], [p.flops_per_second for p in curve], "o-", color="tab:blue", ms=4,
                label=curve_label or "decode by batch size")
        for p in curve:
            ax.annotate(p.label, (p.intensity, p.flops_per_second), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color="tab:blue")
    for i, p in enumerate(points):
        marker = "*" if p.measured else "s"
        ax.plot(p.intensity, p.flops_per_second, marker, ms=11 if p.measured else 8, color=f"C{i + 1}",
                label=p.label)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"roofline: {hw.name}")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
