"""Whether a process's first forward differs from its later ones (the kvpress oracle fixture's
flake): in fresh processes, two plain prefills of one saved model and sample, then each later
forward compared with the first at every layer's keys (max distance over the key norms).

    .venv-peer/bin/python lab/scripts/first_forward_probe.py DIR [--processes 50]

DIR holds ``model/`` and ``samples.jsonl`` as the oracle fixture writes them
(``/tmp/pytest-of-*/pytest-*/kvpress2026*``). Prints one line per process that differed by more
than 1e-6 and the count.
"""

import argparse
import json
import subprocess
import sys

CHILD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, DynamicCache
d = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float32, local_files_only=True).eval()
ids = torch.tensor([json.loads(open(d + "/samples.jsonl").readline())["context_ids"]])
model.set_attn_implementation("sdpa")
caches = []
with torch.no_grad():
    for _ in range(2):
        caches.append(DynamicCache())
        model.model(input_ids=ids, past_key_values=caches[-1])
worst = []
for a, b in zip(caches[0].layers, caches[1].layers):
    k0, k1 = a.keys[0].double(), b.keys[0].double()
    worst.append(float((k1 - k0).norm(dim=-1).max() / k0.norm(dim=-1).max()))
print(json.dumps(worst))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder")
    parser.add_argument("--processes", type=int, default=50)
    args = parser.parse_args()
    odd = 0
    for i in range(args.processes):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, args.folder], capture_output=True, text=True, check=True
        )
        worst = json.loads(out.stdout.strip().splitlines()[-1])
        if max(worst) > 1e-6:
            odd += 1
            print(f"process {i}: first forward differs, per layer {', '.join(f'{w:.1e}' for w in worst)}")
    print(f"{odd} of {args.processes} processes had an odd first forward")


if __name__ == "__main__":
    main()
