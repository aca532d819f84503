"""D2O's merging under the microscope: per-layer merge statistics and paired long-document perplexity.

For each passage and each variant (D2O with its merge options, ``d2o-nomerge``, ``h2o``) the
passage's perplexity is measured by the ``perplexity`` task's
:func:`~kvbudget.eval.tasks.perplexity.chunked_perplexity`: the first ``--first-chunk`` tokens are
prefilled and compressed to the budget, the rest read ``--chunk`` tokens at a time from the cache,
trimmed back to the budget after every chunk). While a D2O variant merges, a
:attr:`~kvbudget.methods.d2o.D2ORun.merge_watcher` callback counts per layer: evicted entries, merged
ones, the kind of kept entry each merge lands on (sink / heavy hitter / recent window), the
relative change ``‖Δk‖/‖k‖`` (and ``‖k_after‖/‖k_before‖``, ``‖Δv‖/‖v‖``) of every kept entry a
merge changes, and the best cosine similarities.

``run`` appends one JSON line per (variant, passage) to ``--out`` and skips those already there,
so it can be called repeatedly in short chunks (``--max-seconds``) until every passage is done.
``summary`` reads the lines back and prints, with 95% bootstrap intervals over passages, each
variant's perplexity and its paired difference from ``d2o-nomerge`` (same passages, resampled
together), the merge statistics, and a per-layer table; ``--json`` writes that summary.

    OMP_NUM_THREADS=1 .venv/bin/python lab/scripts/d2o_merge_diagnostics.py run --budget 256 --passages 0-7
    .venv/bin/python lab/scripts/d2o_merge_diagnostics.py summary --budget 256
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

#: label → (registry name, options). ``d2o-authors-decision`` is the authors' code's decision with
#: their EMA weights (0.5 / 0.5); ``d2o-authors`` is their whole merge: their weighting, their
#: decision and their EMA weights.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "h2o": ("h2o", {}),
    "d2o-nomerge": ("d2o-nomerge", {}),
    "d2o": ("d2o", {}),
    "d2o-heavy": ("d2o", {"merge_targets": "heavy"}),
    "d2o-authors-weighting": ("d2o", {"weighting": "authors"}),
    "d2o-authors-decision": ("d2o", {"decision": "authors", "beta": 0.5}),
    "d2o-authors": ("d2o", {"weighting": "authors", "decision": "authors", "beta": 0.5}),
    "d2o-merge-all": ("d2o", {"threshold": False}),
    "d2o-fixed-0.8": ("d2o", {"threshold": False, "fixed_threshold": 0.8}),
    "d2o-fixed-0.9": ("d2o", {"threshold": False, "fixed_threshold": 0.9}),
    "d2o-fixed-0.95": ("d2o", {"threshold": False, "fixed_threshold": 0.95}),
    "d2o-heavy-authors": (
        "d2o", {"merge_targets": "heavy", "weighting": "authors", "decision": "authors", "beta": 0.5}
    ),
    # diagnostic ablations, not options of the method: d2o's merge with one half of it undone
    "d2o-keys-only": ("d2o", {}),
    "d2o-values-only": ("d2o", {}),
}  # fmt: skip
#: ablations: which half of each merge is kept (the other is restored to the pre-merge entries)
PARTS = {"d2o-keys-only": "keys", "d2o-values-only": "values"}
DEFAULT_VARIANTS = "d2o-nomerge,d2o,h2o,d2o-heavy,d2o-authors-weighting,d2o-authors-decision,d2o-fixed-0.9"
REFERENCE = "d2o-nomerge"
LAYER_COLUMNS = ("merges_per_kept", "merge_rate", "share_sink", "share_heavy", "share_recent", "dk_rel",
                 "k_norm_ratio", "dv_rel", "best_sim", "k_cos_merged", "v_cos_merged")  # fmt: skip
OUT = Path("lab/results/d2o-merge/results.jsonl")


def parse_passages(spec: str) -> list[int]:
    """``"0-7"`` or ``"0,3,5"`` or ``"8-15,20"`` → passage indices."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def setup_key(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "length": args.length, "first_chunk": args.first_chunk,
            "chunk": args.chunk, "budget": args.budget}  # fmt: skip


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ merge statistics
class LayerMergeStats:
    """Per-layer counters filled by the merge events of a run's :attr:`D2ORun.merge_watcher`."""

    FIELDS = ("evicted", "merged", "on_sink", "on_heavy", "on_recent", "touched", "dk_rel", "k_norm_ratio",
              "dv_rel", "best_sum", "best_merged_sum", "v_cos_merged_sum")  # fmt: skip

    def __init__(self, layers: int) -> None:
        self.data = {f: [0.0] * layers for f in self.FIELDS}

    def __call__(self, event: Any) -> None:
        import torch

        from kvbudget.methods.d2o import HEAVY, RECENT, SINK

        res, i = event.result, event.layer_idx
        merged = res.merged
        target_kind = event.kinds.to(res.nearest.device).gather(1, res.nearest)  # [h, E]
        d = self.data
        d["evicted"][i] += merged.numel()
        d["merged"][i] += int(merged.sum())
        d["on_sink"][i] += int((merged & (target_kind == SINK)).sum())
        d["on_heavy"][i] += int((merged & (target_kind == HEAVY)).sum())
        d["on_recent"][i] += int((merged & (target_kind == RECENT)).sum())
        d["best_sum"][i] += float(res.similarity.sum())
        d["best_merged_sum"][i] += float((res.similarity * merged).sum())
        if event.evicted_values is not None:  # cos(v_i, v_nearest) of the merged pairs: keys match, values?
            target_v = event.values.float().gather(
                1, res.nearest[..., None].expand(-1, -1, event.values.shape[-1])
            )  # [h, E, d]
            v_cos = torch.nn.functional.cosine_similarity(event.evicted_values.float(), target_v, dim=-1)
            d["v_cos_merged_sum"][i] += float((v_cos * merged).sum())
        received = torch.zeros(event.kinds.shape, dtype=torch.int64, device=merged.device)
        received.scatter_add_(1, res.nearest, merged.long())
        touched = received > 0  # [h, S]
        if not bool(touched.any()):
            return
        before_k, after_k = event.keys.float()[touched], res.keys.float()[touched]
        before_v, after_v = event.values.float()[touched], res.values.float()[touched]
        norm_k = before_k.norm(dim=-1).clamp_min(1e-12)
        d["touched"][i] += int(touched.sum())
        d["dk_rel"][i] += float(((after_k - before_k).norm(dim=-1) / norm_k).sum())
        d["k_norm_ratio"][i] += float((after_k.norm(dim=-1) / norm_k).sum())
        d["dv_rel"][i] += float(
            ((after_v - before_v).norm(dim=-1) / before_v.norm(dim=-1).clamp_min(1e-12)).sum()
        )


