"""Which of kvbudget's departures from kvpress's KVgradPress costs needles (lab/notes/kvgrad-vs-kvpress.md).

    .venv/bin/python lab/scripts/kvgrad_diagnosis.py [--seed 1] [--samples 8] [--ratio 0.875]
        [--variants default,cont,prefix,bf16,cont+prefix,cont+prefix+bf16] [--kvpress-answers]
        [--out FILE]

Not run when written. On the needle task's prompts (qwen2.5-coder-0.5b in bf16, 2,048 tokens,
question-agnostic; ``--seed`` picks the split: set it to the one the held-out needles came from) it
runs kvbudget's ``kvgrad`` with one knob at a time set as kvpress sets it:

- ``cont``: the later chunks' request without the trailing space (kvpress's text; ours ends in
  "starting with ", which Qwen's tokenizer makes one more token, 'Ġ'). Exercised by chunk 512 on a
  2K prompt: 3 of 4 passes (kvzip/kvzip+ at chunk 2048 make one pass).
- ``prefix``: kvpress's handling of the chat template's prefix: the score's softmax over the first
  ``min(4, start)`` entries (ours: the whole 24-token prefix), and the prefix scored 0 beyond the 4
  sinks, so it is evicted first (ours keeps it whole: ~9% of the budget at r = 0.875).
- ``bf16``: kvpress's precision in the score: logits, softmax, ‖W_O v‖ and attention × ‖W_O v‖ in
  bf16, times the fp32 gradient norm, the maximum stored in bf16 (ours: fp32 throughout).

and kvpress's own KVgradPress (its process, ``make peer``) for its kept positions (``--indices``)
and, with ``--kvpress-answers``, its answers. Per variant it prints: needles found; the share of
kvpress's kept (layer, head, position) entries it also keeps; and for the needle's digits, the mean
share of (layer, head) pairs keeping each digit token and the pairs keeping all of them.
``KVBUDGET_LOCK`` (a file) is held throughout, as the other lab scripts do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

import kvbudget
from kvbudget.artifacts import file_lock
from kvbudget.engine import build_prompt
from kvbudget.eval.peer_rows import export_sample, peer_python
from kvbudget.eval.runner import EvalConfig, Runner, ratio_budget
from kvbudget.eval.tasks.needle import contains_answer
from kvbudget.methods.kvgrad import GradientReconstructionScores, KVgrad
from kvbudget.models import resolve_source
from kvbudget.peer.environment import runner_script

MODEL = "qwen2.5-coder-0.5b"
#: kvpress 0.5.5's continuation request (kvzip_press.py:257): ours without the trailing space
KVPRESS_CONT = "\n\nRepeat the part of the previous context exactly, starting with"
VARIANTS = {
    "default": {},
    "cont": {"continue_prompt": KVPRESS_CONT},
    "prefix": {"kvpress_prefix": True},
    "bf16": {"bf16_scores": True},
    "cont+prefix": {"continue_prompt": KVPRESS_CONT, "kvpress_prefix": True},
    "cont+prefix+bf16": {"continue_prompt": KVPRESS_CONT, "kvpress_prefix": True, "bf16_scores": True},
}


class Bf16Scores(GradientReconstructionScores):
    """KVgradPress._update_scores's precision: bf16 logits (``q k / sqrt(d)``), causal mask, bf16
    softmax, ‖W_O v‖ rounded to bf16, their product in bf16, times the fp32 gradient norm; the
    maximum over the group and the queries stored in bf16 (kvpress's ``score_val`` dtype).
    Global layers only (no sliding window, no softcap: Qwen2.5)."""

    def score_pass(self, layer_idx: int, query: torch.Tensor, layer, scaling: float) -> None:
        lead, start, end = self.span
        n = self.context[layer_idx].keys.shape[2]
        keys = layer.keys[0].bfloat16()  # [h, n + q, d]
        q, d = query.shape[2], query.shape[3]
        sub = torch.cat([keys[:, :lead], keys[:, start:end], keys[:, n:]], dim=1)
        heads, group, m = sub.shape[0], query.shape[1] // sub.shape[0], end - start
        rows = query[0].bfloat16().reshape(heads, group * q, d)
        logits = (torch.matmul(rows, sub.transpose(1, 2)) / math.sqrt(d)).view(heads, group, q, -1)
        future = torch.ones(q, q, dtype=torch.bool, device=logits.device).triu(1)
        logits[..., lead + m :] = logits[..., lead + m :].masked_fill(future, torch.finfo(torch.bfloat16).min)
        probs = torch.softmax(logits, dim=-1)[..., lead : lead + m]  # bf16 [h, g, q, m]
        weighted = probs * self.out_norms[layer_idx].bfloat16().to(probs.device)[:, :, None, :]
        weighted = weighted * self.grad_norms[layer_idx].to(probs.device)[None, None, :, None]  # fp32
        best = weighted.amax(dim=(1, 2)).bfloat16().float()
        self.scores[layer_idx][:, start:end] = best.to(self.scores[layer_idx].device)


@dataclass(frozen=True)
class KVgradProbe(KVgrad):
    """``kvgrad`` with kvpress's prefix handling (``kvpress_prefix``: the softmax over the first
    ``sinks`` entries only, and only those protected) and precision (``bf16_scores``) as switches."""

    kvpress_prefix: bool = False
    bf16_scores: bool = False

    @property
    def scores_session(self):
        return Bf16Scores if self.bf16_scores else GradientReconstructionScores

    def anchor_count(self, prefix: int) -> int:
        return self.sinks if self.kvpress_prefix else super().anchor_count(prefix)


def kept_of(cache, n_ctx: int) -> list[list[set[int]]]:
    """Per layer and KV head, the context positions the cache holds (question and answer left out)."""
    return [[{p for p in layer.head(h)[2][0].tolist() if 0 <= p < n_ctx} for h in range(layer.num_heads)]
            for layer in cache.layers]  # fmt: skip


def needle_cover(kept: list[list[set[int]]], digits: list[int]) -> tuple[float, int]:
    """Mean share of (layer, head) pairs holding each digit token; pairs holding all of them."""
    pairs = [heads for layer in kept for heads in layer]
    share = sum(sum(d in k for k in pairs) for d in digits) / (len(digits) * len(pairs))
    return share, sum(all(d in k for d in digits) for k in pairs)


def overlap(ours: list[list[set[int]]], theirs: list[list[int]]) -> tuple[int, int]:
    common = total = 0
    for mine, peer in zip(ours, theirs, strict=True):
        for a, b in zip(mine, peer, strict=True):
            common += len(a & set(b))
            total += len(b)
    return common, total


def run_kvpress(python, work: Path, samples: list[dict], ratio: float, dtype: str, indices: bool) -> dict:
    job = {"press": "KVgradPress", "method": "kvpress:kvgrad", "budget": 0, "compression_ratio": ratio,
           "question_aware": False}  # fmt: skip
    (work / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (work / "jobs.json").write_text(json.dumps([job]))
    out = work / ("indices.jsonl" if indices else "answers.jsonl")
    command = [str(python), "-P", str(runner_script()), "--model", str(resolve_source(MODEL)),
               "--samples", str(work / "samples.jsonl"), "--jobs", str(work / "jobs.json"),
               "--out", str(out), "--dtype", dtype]  # fmt: skip
    subprocess.run(command + (["--indices"] if indices else []), check=True, timeout=4 * 3600)
    return {r["sample"]: r for r in map(json.loads, out.read_text().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=1, help="the needle split (the held-out one's seed)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.875, help="kvpress's compression_ratio")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--kvpress-answers", action="store_true", help="also kvpress's answers (+~200 s a prompt)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    python, versions = peer_python()
    variants = args.variants.split(",")

    lock = os.environ.get("KVBUDGET_LOCK")
    with file_lock(Path(lock)) if lock else nullcontext():
        model, tokenizer = kvbudget.load_model(MODEL, dtype=args.dtype)
        config = EvalConfig(MODEL, ["needle"], [args.length], ["full"], [], [args.ratio], args.samples,
                            seed=args.seed, compress_context_only=True, dtype=args.dtype)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            runner = Runner(config, work / "rows", model=model, tokenizer=tokenizer, progress=False)
            entries = [(export_sample(runner, task, length, index, sample), sample)
                       for task, length, index, sample in runner.samples()]  # fmt: skip
            exported = [e for e, _ in entries]
            print(f"kvpress ({versions}): KVgradPress on {len(exported)} prompts ...", flush=True)
            theirs = run_kvpress(python, work, exported, args.ratio, args.dtype, indices=True)
            answers = (run_kvpress(python, work, exported, args.ratio, args.dtype, indices=False)
                       if args.kvpress_answers else {})  # fmt: skip

        found = {name: 0 for name in [*variants, "kvpress"]}
        common = {name: [0, 0] for name in variants}
        share = {name: [] for name in [*variants, "kvpress"]}
        whole = {name: [] for name in [*variants, "kvpress"]}
        per_sample = []
        for ex, sample in entries:
            number = sample.answers[0]
            digits = build_prompt(
                tokenizer, sample.context, sample.question, sample.answer_prefix, mark=number
            ).marked  # the needle's digit tokens in context_ids
            n_ctx = len(ex["context_ids"])
            peer = theirs[ex["id"]]["indices"]
            s, w = needle_cover([[set(h) for h in layer] for layer in peer], digits)
            share["kvpress"].append(s)
            whole["kvpress"].append(w)
            line = [ex["id"]]
            if answers:
                text = tokenizer.decode(answers[ex["id"]]["token_ids"], skip_special_tokens=True)
                found["kvpress"] += contains_answer(text, sample.answers) > 0
                line.append(f"kvpress {'✓' if contains_answer(text, sample.answers) else '✗'}")
            for name in variants:
                method = KVgradProbe(**VARIANTS[name])
                result = kvbudget.generate(
                    model, tokenizer, sample.context, sample.question, sample.answer_prefix, method=method,
                    budget=ratio_budget(args.ratio, n_ctx), max_new_tokens=sample.max_new_tokens,
                    compress_context_only=True, return_cache=True,
                )  # fmt: skip
                ok = contains_answer(result.text, sample.answers) > 0
                found[name] += ok
                kept = kept_of(result.cache, n_ctx)
                c, t = overlap(kept, peer)
                common[name][0] += c
                common[name][1] += t
                s, w = needle_cover(kept, digits)
                share[name].append(s)
                whole[name].append(w)
                line.append(f"{name} {'✓' if ok else '✗'} ({100 * c / t:.1f}% as kvpress)")
            per_sample.append(" | ".join(line))
            print(per_sample[-1], flush=True)

        pairs = model.config.num_hidden_layers * model.config.num_key_value_heads
        lines = [f"needle, seed {args.seed}, {len(entries)} prompts of {args.length}, r = {args.ratio}, "
                 f"{args.dtype}, question-agnostic; kvpress {versions}", "",
                 "| variant | needles found | kvpress's kept entries also kept | digit kept, mean share of "
                 f"(layer, head) | (layer, head) of {pairs} holding every digit, mean |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for name in [*variants, "kvpress"]:
            got = f"{found[name]} of {len(entries)}" if name != "kvpress" or answers else "–"
            same = f"{100 * common[name][0] / common[name][1]:.1f}%" if name in common else "100%"
            cover = f"{100 * sum(share[name]) / len(entries):.1f}%"
            lines.append(f"| {name} | {got} | {same} | {cover} | {sum(whole[name]) / len(entries):.1f} |")
        text = "\n".join([*lines, "", *per_sample])
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
