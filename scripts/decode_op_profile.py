"""Which operators a plain transformers decode step runs, and how often: compare two environments.

    OMP_NUM_THREADS=2 .venv-peer/bin/python scripts/decode_op_profile.py        # transformers 5.2
    OMP_NUM_THREADS=2 .venv-peer-same/bin/python scripts/decode_op_profile.py   # 5.23 (make target)

Imports only torch and transformers (no kvbudget), so any environment with the default model
fetched can run it: prefills ``--length`` random tokens into a ``DynamicCache`` (sdpa, float32),
decodes 5 untimed greedy steps, then profiles ``--steps`` more with ``torch.profiler`` and prints
the operator table (self CPU time, call counts). Same operators and counts in both environments
mean a speed difference between them is not an extra operator.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache/kvbudget/models/smollm2-135m/hf"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import transformers
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=generator)
    cache = DynamicCache(config=model.config)
    positions = torch.arange(args.length)[None]
    token = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0, -1].argmax()
    position = positions[:, -1:]

    def decode(steps: int) -> None:
        nonlocal token, position
        for _ in range(steps):
            position = position + 1
            out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=position)
            token = out.logits[0, -1].argmax()

    decode(5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(args.steps)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {args.steps} decode steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))


if __name__ == "__main__":
    main()