# ------------------------------------------------------------------------------ run
def merge_only(part: str | None) -> None:
    """Diagnostic ablation: make D2O keep only the ``keys`` or the ``values`` half of every merge
    (the other half of each kept entry stays as it was before the merge); ``None`` restores the
    plain merge. Patches the ``d2o_merge`` that :mod:`kvbudget.methods.d2o` calls."""
    import kvbudget.methods.d2o as d2o_module
    from kvbudget.merging import d2o_merge

    if part is None:
        d2o_module.d2o_merge = d2o_merge
        return

    def partial_merge(kept_keys: Any, kept_values: Any, *args: Any, **kwargs: Any) -> Any:
        out = d2o_merge(kept_keys, kept_values, *args, **kwargs)
        if part == "keys":
            out.values = kept_values
        else:
            out.keys = kept_keys
        return out

    d2o_module.d2o_merge = partial_merge


def run(args: argparse.Namespace) -> None:
    import torch

    from kvbudget.eval.tasks.perplexity import austen_ids, chunked_perplexity, make_samples
    from kvbudget.methods.d2o import D2O
    from kvbudget.methods.registry import make_method
    from kvbudget.models import load_model

    start_all = time.perf_counter()
    torch.set_num_threads(args.threads)
    labels = args.variants.split(",")
    unknown = [v for v in labels if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    passages = parse_passages(args.passages)
    key = setup_key(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {
        (r["variant"], r["passage"]) for r in read_rows(out) if all(r.get(k) == v for k, v in key.items())
    }
    todo = [(p, v) for p in passages for v in labels if (v, p) not in done]
    if not todo:
        print("nothing to do")
        return
    model, tokenizer = load_model(args.model)
    layers = model.config.num_hidden_layers
    kv_heads = model.config.num_key_value_heads
    samples = make_samples(tokenizer, args.length, max(passages) + 1, seed=0)
    ids_all = austen_ids(tokenizer)
    slowest = 0.0
    for passage, label in todo:
        elapsed = time.perf_counter() - start_all
        if args.max_seconds and elapsed + 1.2 * slowest > args.max_seconds:
            print(f"stopping after {elapsed:.0f} s ({len(todo)} runs were planned)")
            break
        offset = samples[passage].meta["offset"]
        ids = torch.tensor([list(ids_all[offset : offset + args.length])])
        name, options = VARIANTS[label]
        method = make_method(name, **options)
        merge_only(PARTS.get(label))
        stats = LayerMergeStats(layers)
        runs = []

        def watch(run, stats=stats, runs=runs, method=method) -> None:
            if isinstance(method, D2O):
                run.merge_watcher = stats
            runs.append(run)

        t0 = time.perf_counter()
        result = chunked_perplexity(
            model, ids, method, args.budget, chunk=args.chunk, first_chunk=args.first_chunk, on_start=watch
        )
        seconds = time.perf_counter() - t0
        slowest = max(slowest, seconds)
        row = {**key, "variant": label, "method": name, "options": options, "passage": passage,
               "offset": offset, "nll": result.nll, "tokens": result.tokens,
               "max_entries_per_head": result.max_entries_per_head, "seconds": round(seconds, 2),
               "kv_heads": kv_heads}  # fmt: skip
        if isinstance(method, D2O):
            row["layer_budgets"] = runs[-1].layer_budgets(0)
            row["layer_stats"] = stats.data
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"passage {passage} {label}: ppl {math.exp(result.nll):.3f} ({seconds:.0f} s)", flush=True)


# ------------------------------------------------------------------------------ summary
def bootstrap(values: np.ndarray, statistic, resamples: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``statistic`` over passages (rows of ``values``) resampled."""
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    idx = rng.integers(0, n, size=(resamples, n))
    stats = np.array([statistic(values[i]) for i in idx])
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def merge_totals(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """Layer statistics summed over passages → per-layer and all-layer ratios."""
    rows = [r for r in rows if "layer_stats" in r]
    if not rows:
        return None
    fields = set.intersection(*(set(r["layer_stats"]) for r in rows))
    layers = len(rows[0]["layer_budgets"])
    s = {f: np.sum([r["layer_stats"][f] for r in rows], axis=0) for f in fields}
    kept = np.sum([np.array(r["layer_budgets"]) * r["kv_heads"] for r in rows], axis=0)  # entries held

    def ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(b > 0, a / np.maximum(b, 1e-12), np.nan)

    per_layer = {
        "layer_budget": np.mean([r["layer_budgets"] for r in rows], axis=0),
        "merges_per_kept": ratio(s["merged"], kept),
        "merge_rate": ratio(s["merged"], s["evicted"]),
        "share_sink": ratio(s["on_sink"], s["merged"]),
        "share_heavy": ratio(s["on_heavy"], s["merged"]),
        "share_recent": ratio(s["on_recent"], s["merged"]),
        "dk_rel": ratio(s["dk_rel"], s["touched"]),
        "k_norm_ratio": ratio(s["k_norm_ratio"], s["touched"]),
        "dv_rel": ratio(s["dv_rel"], s["touched"]),
        "best_sim": ratio(s["best_sum"], s["evicted"]),
        "k_cos_merged": ratio(s["best_merged_sum"], s["merged"]),
        "v_cos_merged": ratio(s.get("v_cos_merged_sum", np.full(layers, np.nan)), s["merged"]),
    }
    total = {
        "merges_per_kept": float(s["merged"].sum() / kept.sum()),
        "merge_rate": float(s["merged"].sum() / max(s["evicted"].sum(), 1)),
        "share_sink": float(s["on_sink"].sum() / max(s["merged"].sum(), 1)),
        "share_heavy": float(s["on_heavy"].sum() / max(s["merged"].sum(), 1)),
        "share_recent": float(s["on_recent"].sum() / max(s["merged"].sum(), 1)),
        "dk_rel": float(s["dk_rel"].sum() / max(s["touched"].sum(), 1)),
        "k_norm_ratio": float(s["k_norm_ratio"].sum() / max(s["touched"].sum(), 1)),
        "dv_rel": float(s["dv_rel"].sum() / max(s["touched"].sum(), 1)),
        "best_sim": float(s["best_sum"].sum() / max(s["evicted"].sum(), 1)),
        "k_cos_merged": float(s["best_merged_sum"].sum() / max(s["merged"].sum(), 1)),
        "v_cos_merged": float(
            s["v_cos_merged_sum"].sum() / max(s["merged"].sum(), 1) if "v_cos_merged_sum" in s else math.nan
        ),
    }
    return {"layers": layers, "per_layer": {k: v.tolist() for k, v in per_layer.items()}, "total": total}


def fmt(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary(args: argparse.Namespace) -> None:
    key = setup_key(args)
    rows = [r for r in read_rows(Path(args.out)) if all(r.get(k) == v for k, v in key.items())]
    labels = [
        v
        for v in (args.variants.split(",") if args.variants else VARIANTS)
        if any(r["variant"] == v for r in rows)
    ]
    if REFERENCE not in labels:
        raise SystemExit(f"no {REFERENCE} rows for {key}")
    by = {(r["variant"], r["passage"]): r for r in rows}
    passages = sorted(p for p in {r["passage"] for r in rows} if all((v, p) in by for v in labels))
    if args.passages:
        passages = [p for p in passages if p in set(parse_passages(args.passages))]
    n = len(passages)
    if n < 2:
        raise SystemExit(f"only {n} passage(s) done for every variant of {labels}")
    ref = np.array([by[(REFERENCE, p)]["nll"] for p in passages])
    print(f"{args.model}, budget {args.budget}, {n} Austen passages × {args.length} tokens "
          f"(first {args.first_chunk} prefilled, chunk {args.chunk}), passages {passages}; "
          f"95% bootstrap intervals over passages ({args.resamples} resamples)")  # fmt: skip
    print()
    print("| variant | perplexity [95% CI] | Δ ppl vs d2o-nomerge [95% CI] | merges / kept entry "
          "| merged / evicted | on sinks / heavy / recent | ‖Δk‖/‖k‖ | ‖k′‖/‖k‖ | ‖Δv‖/‖v‖ "
          "| cos k (merged) | cos v (merged) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out_rows = []
    for label in labels:
        nll = np.array([by[(label, p)]["nll"] for p in passages])
        ppl = math.exp(nll.mean())
        lo, hi = bootstrap(nll, lambda x: math.exp(x.mean()), args.resamples)
        pair = np.stack([nll, ref], axis=1)
        d = math.exp(nll.mean()) - math.exp(ref.mean())
        dlo, dhi = bootstrap(
            pair, lambda x: math.exp(x[:, 0].mean()) - math.exp(x[:, 1].mean()), args.resamples
        )
        wins = int((nll < ref).sum())
        merges = merge_totals(by[(label, p)] for p in passages)
        t = merges["total"] if merges else {}
        shares = (
            f"{t['share_sink']:.1%} / {t['share_heavy']:.1%} / {t['share_recent']:.1%}" if merges else "–"
        )
        delta = "0 (reference)" if label == REFERENCE else f"{d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
        cells = [fmt(t.get(k, math.nan)) for k in ("merges_per_kept", "merge_rate", "dk_rel", "k_norm_ratio",
                                                    "dv_rel", "k_cos_merged", "v_cos_merged")]  # fmt: skip
        print(f"| {label} | {ppl:.3f} [{lo:.3f}, {hi:.3f}] | {delta} | {cells[0]} | {cells[1]} | {shares} "
              f"| {cells[2]} | {cells[3]} | {cells[4]} | {cells[5]} | {cells[6]} |")  # fmt: skip
        out_rows.append({**key, "variant": label, "options": by[(label, passages[0])]["options"],
                         "passages": passages, "perplexity": ppl, "ci95": [lo, hi],
                         "delta_vs_nomerge": d, "delta_ci95": [dlo, dhi], "lower_nll_than_nomerge": wins,
                         "nll_per_passage": nll.tolist(), "merges": merges})  # fmt: skip
    for label in args.layers_for.split(",") if args.layers_for else []:
        rec = next((r for r in out_rows if r["variant"] == label and r["merges"]), None)
        if rec is None:
            continue
        pl = rec["merges"]["per_layer"]
        print()
        print(f"Per layer, {label} (sums over the {n} passages):")
        print()
        print("| layer | S_l | merges / kept | merged / evicted | on sinks | on heavy | on recent | ‖Δk‖/‖k‖ "
              "| ‖k′‖/‖k‖ | ‖Δv‖/‖v‖ | best cos | cos k (merged) | cos v (merged) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for i in range(rec["merges"]["layers"]):
            cells = [fmt(pl[k][i]) for k in LAYER_COLUMNS]
            print(f"| {i} | {pl['layer_budget'][i]:.0f} | " + " | ".join(cells) + " |")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in out_rows))
        print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("run", "summary"):
        p = sub.add_parser(command)
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--budget", type=int, default=256)
        p.add_argument("--length", type=int, default=1536)
        p.add_argument("--first-chunk", type=int, default=1024)
        p.add_argument("--chunk", type=int, default=32)
        p.add_argument("--out", default=str(OUT), help="JSONL of per-passage results (appended)")
    run_p, sum_p = sub.choices["run"], sub.choices["summary"]
    run_p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    run_p.add_argument("--passages", default="0-7", help="passage indices, e.g. 0-7 or 0,2,5")
    run_p.add_argument(
        "--max-seconds", type=float, default=270.0, help="stop before exceeding this (0 = no limit)"
    )
    run_p.add_argument("--threads", type=int, default=1)
    sum_p.add_argument("--variants", default="", help="comma list (default: every variant with rows)")
    sum_p.add_argument("--passages", default="", help="restrict to these passages")
    sum_p.add_argument("--resamples", type=int, default=10000)
    sum_p.add_argument("--layers-for", default="d2o", help="variants to print the per-layer table for")
    sum_p.add_argument("--json", default="", help="write the summary (one JSON line per variant) here")
    args = parser.parse_args()
    run(args) if args.command == "run" else summary(args)


if __name__ == "__main__":
    main()
