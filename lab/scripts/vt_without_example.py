"""vt with the full cache, on the leaderboard's 20 samples, with and without RULER's worked example.

    .venv/bin/python lab/scripts/vt_without_example.py [OUT]   # default lab/results/vt-without-example.jsonl

The vt prompt opens with a solved example (three-letter names, answered with spaces between them),
then the instruction again and the real text. The second variant drops the example and keeps
the rest. Each row records the sample, the variant, the answer and its ``string_match_all`` score.
The first variant must equal the committed full-cache rows: the script checks this and stops if not.
docs/leaderboard-analysis.md uses it to explain why evicting methods beat the full cache on vt (about 6
minutes on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kvbudget
from kvbudget.eval.metrics import string_match_all
from kvbudget.eval.store import load_rows
from kvbudget.eval.tasks import get_task
from kvbudget.eval.tasks.ruler_vt import INSTRUCTION
from kvbudget.models import load_model

LEADERBOARD = Path("lab/results/leaderboard")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path("lab/results/vt-without-example.jsonl")
    config = json.loads((LEADERBOARD / "config.json").read_text())
    committed = {
        r["sample"]: r
        for r in load_rows(LEADERBOARD / "results.jsonl")
        if r["task"] == "vt" and r["method"] == "full"
    }
    model, tokenizer = load_model(config["model"], dtype=config["dtype"])
    samples = get_task("vt").make_samples(tokenizer, 2048, config["limit"], config["seed"])
    marker = f"\n\n{INSTRUCTION}\n\n"  # between the worked example and the real text
    rows = []
    for index, sample in enumerate(samples):
        bare = INSTRUCTION + "\n\n" + sample.context.split(marker, 1)[1]
        for variant, context in (("as-is", sample.context), ("no-example", bare)):
            answer = kvbudget.generate(
                model, tokenizer, context, sample.question, sample.answer_prefix, method="full",
                max_new_tokens=sample.max_new_tokens,
            ).text  # fmt: skip
            rows.append({"sample": index, "variant": variant, "prediction": answer,
                         "score": string_match_all(answer, sample.answers)})  # fmt: skip
        if rows[-2]["prediction"] != committed[index]["prediction"]:
            print(f"error: sample {index} differs from the committed full-cache row", file=sys.stderr)
            return 1
        print(index, rows[-2]["score"], rows[-1]["score"], rows[-1]["prediction"], flush=True)
    for variant in ("as-is", "no-example"):
        run = [r for r in rows if r["variant"] == variant]
        print(f"{variant}: mean {100 * sum(r['score'] for r in run) / len(run):.1f}, "
              f"answers with commas {sum(',' in r['prediction'] for r in run)} of {len(run)}")  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
