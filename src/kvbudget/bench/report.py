"""``DIR/bench.md`` and plots from a :func:`kvbudget.bench.grid.run_bench` result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20


def _label(row: dict[str, Any]) -> str:
    label = row["method"] if row["budget"] is None else f"{row['method']} @{row['budget']}"
    batch = row.get("batch", 1)
    return label if batch == 1 else f"{label} ×{batch}"


def _row(
    rows: list[dict[str, Any]], method: str, length: int, budget: int | None, batch: int = 1
) -> dict[str, Any] | None:
    for r in rows:
        if (r["method"] == method and r["length"] == length and (budget is None or r["budget"] == budget)
                and r.get("batch", 1) == batch):  # fmt: skip
            return r
    return None


def _at(rows: list[dict[str, Any]], wanted: int) -> int | None:
    """``wanted`` if measured, else the largest measured length (None when nothing was measured)."""
    lengths = sorted({r["length"] for r in rows})
    if not lengths:
        return None
    return wanted if wanted in lengths else lengths[-1]


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The issue's targets as ``(target, measured, verdict)``; at the nearest measured length."""
    out: list[tuple[str, str, str]] = []
    at4 = _at(rows, 4096)
    for method in ("snapkv", "ada-snapkv", "lava"):
        for r in (r for r in rows if r["method"] == method and r["length"] == at4):
            share = r["compress_overhead"]
            out.append((
                f"compression ≤ 3% of prefill: {_label(r)}, {r['length']} tokens",
                f"{100 * share:.1f}%", "met" if share <= 0.03 else "missed",
            ))  # fmt: skip
    at8 = _at(rows, 8192)
    for batch in sorted({r.get("batch", 1) for r in rows}):
        full = _row(rows, "full", at8, None, batch) if at8 is not None else None
        if not full:
            continue
        same = [r for r in rows if r.get("batch", 1) == batch]
        budget = 256 if any(r["budget"] == 256 for r in same) else max(r["budget"] or 0 for r in same)
        suffix = "" if batch == 1 else f", batch {batch}"
        for r in (r for r in same if r["length"] == at8 and r["budget"] == budget):
            ratio = r["tpot_s"] / full["tpot_s"]
            bound = ""
            if "tpot_bound_s" in r:
                bound = f" (bandwidth bound {r['tpot_bound_s'] / full['tpot_bound_s']:.2f})"
            out.append((
                f"TPOT ≤ 0.6 × full: {r['method']} @{budget}, {at8} tokens{suffix}",
                f"{ratio:.2f}{bound}", "met" if ratio <= 0.6 else "missed",
            ))  # fmt: skip
        for r in (r for r in same if r["method"] == "lava" and r["length"] == at8):
            ratio = r["peak_rss_bytes"] / full["peak_rss_bytes"]
            kv = r["kv_peak_bytes"] / full["kv_peak_bytes"]
            out.append((
                f"peak memory below full: {_label(r)}, {at8} tokens",
                f"RSS {ratio:.3f} × full (KV peak {kv:.3f} ×)", "met" if ratio < 1 else "missed",
            ))  # fmt: skip
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = sorted(result["rows"], key=lambda r: (r["length"], r["method"], r["budget"] or 0))
    bw = (result["machine"] or {}).get("bandwidth")
    cfg = result["config"]
    lines = [
        "# kvbudget benchmark",
        "",
        f"Model `{cfg['model']}` ({cfg['dtype']}), batch {cfg.get('batch', 1)} (TPOT per step of every row), "
        f"{cfg['new_tokens']} new tokens, {cfg['repeats']} repeats "
        f"(each a fresh process); torch threads: {cfg['threads'] or 'inherited'}. Medians, spread = min–max.",
    ]
    if bw:
        lines.append(
            f"Memory bandwidth ({bw['threads']} threads, {bw['size_bytes'] / MIB:.0f} MiB tensor): copy "
            f"{bw['copy'] / 1e9:.1f} GB/s (read + write), read-only sum {bw['read'] / 1e9:.1f} GB/s."
        )
    gpu = any("gpu_peak_bytes" in r for r in rows)  # a GPU run: the allocator's peak is the memory
    # a CUDA graph's warm-up and capture are one-off: the steady TPOT leaves them out
    setup = any(r.get("static_setup_s") for r in rows)
    lines += [
        "",
        "| method | length | prompt | TTFT s | compress s (% prefill) | TPOT ms (min–max) | "
        + ("steady TPOT ms | graph setup s | " if setup else "")
        + "bound ms | "
        + ("peak GPU MiB | " if gpu else "")
        + "peak RSS MiB | KV peak MiB | KV logical / physical MiB |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + ("---|---|" if setup else ""),
    ]
    for r in rows:
        lo, hi = r["tpot_s_spread"]
        bound = f"{1000 * r['tpot_bound_s']:.1f}" if "tpot_bound_s" in r else "-"
        gpu_peak = (f"{r['gpu_peak_bytes'] / MIB:.0f} | " if "gpu_peak_bytes" in r else "- | ") if gpu else ""
        steady = r.get("tpot_steady_s", r["tpot_s"])
        steady_cols = f"{1000 * steady:.1f} | {r.get('static_setup_s', 0.0):.2f} | " if setup else ""
        lines.append(
            f"| {_label(r)} | {r['length']} | {r['prompt_tokens']} | {r['ttft_s']:.2f} | "
            f"{r['compress_s']:.3f} ({100 * (r['compress_overhead'] or 0):.1f}%) | "
            f"{1000 * r['tpot_s']:.1f} ({1000 * lo:.1f}–{1000 * hi:.1f}) | {steady_cols}{bound} | {gpu_peak}"
            f"{r['peak_rss_bytes'] / MIB:.0f} | {r['kv_peak_bytes'] / MIB:.1f} | "
            f"{r['logical_bytes'] / MIB:.1f} / {r['physical_bytes'] / MIB:.1f} |"
        )
    checks = targets(rows)
    if checks:
        lines += ["", "## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {v} |" for t, m, v in checks]
    if result.get("errors"):
        lines += ["", f"{len(result['errors'])} run(s) failed; see bench.json `errors`."]
    return "\n".join(lines) + "\n"


