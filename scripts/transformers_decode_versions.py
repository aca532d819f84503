"""Prefill and decode of plain transformers in two environments, run by run: is the peer gap theirs?

    OMP_NUM_THREADS=2 python scripts/transformers_decode_versions.py --length 2048 --budget 256

`kvbudget bench peer` decodes our side with transformers 5.23 (.venv) and kvpress's with 5.2
(.venv-peer), in different processes. This script takes kvbudget and kvpress out of it: it starts
one worker per environment (this file run with ``--worker`` by each venv's python; the workers
import only torch and transformers), each loads the same model from disk (float32, sdpa), and the
driver asks them in turn — the side that goes first alternating — to prefill the same token ids
into a ``DynamicCache``, keep its first ``--budget`` entries per layer (``--budget 0``: all), and
time ``--steps`` greedy single-token forwards (``logits_to_keep=1``). It prints each side's
median, min and max ms per step (and prefill seconds) over ``--rounds`` rounds, and the ratios.

The two workers may also run the same Python with different environments, e.g. PyTorch's
transparent-huge-page allocation on one side only::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/transformers_decode_versions.py \
        --peer .venv/bin/python --ours-env THP_MEM_ALLOC_ENABLE=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/kvbudget/models/smollm2-135m/hf"
ROOT = Path(__file__).resolve().parent.parent


def worker(model_dir: str, length: int) -> None:
    """Serve ``{"budget": b, "steps": s}`` lines on stdin with ``{"prefill_s": s, "ms": ms_per_step}``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def run(budget: int, steps: int) -> tuple[float, float]:
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        if budget:  # keep the first ``budget`` entries of every layer (kvpress leaves this shape)
            whole, cache = cache, DynamicCache(config=model.config)
            for index, layer in enumerate(whole.layers):
                cache.update(layer.keys[:, :, :budget].clone(), layer.values[:, :, :budget].clone(), index)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for i in range(steps):
            position = torch.tensor([[length + i]])
            out = model(
                input_ids=token,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return prefill_s, 1000 * (time.perf_counter() - start) / steps

    run(0, 2)  # warm-up
    print(json.dumps({"ready": transformers.__version__, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prefill_s, ms = run(request["budget"], request["steps"])
        print(json.dumps({"prefill_s": prefill_s, "ms": ms}), flush=True)


def _start(python: Path, extra_env: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    if not python.exists():
        raise SystemExit(f"no python at {python}: build the environment first (make install / make peer)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for item in extra_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--ours-env / --peer-env take KEY=VALUE, got {item!r}")
        env[key] = value
    command = [
        str(python),
        __file__,
        "--worker",
        "--model-dir",
        str(args.model_dir),
        "--length",
        str(args.length),
    ]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    ready = json.loads(process.stdout.readline())
    return process, f"transformers {ready['ready']}, torch {ready['torch']}"


def _ask(process: subprocess.Popen[str], budget: int, steps: int) -> tuple[float, float]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps({"budget": budget, "steps": steps}) + "\n")
    process.stdin.flush()
    reply = json.loads(process.stdout.readline())
    return float(reply["prefill_s"]), float(reply["ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument(
        "--budget", type=int, default=256, help="entries kept per layer; 0 keeps the cache whole"
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ours", type=Path, default=ROOT / ".venv/bin/python")
    parser.add_argument("--peer", type=Path, default=ROOT / ".venv-peer/bin/python")
    parser.add_argument(
        "--ours-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the first worker (repeatable)",
    )
    parser.add_argument(
        "--peer-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the second worker (repeatable)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model_dir, args.length)
        return
    if not Path(args.model_dir, "config.json").exists():
        raise SystemExit(f"no model at {args.model_dir}: run `make install` and `kvbudget fetch` first")

    sides = {}
    for name, python, extra in (("ours", args.ours, args.ours_env), ("peer", args.peer, args.peer_env)):
        sides[name], version = _start(python, extra, args)
        print(f"{name}: {python} ({version}){' with ' + ' '.join(extra) if extra else ''}")
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    prefills: dict[str, list[float]] = {"ours": [], "peer": []}
    for round_ in range(args.rounds):
        order = ("ours", "peer") if round_ % 2 == 0 else ("peer", "ours")
        for name in order:
            time.sleep(0.3)  # let the other side's OpenMP threads stop spinning
            prefill_s, ms = _ask(sides[name], args.budget, args.steps)
            prefills[name].append(prefill_s)
            times[name].append(ms)
        print(
            f"round {round_ + 1}: decode ours {times['ours'][-1]:.1f}  peer {times['peer'][-1]:.1f} ms/step;"
            f" prefill ours {prefills['ours'][-1]:.2f}  peer {prefills['peer'][-1]:.2f} s"
        )
    for process in sides.values():
        assert process.stdin is not None
        process.stdin.close()
        process.wait()
    for label, unit, table in (("decode", "ms/step", times), ("prefill", "s", prefills)):
        median = {name: statistics.median(values) for name, values in table.items()}
        for name, values in table.items():
            print(
                f"{label} {name}: median {median[name]:.3f},"
                f" min {min(values):.3f}, max {max(values):.3f} {unit}"
            )
        print(f"{label} ours / peer (medians): {median['ours'] / median['peer']:.3f}")


if __name__ == "__main__":
    main()
