"""Logical vs physical KV bytes and head budgets at budget 64 on a 2K needle prompt.

.venv/bin/python lab/scripts/memory_per_head.py
"""

from __future__ import annotations

import kvbudget
from kvbudget.eval.tasks.needle import needle_sample


def main() -> None:
    model, tokenizer = kvbudget.load_model()
    sample = needle_sample(tokenizer, 2000, 0.3, "essays", 2)
    print("| method | entries | logical bytes | physical bytes | physical / logical | head budgets min–max "
          "| peak KV during prefill |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in ["snapkv", "ada-snapkv", "pyramidkv", "ada-pyramidkv"]:
        result = kvbudget.generate(
            model, tokenizer, sample.context, sample.question, sample.answer_prefix,
            method=name, budget=64, max_new_tokens=1,
        )  # fmt: skip
        stats, budgets = result.cache_stats_after, result.budgets
        print(
            f"| {name} | {int(stats.entries.sum()):,} | {stats.logical_bytes:,} | {stats.physical_bytes:,} "
            f"| {stats.physical_bytes / stats.logical_bytes:.3f} | {int(budgets.min())}–{int(budgets.max())} "
            f"| {stats.extra['peak_physical_bytes']:,} |"
        )
    full_bytes = result.cache_stats_before.logical_bytes
    print(f"prompt {result.prompt_tokens} tokens; full cache {full_bytes:,} bytes")


if __name__ == "__main__":
    main()