def bound_lines(series: dict[str, list[dict[str, Any]]]) -> list[tuple[str, list[int], list[float]]]:
    """The TPOT plot's bound lines: ``(label, lengths, bound ms)`` of every full-cache series (one per
    batch size) whose rows have a bandwidth bound."""
    return [
        (f"{label}: bandwidth bound", [r["length"] for r in rows], [1000 * r["tpot_bound_s"] for r in rows])
        for label, rows in series.items()
        if rows[0]["method"] == "full" and "tpot_bound_s" in rows[0]
    ]


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """``time_vs_length.png`` (TTFT, TPOT, compression) and ``memory_vs_length.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(_label(r), []).append(r)
    for s in series.values():
        s.sort(key=lambda r: r["length"])
    paths = []
    panels = [
        ("time_vs_length.png", [("ttft_s", "TTFT (s)", 1), ("tpot_s", "TPOT (ms)", 1000),
                                ("compress_s", "compression (s)", 1)]),
        ("memory_vs_length.png", [("peak_rss_bytes", "peak process RSS (MiB)", 1 / MIB),
                                  ("kv_peak_bytes", "KV peak during prefill (MiB)", 1 / MIB),
                                  ("decode_kv_bytes", "KV while decoding (MiB)", 1 / MIB)]),
    ]  # fmt: skip
    for name, figs in panels:
        fig, axes = plt.subplots(1, len(figs), figsize=(5 * len(figs), 4))
        for ax, (key, title, scale) in zip(axes, figs, strict=True):
            for label, s in series.items():
                xs = [r["length"] for r in s]
                ys = [r[key] * scale for r in s]
                lo = [(r[key] - r[key + "_spread"][0]) * scale for r in s]
                hi = [(r[key + "_spread"][1] - r[key]) * scale for r in s]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
            for label, xs, ys in bound_lines(series) if key == "tpot_s" else []:
                ax.plot(xs, ys, "k--x", label=label)  # a cross: visible for one length too
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_bench_report(result: dict[str, Any], out: Path) -> Path:
    out = Path(out)
    path = out / "bench.md"
    path.write_text(markdown(result))
    if result["rows"]:
        plot(result, out)
    return path
