"""Recompute a results folder's row keys with this checkout: a refactor must not change any.

For every sample of ``--task`` and every (method, budget or ratio) run of the folder's
``config.json``, the key, label and options this checkout's runner computes must equal the stored
row's. Needs the config's model fetched (only its tokenizer is loaded; no model runs).

    PYTHONPATH=src .venv/bin/python lab/scripts/check_row_keys.py lab/results/leaderboard --task needle

Exit code 0 when every stored row matches (and at least one was checked), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.store import load_rows
from kvbudget.models import model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--task", default="needle")
    args = parser.parse_args()
    config = json.loads((args.folder / "config.json").read_text())
    rows = {
        (r["sample"], r["method"], r["label"], r["budget"] if r["compression_ratio"] is None else None,
         r["compression_ratio"]): r
        for r in load_rows(args.folder / "results.jsonl") if r["task"] == args.task
    }  # fmt: skip
    runner = Runner(EvalConfig(**{**config, "tasks": [args.task]}), out=None, load=False, progress=False)
    directory = model_dir(runner.config.model)
    hf = directory / "hf" if (directory / "hf").is_dir() else directory  # GGUF models: the converted folder
    runner.tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    checked, wrong, missing = 0, 0, 0
    for task, _, index, sample in runner.samples():
        for spec, budget, ratio in runner.runs():
            row = rows.get((index, spec.name, spec.label, budget, ratio))
            if row is None:
                missing += 1
                continue
            checked += 1
            key = runner.key(task, sample, spec, budget, ratio)
            if key != row["key"] or row["options"] != dict(spec.options):
                wrong += 1
                where = f"sample {index} {spec.label} budget {budget} ratio {ratio}"
                print(f"differs: {where}: {key} != {row['key']}")
    print(f"{args.task}: {checked} stored rows checked, {wrong} differ, {missing} runs not stored")
    return 0 if checked and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
