"""docs/leaderboard.md's ``server-default`` block: `kvbudget serve`'s default compressions, chosen from
the question-agnostic shared-context rows by the rule written before their 20-sample figures
(docs/leaderboard.md, "The server's default").

1. Candidates: each configuration of the section's question-agnostic rows, with every sample of the
   three tasks in both modes, whose cache takes at most :data:`MAX_BYTES_SHARE` of the full cache's
   bytes; for the conversations' default (``--method``, paid on every request) also whose
   first-prompt compression adds at most :data:`MAX_COMPRESS_SHARE` of the prompt's prefill time
   (means over the rows). The documents' default (``--document-method``) has no such bound: a
   document's compression is paid once.
2. The default is the candidate that **holds** later turns in both modes (the section's verdict)
   with the fewest bytes; candidates within :data:`BYTES_TIE` of the fewest are a tie, won by the
   higher multi-turn later-turn score.
3. If none holds in both modes, the candidate whose lower interval bound, the smaller of its two
   modes', is highest.

Each decides only once every configuration of its list (:data:`CANDIDATES`,
:data:`DOCUMENT_CANDIDATES`) has :data:`SAMPLES` samples of each task; until then the block says
which are running.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbudget.eval.conversation import MODES
from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import later_turns

from .common import has_results
from .shared_context import Entry, shared_context_entries

SAMPLES = 20
TASKS = ("sc_keys", "sc_code", "sc_vt")
MAX_COMPRESS_SHARE = 0.25
MAX_BYTES_SHARE = 0.5
BYTES_TIE = 0.05
#: the configurations the grid runs for the rule (lab/scripts/byte_budget_grid.sh, "sc headline" and
#: "sc cheap points"): (label, compression ratio or None). SnapKV only where the headline has it: the
#: pilot had it losing later turns at every ratio (−64 to −84 points)
CANDIDATES = (
    ("snapkv", 0.875), ("snapkv:memory=0.125", None),
    *(("expected-attention", r) for r in (0.5, 0.75, 0.875)),
    ("expected-attention:memory=0.125", None), ("expected-attention:memory=0.0625", None),
    ("expected-attention:kv_bits=4", 0.5), ("expected-attention:kv_bits=4", 0.75),
    ("full:kv_bits=4", None), ("full:kv_bits=2", None),
)  # fmt: skip


#: the document method's candidates: the conversations' and KVzip's (lab/scripts/byte_budget_grid.sh,
#: "sc headline" and "sc points"), its compression paid once a document
DOCUMENT_CANDIDATES = (
    *CANDIDATES, ("kvzip", 0.875), ("kvzip:memory=0.125", None), ("kvzip:memory=0.0625", None),
    ("kvzip:kv_bits=4", 0.5), ("kvzip:kv_bits=4", 0.75),
)  # fmt: skip


@dataclass(frozen=True)
class Configuration:
    """One configuration's two modes, with its costs against the full cache."""

    label: str
    ratio: float | None
    modes: dict[str, Entry]
    bytes_share: float
    compress_share: float

    @property
    def name(self) -> str:
        return self.label if self.ratio is None else f"{self.label} r={self.ratio:g}"

    @property
    def eligible(self) -> bool:
        """A conversation default: cheap to compress and at most half the bytes."""
        return self.compress_share <= MAX_COMPRESS_SHARE and self.document_eligible

    @property
    def document_eligible(self) -> bool:
        """A document default: at most half the bytes (its compression is paid once)."""
        return self.bytes_share <= MAX_BYTES_SHARE

    @property
    def holds(self) -> bool:
        return all(e.verdict == "holds" for e in self.modes.values())

    @property
    def lowest(self) -> float:
        return min(e.difference.low for e in self.modes.values() if e.difference is not None)


def configurations(rows: list[dict]) -> list[Configuration]:
    """Every configuration with all of :data:`TASKS` at :data:`SAMPLES` samples in both modes."""
    entries = shared_context_entries([r for r in rows if r["task"] in TASKS])
    complete = [e for e in entries if e.tasks == len(TASKS) and e.n >= SAMPLES]
    full = {e.mode: e for e in complete if e.label == "full"}
    if set(full) != set(MODES):
        return []
    by_config: dict[tuple[str, float | None], dict[str, Entry]] = {}
    for e in complete:
        if e.label != "full" and e.difference is not None:
            by_config.setdefault((e.label, e.column[1] if e.column else None), {})[e.mode] = e
    full_bytes = full[MODES[0]].mean(lambda r: r["physical_bytes"])
    prefill = full[MODES[0]].mean(lambda r: r["prefill_s"])
    out = []
    for (label, ratio), modes in by_config.items():
        if set(modes) != set(MODES):
            continue
        first = modes[MODES[0]]
        share = first.mean(lambda r: r["physical_bytes"]) / full_bytes
        out.append(Configuration(label, ratio, modes, share, first.mean(lambda r: r["compress_s"]) / prefill))
    return sorted(out, key=lambda c: (c.bytes_share, c.name))


