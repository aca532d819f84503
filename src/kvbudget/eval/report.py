"""``kvbudget report DIR``: markdown tables and plots from ``DIR/results.jsonl``.

Writes ``DIR/report.md`` with, per task, a methods × budgets table of the task score (×100),
retention (score on the samples the full cache solves, i.e. full-cache score ≥ 0.5) and fidelity
(greedy agreement with the full cache, KL(full ‖ method)); and PNGs: score vs budget per task,
needle heatmaps (length × depth) per method and budget, and per-layer/per-head budget maps; for
prune-stage methods, the distribution of the selection layer per task (table and histogram).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from kvbudget.errors import KVBudgetError
from kvbudget.eval.store import load_rows

SOLVED = 0.5


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def _fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(k) for k in keys)].append(row)
    return groups


def _budget_label(budget: Any) -> str:
    return "all" if budget is None else str(budget)


def perplexity_table(rows: list[dict]) -> list[str]:
    """Markdown lines: methods × budgets of mean perplexity (lower is better)."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    lines = ["| method | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for (label,), mine in _group(rows, "label").items():
        cells = [
            _fmt(_mean([r["score"] for r in mine if r["budget"] in (b, None)]), 1, 2) if mine else "–"
            for b in budgets
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def task_table(rows: list[dict]) -> list[str]:
    """Markdown lines: methods × budgets of mean score, with retention and fidelity columns."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [
        "| method | " + " | ".join(f"B={b}" for b in budgets) + " | retention | agreement | KL |",
        "|---|" + "---|" * (len(budgets) + 3),
    ]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        if all(r["budget"] is None for r in mine):  # full cache: one number
            cells = [_fmt(_mean([r["score"] for r in mine]))] * len(budgets) or ["–"]
        else:
            cells = []
            for budget in budgets:
                scores = [r["score"] for r in mine if r["budget"] == budget]
                cells.append(f"{_fmt(_mean(scores))} ({len(scores)})" if scores else "–")
        solved = [r["score"] for r in mine if (r.get("full_score") or 0) >= SOLVED]
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {_fmt(_mean(solved))} "
            f"| {_fmt(_mean([r.get('agreement') for r in mine]))} "
            f"| {_fmt(_mean([r.get('kl') for r in mine]), 1, 3)} |"
        )
    return lines


def plot_score_vs_budget(rows: list[dict], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, mine in _group(rows, "label").items():
        mine_budgets = sorted({r["budget"] for r in mine if r["budget"] is not None})
        if not mine_budgets:
            ax.axhline(100 * _mean([r["score"] for r in mine]), color="black", linestyle="--", label=label[0])
            continue
        ys = [100 * _mean([r["score"] for r in mine if r["budget"] == b]) for b in mine_budgets]
        ax.plot(mine_budgets, ys, marker="o", label=label[0])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (entries per KV head)")
    ax.set_ylabel("score")
    ax.set_ylim(-5, 105)
    ax.set_title(task)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_needle_heatmaps(rows: list[dict], path: Path) -> bool:
    """One panel per (method, budget): score by context length (x) and needle depth (y)."""
    rows = [r for r in rows if "depth" in r.get("meta", {})]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = list(_group(rows, "label", "budget").items())
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["meta"]["depth"] for r in rows})
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.4 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, ((label, budget), mine) in zip(axes.flat, panels, strict=False):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scores = [r["score"] for r in mine if r["length"] == length and r["meta"]["depth"] == depth]
                if scores and None not in scores:
                    grid[i, j] = 100 * mean(scores)
        ax.axis("on")
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(f"{label} B={_budget_label(budget)}", fontsize=8)
    fig.supxlabel("context length (tokens)", fontsize=8)
    fig.supylabel("needle depth", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_budget_maps(rows: list[dict], path: Path) -> bool:
    """Mean kept entries per (layer, KV head), one panel per method at its smallest budget."""
    rows = [r for r in rows if r.get("budgets") and r["budget"] is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = []
    for label, mine in _group(rows, "label").items():
        smallest = min(r["budget"] for r in mine)
        maps = np.array([r["budgets"] for r in mine if r["budget"] == smallest], dtype=float)
        panels.append((label[0], smallest, maps.mean(0)))
    fig, axes = plt.subplots(1, len(panels), figsize=(1.9 * len(panels) + 1, 4), squeeze=False)
    for ax, (label, budget, grid) in zip(axes[0], panels, strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_title(f"{label}\nB={budget}", fontsize=8)
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _is_prune_method(name: str) -> bool:
    from kvbudget.methods.presets import split_preset
    from kvbudget.methods.registry import REGISTRY

    base = split_preset(name.partition(":")[0])[0]
    return base in REGISTRY and "prune" in REGISTRY[base].stages


def selection_layer_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per prune-stage method, budget and task, how often each layer was the
    selection layer (``-`` = nothing pruned), from the rows' ``selection_layer``."""
    rows = [r for r in rows if _is_prune_method(r["method"]) and r["budget"] is not None]
    if not rows:
        return []
    lines = ["| method | budget | task | selection layer: samples | mean layer |", "|---|---|---|---|---|"]
    for (label, budget, task), mine in sorted(_group(rows, "label", "budget", "task").items()):
        counts: dict[Any, int] = defaultdict(int)
        for r in mine:
            counts[r["selection_layer"]] += 1
        keys = sorted(k for k in counts if k is not None) + ([None] if None in counts else [])
        cells = ", ".join(f"{'-' if k is None else k}: {counts[k]}" for k in keys)
        layers = [r["selection_layer"] for r in mine if r["selection_layer"] is not None]
        lines.append(f"| {label} | {budget} | {task} | {cells} | {_fmt(_mean(layers), 1, 1)} |")
    return lines


def plot_selection_layers(rows: list[dict], path: Path) -> bool:
    """Histogram of selection layers per task, one panel per prune-stage method (smallest budget)."""
    rows = [r for r in rows if r.get("selection_layer") is not None and r["budget"] is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["label"] for r in rows})
    tasks = sorted({r["task"] for r in rows})
    top = max(r["selection_layer"] for r in rows)
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels) + 0.5, 3), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [r for r in rows if r["label"] == label]
        smallest = min(r["budget"] for r in mine)
        at_budget = [r for r in mine if r["budget"] == smallest]
        data = [[r["selection_layer"] for r in at_budget if r["task"] == t] for t in tasks]
        ax.hist(data, bins=range(0, top + 2), label=tasks, align="left")
        ax.set_title(f"{label} B={smallest}", fontsize=8)
        ax.set_xlabel("selection layer", fontsize=7)
        ax.set_ylabel("samples", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path) -> Path:
    """Write ``out/report.md`` and its PNGs; returns the report's path."""
    out = Path(out)
    rows = load_rows(out / "results.jsonl")
    if not rows:
        raise KVBudgetError(f"no results in {out / 'results.jsonl'}: run `kvbudget eval --out {out}` first")
    ok = [r for r in rows if r.get("error") is None]
    errors = [r for r in rows if r.get("error") is not None]
    models = sorted({r["model"] for r in rows})
    lines = [
        f"# kvbudget evaluation report — {out}",
        "",
        f"Model(s): {', '.join(models)}. {len(ok)} runs, {len(errors)} errors. Scores ×100 "
        "(cell: mean score (samples)); retention = score on samples the full cache solves; agreement = "
        "greedy tokens equal to the full cache's answer (×100); KL = mean KL(full ‖ method) per answer "
        "token under teacher forcing.",
        "",
    ]
    for (task,), task_rows in _group(ok, "task").items():
        if task_rows[0]["metric"] == "perplexity":
            lines += [f"## {task} (perplexity, lower is better)", "", *perplexity_table(task_rows), ""]
            continue
        lines += [f"## {task}", "", *task_table(task_rows), ""]
        png = out / f"score_vs_budget_{task}.png"
        plot_score_vs_budget(task_rows, task, png)
        lines += [f"![score vs budget, {task}]({png.name})", ""]
    if plot_needle_heatmaps([r for r in ok if r["family"] == "needle"], out / "needle_heatmaps.png"):
        lines += ["## Needle heatmaps", "", "![needle heatmaps](needle_heatmaps.png)", ""]
    if plot_budget_maps(ok, out / "budget_maps.png"):
        lines += ["## Budgets per layer and head", "", "![budget maps](budget_maps.png)", ""]
    selection = selection_layer_table(ok)
    if selection:
        lines += ["## Selection layers (prune-stage methods)", "", *selection, ""]
        if plot_selection_layers(ok, out / "selection_layers.png"):
            lines += ["![selection layers](selection_layers.png)", ""]
    timing = _group([r for r in ok if r["metric"] != "perplexity"], "label")
    lines += [
        "## Speed and memory",
        "",
        "| method | TTFT s | compress s | TPOT ms | KV logical MiB | KV physical MiB |",
        "|---|---|---|---|---|---|",
    ]
    for (label,), mine in timing.items():
        lines.append(
            f"| {label} | {_fmt(_mean([r['ttft_s'] for r in mine]), 1, 2)} "
            f"| {_fmt(_mean([r['compress_s'] for r in mine]), 1, 3)} "
            f"| {_fmt(_mean([r.get('tpot_s') for r in mine]), 1000, 0)} "
            f"| {_fmt(_mean([r['logical_bytes'] for r in mine]), 1 / 2**20, 1)} "
            f"| {_fmt(_mean([r['physical_bytes'] for r in mine]), 1 / 2**20, 1)} |"
        )
    if errors:
        lines += ["", "## Errors", ""]
        lines += [
            f"- {r['task']} #{r['sample']} {r['label']} B={_budget_label(r['budget'])}: {r['error']}"
            for r in errors
        ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report
