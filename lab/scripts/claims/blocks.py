"""Every table of docs/claims.md by the name of its block, from the result folders given."""

from __future__ import annotations

import argparse

from kvbudget.eval.report import PEER_PREFIX
from kvbudget.eval.store import load_rows

from .agnostic import agnostic_blocks
from .common import EVERY_RATIO, has_results
from .leaderboard import best_against_kvpress, leaderboard_table
from .pairs import SAME_METHOD_PAIRS, pairs_table, selection_layers
from .papers import asl_ttft, d2o_longgen, dtype_table, kl_rows, laq_overhead, over_budget
from .verdicts import BAKLAVA_PROFILE, LAVA_BASELINES, check_block, verdicts_table

HARD = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "kv_retrieval")


#: Tasks of the RULER family among the leaderboard's (rows' ``family`` = "ruler").
RULER_FAMILY = "ruler"


def blocks(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every table of docs/claims.md by name (the name of its ``<!-- claims:NAME -->`` block)."""
    rows = [r for r in load_rows(args.leaderboard / "results.jsonl") if r.get("error") is None]
    extraction = sorted(t for t in {r["task"] for r in rows} if t != "lcc")
    out: dict[str, list[str]] = {}
    if has_results(args.dtype_check):
        out["dtype"] = dtype_table(load_rows(args.dtype_check / "results.jsonl"))

    out["lava-baselines"] = pairs_table(rows, [("lava", b) for b in LAVA_BASELINES])
    ablations = [("lava", b) for b in ("lava-uniform", "lava-nohead", "lava-pyramid")]
    ablations += [("lava-pyramid", "lava-uniform")]  # the paper's Table 9 pair
    out["lava-ablations"] = pairs_table(rows, ablations)
    out["lava-ablations-code"] = pairs_table(rows, ablations, tasks=["lcc"])
    out["lava-ablations-extraction"] = pairs_table(rows, ablations, tasks=extraction)

    asl_pairs = [
        (a, b) for a in ("asl", "asl-2pass", "asl-fullkv") for b in ("fastkv", "gemfilter", "pyramidinfer")
    ]
    asl_pairs += [("asl", "snapkv")]
    out["asl"] = pairs_table(rows, asl_pairs)
    out["asl-hard"] = pairs_table(rows, asl_pairs, tasks=list(HARD))
    out["asl-layers"] = selection_layers(rows, ["asl", "asl-2pass", "fastkv", "gemfilter"])
    if (args.asl_ttft / "bench.json").exists():
        out["asl-ttft"] = asl_ttft(args.asl_ttft)

    bak = [("baklava", "streamingllm"), ("baklava", "squeezeattention"), ("baklava-snapkv", "snapkv")]
    out["baklava-tasks"] = pairs_table(rows, bak)
    if has_results(args.baklava):
        ppl = [r for r in load_rows(args.baklava / "results.jsonl") if r.get("error") is None]
        # The tuned rows name the folder's profile.json by the path their run was given (the
        # committed rows: results/claims-baklava/profile.json, from before the folder moved to lab/).
        recorded = sorted({r["label"] for r in ppl if r["label"].startswith("baklava:profile=")})
        default = ":profile=" + str(args.baklava / "profile.json")
        profile = recorded[0].removeprefix("baklava") if recorded else default
        tuned = {label: label + profile for label in ("baklava", "squeezeattention")}
        ppl_pairs = [
            (tuned["baklava"], "streamingllm"), (tuned["baklava"], tuned["squeezeattention"]),
            (tuned["baklava"], "baklava"), ("baklava", "streamingllm"), ("streamingllm", "full"),
        ]  # fmt: skip
        lines = pairs_table(ppl, ppl_pairs, min_samples=8, scale=1.0)
        out["baklava-perplexity"] = [line.replace(profile, " (tuned)") for line in lines]

    for ratio in (0.875, 0.75, 0.5, 0.25):
        out[f"leaderboard-{ratio:g}"] = leaderboard_table(rows, ratio)
        out[f"leaderboard-{ratio:g}-shared"] = leaderboard_table(rows, ratio, shared=True)
    out["leaderboard-kvpress"] = best_against_kvpress(rows, (0.875, 0.75, 0.5, 0.25))
    out["leaderboard-kvpress-same"] = pairs_table(rows, SAME_METHOD_PAIRS)
    if has_results(args.ea_floor):  # kvbudget's Expected Attention with kvpress's head floor
        floor_rows = [r for r in load_rows(args.ea_floor / "results.jsonl") if r.get("error") is None]
        ours, floored = "expected-attention", "expected-attention:floor=kvpress"
        floor_pairs = [(f"{PEER_PREFIX}expected_attention", floored), (floored, ours)]
        out["leaderboard-ea-floor"] = pairs_table(rows + floor_rows, floor_pairs)
    newer = [("chunkkv", "snapkv"), ("chunkkv", "laq"), ("kvzip", "snapkv"), ("kvzip", "cake"),
             ("r-kv", "snapkv"), ("expected-attention", "snapkv"), ("keydiff", "streamingllm"),
             ("lagkv", "streamingllm"), ("qfilter", "streamingllm")]  # fmt: skip
    out["leaderboard-newer"] = pairs_table(rows, newer)
    family = [("kvgrad", "laq"), ("kvgrad", "kvzip+"), ("kvzip+", "kvzip"), ("kvzap", "kvzip+"),
              ("kvzap:kind=linear", "kvzap"), ("leverage", "kvzip+"), ("compactor", "leverage")]  # fmt: skip
    out["leaderboard-2026"] = pairs_table(rows, family)  # issue #48's family, question-aware
    laq = [(m, "snapkv") for m in ("laq", "laq++", "laq-ada", "laq-lava")] + [("laq-ada", "ada-snapkv")]
    out["laq"] = pairs_table(rows, laq)
    out["laq-every-ratio"] = pairs_table(rows, laq, tasks=EVERY_RATIO)
    ruler = sorted({r["task"] for r in rows if r.get("family") == RULER_FAMILY})
    out["laq-ruler"] = pairs_table(rows, [("laq++", "snapkv"), ("laq", "snapkv")], tasks=ruler)
    out["laq-lcc"] = pairs_table(rows, [("laq", "snapkv"), ("laq++", "snapkv")], tasks=["lcc"])
    out["laq-overhead"] = laq_overhead(rows)
    pyramids = ("pyramidkv", "ada-pyramidkv", "lava-pyramid", "pyramidinfer", "asl-fullkv")
    out["over-budget"] = over_budget(rows, pyramids)
    sources = {"leaderboard": rows}
    if has_results(args.d2o_longgen):
        sources["d2o-longgen-kl"] = kl_rows(load_rows(args.d2o_longgen / "results.jsonl"))
        out["d2o-longgen"] = d2o_longgen(sources["d2o-longgen-kl"])
    out["verdicts"] = verdicts_table(sources)
    if has_results(args.check):
        out["check-1.5b"] = check_block(
            [r for r in load_rows(args.check / "results.jsonl") if r.get("error") is None]
        )
    out.update(agnostic_blocks(args.agnostic, rows))
    return name_tuned_profiles(out)


def name_tuned_profiles(out: dict[str, list[str]]) -> dict[str, list[str]]:
    """The tuned BaKlaVa rows' labels carry their profile's path: every table names them "(tuned)"."""
    tuned = f":profile={BAKLAVA_PROFILE}"
    return {name: [line.replace(tuned, " (tuned)") for line in lines] for name, lines in out.items()}
