"""``DIR/throughput.md`` and ``DIR/throughput.png`` from a :func:`kvbudget.bench.throughput.run_throughput`
result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MIB:.1f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(v, fmt)


def _cells(r: dict[str, Any]) -> list[str]:
    """One table row's cells (the columns of :func:`markdown`)."""
    head = [r["method"], str(r["budget"] or "–"), str(r["prompt_tokens"]), _mib(r["bytes_per_row"])]
    if not r["fits"]:
        return head + ["0 (one row exceeds the cap)"] + ["–"] * 9 + [_num(r["batch1_decode_tok_s"])]
    measured_next = r.get("next_batch_bytes")
    nxt = _mib(r["predicted_next_bytes"]) if measured_next is None else f"{_mib(measured_next)} (measured)"
    batch = f"{r['batch']}" + (" (max)" if r["limited_by"] == "max_batch" else "")
    return head + [
        batch, _x(r.get("batch_vs_full")), _mib(r["memory_bytes"]), nxt,
        _num(r["decode_tok_s"]), _x(r.get("decode_tok_s_vs_full")),
        _num(r["total_tok_s"]), _x(r.get("total_tok_s_vs_full")),
        str(r["batch_if_cap_on_run"]), str(r["batch_if_cap_on_decode"]), _num(r["batch1_decode_tok_s"]),
    ]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """The report: the setting, one table row per (method, length, budget), and how to read it."""
    cfg, mem, info = result["config"], result["memory"], result["machine"]
    device = info.get("gpu") or f"{info['cpu']}, {info['threads']} threads"
    lines = [
        "# Throughput under a memory cap",
        "",
        f"Model `{result.get('model', cfg['model'])}` ({cfg['dtype']}) on {info['device']} ({device}); "
        f"weights {_mib(result['weight_bytes'])} MiB. Every batch row holds the same `{cfg['task']}` prompt "
        f"and decodes {cfg['new_tokens']} tokens (no EOS stop).",
        "",
        f"**Memory** ({mem['kind']}): {mem['description']}. **Cap**: {_mib(mem['cap_bytes'])} MiB on the "
        + (
            "peak of the whole run (the batch is prefilled at once, then decoded)."
            if mem["cap_on"] == "run"
            else "decoding's peak only (the prefill's is not counted)."
        ),
        "",
        "| method | budget | prompt | MiB/row | batch | × full | MiB at batch | next batch MiB | "
        "decode tok/s | × full | end-to-end tok/s | × full | batch, cap on run | batch, cap on decode "
        "| decode tok/s at batch 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append("| " + " | ".join(_cells(r)) + " |")
    lines += [
        "",
        "MiB/row: the slope of memory against batch over the measured runs. batch: the largest measured "
        "batch under the cap; next batch MiB: that of one row more, from the line through the measured "
        "runs (or measured). decode tok/s: generated tokens per second over the batch after the first "
        "token; end-to-end adds the prefill. The two `batch, cap on` columns are what the line through the "
        "same runs allows when the cap counts the whole run or only the decoding (computed, not run).",
        "",
        "Measured runs (batch: run peak MiB / decode peak MiB / decode tok/s):",
        "",
    ]
    for r in result["rows"]:
        runs = "; ".join(
            f"{x['batch']}: out of device memory"
            if x.get("out_of_memory")
            else f"{x['batch']}: {_mib(x['run_peak_bytes'])} / {_mib(x['decode_peak_bytes'])} / "
            f"{x['decode_tok_s']:.1f}"
            for x in r["runs"]
        )
        lines.append(f"- {r['method']} @{r['budget'] or '–'}, {r['prompt_tokens']} tokens — {runs}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Decode tokens per second against batch, one line per method; the batch at the cap ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["rows"]:
        label = r["method"] if r["budget"] is None else f"{r['method']} @{r['budget']}"
        if len(result["config"]["lengths"]) > 1:
            label += f", {r['length']} tokens"
        done = [x for x in r["runs"] if not x.get("out_of_memory")]
        xs, ys = [x["batch"] for x in done], [x["decode_tok_s"] for x in done]
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        if r["fits"]:
            ax.scatter(
                [r["batch"]], [r["decode_tok_s"]], s=160, facecolors="none", edgecolors=line.get_color()
            )
    cap = result["memory"]["cap_bytes"] / MIB
    ax.set_xlabel("batch (rows decoded together)")
    ax.set_ylabel("decode tokens / s (all rows)")
    cap_on = result["memory"]["cap_on"]
    ax.set_title(f"{result.get('model', '')}: ringed = largest batch under {cap:.0f} MiB ({cap_on})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_throughput_report(result: dict[str, Any], out: Path) -> None:
    out = Path(out)
    (out / "throughput.md").write_text(markdown(result))
    plot(result, out / "throughput.png")
