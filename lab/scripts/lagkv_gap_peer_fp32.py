"""Run by .venv-peer's Python: kvpress's LagKVPress with its scores computed in float32 (the press
computes them in the cache's dtype, bf16 on the leaderboard), through the same decode loop as the
peer harness (kvbudget/peer/kvpress_runner.py run_one), on the samples the harness exported.

Usage: .venv-peer/bin/python -P lab/scripts/lagkv_gap_peer_fp32.py MODEL_DIR WORK(samples.jsonl)
    RESULTS(for answers) N_SINK fp32|bf16 [RATIOS]"""

import importlib.util
import json
import sys
from dataclasses import dataclass

import kvpress
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, work, results, n_sink, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
ratios = [float(r) for r in sys.argv[6].split(",")] if len(sys.argv) > 6 else [0.75, 0.875]
spec = importlib.util.spec_from_file_location("kvpress_runner", "src/kvbudget/peer/kvpress_runner.py")
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)


@dataclass
class LagKVPressFP32(kvpress.LagKVPress):
    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return super().score(module, hidden_states, keys.float(), values.float(), attentions, kwargs)


kvpress.LagKVPressFP32 = LagKVPressFP32
press = "LagKVPressFP32" if mode == "fp32" else "LagKVPress"
answers = {}
for line in open(results):
    row = json.loads(line)
    answers[f"needle/2048/{row['sample']}"] = row["answers"]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()
if getattr(model.config, "head_dim", None) is None:
    model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
samples = [json.loads(line) for line in open(f"{work}/samples.jsonl") if line.strip()]
for ratio in ratios:
    marks = ""
    for sample in samples:
        job = {"press": press, "kwargs": {"n_sink": n_sink}, "method": "x", "compression_ratio": ratio}
        row = runner.run_one(model, sample, job)
        text = tok.decode(row["token_ids"])
        marks += "x" if any(a.lower() in text.lower() for a in answers[sample["id"]]) else "."
    print(
        f"\nRESULT kvpress {press} n_sink={n_sink} r={ratio}: {marks.count('x')}/{len(marks)} {marks}",
        flush=True,
    )
