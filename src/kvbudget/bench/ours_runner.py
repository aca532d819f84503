"""kvbudget's side of ``bench peer``, in its own process like kvpress's runner.

    python -m kvbudget.bench.ours_runner --model M --samples S.jsonl --jobs J.json [--warmup]

The mirror of :mod:`kvbudget.peer.kvpress_runner`'s ``--serve``: it loads the model, reads the
exported samples and the jobs (each names one of :data:`kvbudget.bench.peer.PEERS`, a budget and
``question_aware``), optionally warms up on one short untimed run of the first job, prints
``READY`` and answers ``{"sample": i, "job": j}`` stdin lines with ``ROW <json>`` lines, one
:func:`kvbudget.bench.peer.run_ours` row each, through the kvpress runner's serve loop.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model name or directory (as load_model takes)")
    parser.add_argument("--samples", required=True)
    parser.add_argument("--jobs", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--warmup", action="store_true", help="run the first job once untimed first")
    args = parser.parse_args(argv)

    from kvbudget.bench.peer import run_ours
    from kvbudget.models import load_model
    from kvbudget.peer.kvpress_runner import serve

    model, _ = load_model(args.model, dtype=args.dtype)
    with open(args.samples) as fh:
        samples = [json.loads(line) for line in fh if line.strip()]
    with open(args.jobs) as fh:
        jobs = json.load(fh)

    def run(sample: dict, job: dict) -> dict:
        return run_ours(model, sample, job["method"], job["budget"], bool(job.get("question_aware")))

    if args.warmup and samples and jobs:
        run({**samples[0], "max_new_tokens": 2}, jobs[0])
    return serve(run, samples, jobs)


if __name__ == "__main__":
    sys.exit(main())
