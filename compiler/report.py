"""The short human report every Compile / Warmup run returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    backend_requested: str = "auto"
    backend: str = "eager"
    why: list = field(default_factory=list)
    family: str = ""
    precision: str = "auto"
    dynamic_shapes: bool = True
    regions: dict = field(default_factory=dict)       # kind -> count
    skipped: list = field(default_factory=list)       # (kind, count, reason)
    notes: list = field(default_factory=list)
    warmup: list = field(default_factory=list)        # (shape label, seconds, graphs compiled)
    from_cache: dict = field(default_factory=dict)    # shape label -> graphs of those taken from the compile cache
    max_abs_diff: float | None = None
    diff_label: str = ""

    def text(self, stats=None) -> str:
        lines = [f"UNet Compiler: backend {self.backend}"
                 + (f" (asked {self.backend_requested})" if self.backend_requested != self.backend else "")
                 + f", {self.family} UNet, precision {self.precision}, dynamic shapes {'on' if self.dynamic_shapes else 'off'}"]
        lines += [f"  backend choice: {w}" for w in self.why]
        if self.regions:
            lines.append("  accelerated regions: " + ", ".join(f"{k} x{n}" for k, n in self.regions.items()))
        else:
            lines.append("  accelerated regions: none (everything runs eager)")
        lines += [f"  left eager: {k} x{n}: {why}" for k, n, why in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        for label, secs, graphs in self.warmup:
            cached = self.from_cache.get(label, 0)
            how = (", all from the compile cache" if cached and cached >= graphs else
                   f", {cached} of them from the compile cache" if cached else "")
            lines.append(f"  warmed {label}: {secs:.1f} s, {graphs} graph(s) compiled{how}")
        if self.max_abs_diff is not None:
            lines.append(f"  max |compiled - eager| {self.diff_label}: {self.max_abs_diff:.3g}")
        if stats is not None:
            lines.append(
                f"  calls: {stats.get('calls', 0)} accelerated, {stats.get('eager_calls', 0)} eager; "
                f"graphs compiled: {stats.get('graphs_compiled', 0)}"
                + (f" ({stats['graphs_from_cache']} from the compile cache)" if stats.get("graphs_from_cache") else "")
                + "; recompiles after warmup: "
                f"{stats.get('recompiles_after_warmup', 0)}; region calls run eager for patches/lowvram: "
                f"{stats.get('region_eager', 0)}")
            if stats.get("compile_seconds"):
                lines.append(f"  seconds in calls that compiled: {stats['compile_seconds']:.1f}")
        return "\n".join(lines)