def choose(configs: list[Configuration], document: bool = False) -> tuple[Configuration | None, str]:
    """The rule's default among ``configs`` (``document``: the document method's, without the cost
    bound) and the clause that chose it."""
    candidates = [c for c in configs if (c.document_eligible if document else c.eligible)]
    if not candidates:
        return None, "no candidate"
    holding = [c for c in candidates if c.holds]
    if holding:
        fewest = min(c.bytes_share for c in holding)
        tied = [c for c in holding if c.bytes_share <= fewest * (1 + BYTES_TIE)]
        best = max(tied, key=lambda c: c.modes["multi-turn"].mean(later_turns))
        return best, "holds later turns in both modes with the fewest bytes"
    return max(candidates, key=lambda c: c.lowest), "none holds in both modes: the highest lower bound"


def _cell(e: Entry) -> str:
    d = e.difference
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] {e.verdict}"


def server_default_table(rows: list[dict]) -> list[str]:
    """The block: every complete configuration's costs and later-turn verdicts, then the default."""
    configs = configurations(rows)
    lines = [
        "| configuration | bytes ÷ full | compress ÷ prefill | multi-turn: later − full, verdict "
        "| multi-request: later − full, verdict | conversations' candidate | documents' candidate |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        lines.append(
            f"| {c.name} | {c.bytes_share:.2f} | {c.compress_share:.2f} | {_cell(c.modes['multi-turn'])} "
            f"| {_cell(c.modes['multi-request'])} | {'yes' if c.eligible else 'no'} "
            f"| {'yes' if c.document_eligible else 'no'} |"
        )
    for _, named, document, what in DEFAULTS:
        lines += ["", _decision(configs, named, what, document)]
    return lines


#: the two defaults the rule chooses: (key, candidates, a document's, how the block names it)
DEFAULTS = (
    ("conversations", CANDIDATES, False, "The conversations' default (`--method`)"),
    ("documents", DOCUMENT_CANDIDATES, True, "The documents' default (`--document-method`)"),
)


def missing(configs: list[Configuration], named) -> list[str]:
    """The ``named`` candidates without every sample yet."""
    done = {(c.label, c.ratio) for c in configs}
    return [f"{label}{'' if r is None else f' r={r:g}'}" for label, r in named if (label, r) not in done]


def _choice(configs: list[Configuration], named, document: bool) -> tuple[Configuration | None, str] | None:
    """The rule's choice among the ``named`` candidates and why; ``None`` while one is running."""
    if missing(configs, named):
        return None
    return choose([c for c in configs if (c.label, c.ratio) in set(named)], document)


def decisions(configs: list[Configuration]) -> dict[str, Configuration | None]:
    """The conversations' and the documents' defaults as the rule chose them; ``None`` while one of
    their candidates is still running (or none is a candidate)."""
    out: dict[str, Configuration | None] = {}
    for key, named, document, _ in DEFAULTS:
        chosen = _choice(configs, named, document)
        out[key] = chosen[0] if chosen else None
    return out


def _decision(configs: list[Configuration], named, what: str, document: bool) -> str:
    """The rule's decision for ``what``, or which of its ``named`` candidates are still running."""
    chosen = _choice(configs, named, document)
    if chosen is None:
        waiting = missing(configs, named)
        count = f"{len(waiting)} of {len(named)} candidates without {SAMPLES} samples of each task"
        return f"{what}: running ({count}: {', '.join(waiting)}); unchanged until then."
    best, why = chosen
    return f"**{what}: {best.name if best else 'none'}** ({why})."


def server_default_blocks(agnostic: Path) -> dict[str, list[str]]:
    """The ``server-default`` block, from the question-agnostic shared-context folder."""
    rows = load_rows(agnostic / "results.jsonl") if has_results(agnostic) else []
    return {"server-default": server_default_table(rows)}
