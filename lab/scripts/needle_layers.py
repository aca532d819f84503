"""Where does SnapKV keep (or lose) the needle? Per-layer analysis on one needle prompt.

For SnapKV in the question-aware setting (window = end of the prompt, the papers' setting) and
the question-agnostic one (window = end of the context, kvpress's setting), at several ratios:
how many of the needle's tokens each layer keeps, and where the needle's best token ranks among
all candidates by SnapKV's score (percentile; 100 = top).

    .venv/bin/python lab/scripts/needle_layers.py --length 2048
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

import kvbudget
from kvbudget.engine import build_prompt
from kvbudget.eval.tasks.needle import needle_sample
from kvbudget.methods.snapkv import SnapKV
from kvbudget.observation import Observation


@dataclass
class RecordingSnapKV(SnapKV):
    """SnapKV that also records each layer's scores (composition: any method can be wrapped)."""

    scores: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def score(self, obs: Observation) -> torch.Tensor:
        s = super().score(obs)
        self.scores[obs.layer_idx] = s[0].clone()
        return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = kvbudget.load_model("smollm2-135m")
    sample = needle_sample(tokenizer, args.length, args.depth, "essays", args.seed)
    prompt = build_prompt(
        tokenizer, sample.context, sample.question, sample.answer_prefix, mark=sample.meta["needle"]
    )
    needle = torch.tensor(prompt.marked)
    print(f"prompt {len(prompt.ids)} tokens, needle tokens {needle.tolist()[0]}..{needle.tolist()[-1]}")
    print("columns: layers 0..29; cell = needle tokens kept (min over KV heads), of", len(needle))
    for agnostic in (False, True):
        for ratio in (0.1, 0.25, 0.5):
            method = RecordingSnapKV()
            result = kvbudget.generate(
                model, tokenizer, sample.context, sample.question, sample.answer_prefix, method=method,
                ratio=ratio, max_new_tokens=12, compress_context_only=agnostic, return_cache=True,
            )  # fmt: skip
            kept = []
            for layer in result.cache.layers:
                kept.append(
                    min(int(torch.isin(layer.head(h)[2][0], needle).sum()) for h in range(layer.num_heads))
                )
            mode = "agnostic" if agnostic else "aware   "
            found = "found" if sample.answers[0] in result.text else "lost "
            print(
                f"{mode} ratio {ratio:4.2f} {found} {result.text.strip()[:14]!r:18} "
                + " ".join(f"{k:2d}" for k in kept)
            )
            if ratio == 0.1:
                ranks = []
                for layer_idx in range(len(result.cache.layers)):
                    s = method.scores[layer_idx]  # [kv_heads, n]
                    candidates = s[:, : s.shape[1] - method.window]
                    best = candidates[:, needle].amax(1, keepdim=True)
                    ranks.append(float((candidates < best).float().mean(1).max()) * 100)
                print(
                    f"{mode} needle best-token score percentile per layer: "
                    + " ".join(f"{r:3.0f}" for r in ranks)
                )


if __name__ == "__main__":
    main()
