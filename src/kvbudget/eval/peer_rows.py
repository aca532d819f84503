"""kvpress's presses as extra rows of a ``kvbudget eval`` results directory (issue #20, item 4).

``kvbudget eval ... --peer-presses snapkv,streaming_llm,...`` runs, after kvbudget's own grid,
NVIDIA kvpress's presses on the same samples at the same compression ratios and appends their rows
to the same ``results.jsonl``, labelled ``kvpress:NAME`` (method and label), so the report ranks
them beside kvbudget's methods and says where each side's best stands (:mod:`kvbudget.eval.report`).

What is shared with :class:`kvbudget.eval.runner.Runner` (built from the same :class:`EvalConfig`):
the samples (its task generators, seed, ``limit``, ``max_new_tokens`` cap; the prompt ids come from
:func:`kvbudget.engine.build_prompt` with the tokenizer's chat template, split into context and
question exactly as the runner's prefill splits them), the end-of-answer ids, the row keys
(:meth:`Runner.key`: a kvpress row's method is ``kvpress:NAME`` and its options the press's
settings, so a rerun skips finished rows and a changed setting makes new ones), the row layout, and
the scoring: the kvpress side only decodes token ids; kvbudget decodes them to text as the runner
does and scores them with the task's own metric. The mode follows the run's
``compress_context_only``: question-agnostic (the context compressed, the question appended
uncompressed, as kvpress's pipeline) or question-aware (context and question compressed together).

The ratio goes to the press unchanged: kvpress keeps ``max(1, int(n · (1 − ratio)))`` entries per
KV head of the ``n`` compressed tokens (``kvpress.utils.compute_n_kept``), the count
:func:`kvbudget.eval.runner.ratio_budget` gives kvbudget's methods on the same ``n`` (the whole
prompt, or the context alone when question-agnostic); a kvpress row's ``budget`` is that count.
PyramidKV and the AdaKV-wrapped presses keep that many on average over layers or heads.

kvpress runs in its own environment (``make peer`` → ``.venv-peer``; kvpress 0.5.5 needs
transformers < 5.3) through :mod:`kvbudget.peer.kvpress_runner`, one serving process answering
one (sample, press, ratio) at a time; a run that raises becomes an error row (as the runner's),
a runner process that dies is restarted for the next run. Perplexity tasks are left out (kvpress
compresses a prompt once; it has no chunked-perplexity mode). Shared-context tasks run as kvpress's
pipeline runs several questions about one context — the context compressed once, question-
agnostically, and each question answered alone after it — so a kvpress row of such a task is a
``multi-request`` conversation row (:mod:`kvbudget.eval.conversation`), in the question-agnostic
track only.

A kvpress row has no ``agreement`` / ``kl`` (they need the full cache's log-probabilities in the
same process) and no per-head ``budgets``; ``full_score`` / ``full_prediction`` are those of the
run's ``full`` row for the sample when it has one (so retention is measured against kvbudget's
full cache). Its times are kvpress's process's: ``ttft_s`` to the prompt's last logits,
``compress_s`` the press's ``compress`` calls, ``tpot_s`` the mean decode step.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbudget.cache import model_entry_bytes
from kvbudget.errors import KVBudgetError
from kvbudget.eval.conversation import MODES
from kvbudget.eval.report import PEER_PREFIX as PREFIX  # every kvpress row's method and label start so
from kvbudget.eval.tasks.base import SHARED_CONTEXT

DEFAULT_PEER_PYTHON = Path(".venv-peer/bin/python")

#: the conversation mode kvpress's pipeline runs: several questions, each alone after one compressed context
MULTI_REQUEST = MODES[1]

#: kvpress's presses under the names of kvpress's own evaluation registry
#: (``evaluation/evaluate_registry.py``, ``PRESS_REGISTRY``, kvpress 0.5.5's source distribution) and
#: with the settings it runs them at — class defaults unless given. ``kwargs`` go to the press,
#: ``inner`` is the scorer press a wrapper takes as ``press`` (the ratio goes to the scorer);
#: ``attn`` the attention the model runs with (ObservedAttention needs eager attention);
#: ``question_delimiter``: FINCH's prompt, context + a delimiter id + question (its window is the
#: question). Some run question-aware only (:data:`QUESTION_AWARE_ONLY`).
#: Not in that registry, at their class defaults: ``leverage`` and ``non_causal_attn`` (Compactor's
#: two scorers alone) and ``cap`` (CapPress, added after the registry). ``NAME@paper``: the SnapKV
#: paper's window 32 and pooling kernel 7 (arXiv:2404.14469; PyramidKV and AdaKV compare at those,
#: PyramidKV with its β = 20, kvpress's default) in place of kvpress's window 64 and kernel 5 — the
#: settings of kvbudget's ``snapkv`` / ``ada-snapkv`` / ``pyramidkv``; the paper's max pooling cannot
#: be set (kvpress's SnapKV always average-pools). ``no_press`` (the full cache in kvpress's
#: environment) is not in ``all``.
PRESSES: dict[str, dict[str, Any]] = {
    "snapkv": {"press": "SnapKVPress"},
    "streaming_llm": {"press": "StreamingLLMPress"},
    "knorm": {"press": "KnormPress"},
    "tova": {"press": "TOVAPress"},
    "keydiff": {"press": "KeyDiffPress"},
    "expected_attention": {
        "press": "AdaKVPress", "inner": {"press": "ExpectedAttentionPress", "kwargs": {"epsilon": 0.01}}
    },
    "observed_attention": {"press": "ObservedAttentionPress", "attn": "eager"},
    "adakv_snapkv": {"press": "AdaKVPress", "inner": {"press": "SnapKVPress"}},
    "pyramidkv": {"press": "PyramidKVPress"},
    # --- kvpress 0.5.5's other prefill presses (issue #45, "kvpress at its best") ---
    "kvzip": {"press": "KVzipPress"},  # context reconstruction: two to three prefills
    "kvzip_plus": {"press": "KVzipPress", "kwargs": {"kvzip_plus_normalization": True}},
    "kvgrad": {"press": "KVgradPress"},  # KVzip's replay with a backward pass per chunk
    "chunkkv": {"press": "ChunkKVPress", "inner": {"press": "SnapKVPress"}, "kwargs": {"chunk_length": 20}},
    "entropy_gated_chunkkv": {"press": "EntropyGatedChunkKVPress", "inner": {"press": "SnapKVPress"}},
    "lagkv": {"press": "LagKVPress"},
    "compactor": {"press": "CompactorPress"},
    "adakv_compactor": {"press": "AdaKVPress", "inner": {"press": "CompactorPress"}},
    "leverage": {"press": "LeverageScorePress"},
    "non_causal_attn": {"press": "NonCausalAttnPress"},
    "cur": {"press": "CURPress"},
    "cap": {"press": "CapPress"},
    "finch": {"press": "FinchPress", "question_delimiter": True},
    "kvcompose": {"press": "KVComposePress"},  # a second, eager prefill scores the context
    "block_keydiff": {
        "press": "BlockPress", "inner": {"press": "KeyDiffPress"}, "kwargs": {"block_size": 128}
    },
    "critical_snapkv": {"press": "CriticalKVPress", "inner": {"press": "SnapKVPress"}},
    "critical_adakv_snapkv": {"press": "CriticalAdaKVPress", "inner": {"press": "SnapKVPress"}},
    "critical_expected_attention": {
        "press": "CriticalKVPress",
        "inner": {"press": "ExpectedAttentionPress", "kwargs": {"use_vnorm": False}},
    },
    "critical_adakv_expected_attention": {
        "press": "CriticalAdaKVPress",
        "inner": {"press": "ExpectedAttentionPress", "kwargs": {"use_vnorm": False}},
    },
    "merging_knorm": {"press": "MergingPress", "inner": {"press": "KnormPress"}},
    "merging_snapkv": {"press": "MergingPress", "inner": {"press": "SnapKVPress"}},
    "merging_expected_attention": {
        "press": "MergingPress", "inner": {"press": "ExpectedAttentionPress", "kwargs": {"epsilon": 0.01}}
    },
    "random": {"press": "RandomPress"},
    # --- the SnapKV paper's settings beside kvpress's defaults ---
    "snapkv@paper": {"press": "SnapKVPress", "kwargs": {"window_size": 32, "kernel_size": 7}},
    "adakv_snapkv@paper": {
        "press": "AdaKVPress",
        "inner": {"press": "SnapKVPress", "kwargs": {"window_size": 32, "kernel_size": 7}},
    },
    "pyramidkv@paper": {
        "press": "PyramidKVPress", "kwargs": {"window_size": 32, "kernel_size": 7, "beta": 20}
    },
    "no_press": {"press": None},
}  # fmt: skip
_LAYER_LENGTHS = (
    "its layers keep different numbers of entries, and the question's forward after a question-agnostic "
    "prefill then fails on the one attention mask built for all layers (sdpa, eager; kvpress's own "
    "evaluation uses flash attention where installed, CUDA only); one-token decode steps need no mask"
)
#: presses that run question-aware only, with the reason: ``all`` leaves them out of a
#: question-agnostic run, and naming one there is a one-line error
QUESTION_AWARE_ONLY: dict[str, str] = {
    "finch": "its window is the question, which a question-agnostic run leaves out of the compressed prefill",
    "pyramidkv": _LAYER_LENGTHS,
    "pyramidkv@paper": _LAYER_LENGTHS,
    "kvcompose": _LAYER_LENGTHS,
}
#: kvpress 0.5.5's presses that cannot run here, each with the reason (``press_names`` refuses them
#: with it): those that load trained weights, head patterns or statistics from the Hugging Face hub or
#: GitHub (the leaderboard runs offline, and most are published for a few large models only), those
#: that do not compress the prefill at a compression ratio, and wrappers or utilities that only make
#: sense around other presses. Names as kvpress's registry spells them, else the class's name.
_KVZAP = "KVzapPress loads its trained surrogate model from the hub"
_DECODING = "compresses while decoding (to 2048 entries every 512 steps), not the prefill"
UNAVAILABLE_PRESSES: dict[str, str] = {
    "qfilter": "QFilterPress loads the authors' trained Q-filters from the hub (nthngdy/<model>_qfilt) on "
    "entering the press; it takes no filters of ours (kvbudget's own `qfilter` computes them locally)",
    "fastkvzip": "FastKVzipPress loads the authors' trained gates from the hub (Jang-Hyun/Fast-KVzip)",
    "restorekv": "RestoreKVPress loads restore embeddings and LoRA adapters from the hub "
    "(higokri/RestoreKV-<model>)",
    "restorekv_plus": "RestoreKVPress loads restore embeddings and LoRA adapters from the hub "
    "(higokri/RestoreKV-<model>_plus)",
    "kvzap_linear": _KVZAP + " (under DMSPress's threshold)",
    "kvzap_mlp": _KVZAP + " (under DMSPress's threshold)",
    "kvzap_mlp_head": _KVZAP,
    "kvzap_mlp_layer": _KVZAP,
    "merging_kvzap_mlp": _KVZAP,
    "duo_attention": "DuoAttentionPress downloads head patterns from GitHub (mit-han-lab/duo-attention), "
    "published for a few large models only",
    "duo_attention_on_the_fly": "DuoAttentionPress's on-the-fly head patterns need the BookSum data set "
    "from the hub",
    "expected_attention_stats": "ExpectedAttentionStatsPress loads query statistics from the hub (or "
    "computes them on the BookSum data set from the hub)",
    "lukv": "LUKVPress downloads budget curves from GitHub (baidu-baige/LU-KV), published for "
    "Llama-3.1-8B only",
    "kvcompose_unstructured": "KVComposePress(structured=False) leaves its replay pass's copy of the "
    "context in the cache (kvpress 0.5.5): the question attends to a second, uncompressed copy",
    "dms": "DMSPress evicts below a score threshold: no compression ratio to match (the registry runs "
    "it around KVzap only)",
    "simlayerkv": "SimLayerKVPress keeps a data-dependent amount (a lazy-layer threshold): no "
    "compression ratio",
    "think": "ThinKPress prunes key channels, not tokens (zeroed in place: no memory saved), at a "
    "key-channel ratio",
    "snap_think": "ThinKPress (composed with SnapKV) prunes key channels at a second, key-channel ratio",
    **{
        f"cam_{scorer}": "CAMPress " + _DECODING
        for scorer in ("streaming_llm", "knorm", "adakv_snapkv", "tova")
    },
    "decoding": "DecodingPress " + _DECODING,
    **{
        f"decoding_{scorer}": "DecodingPress " + _DECODING
        for scorer in (
            "knorm",
            "streaming_llm",
            "tova",
            "qfilter",
            "adakv_expected_attention_e2",
            "adakv_snapkv",
            "keydiff",
        )
    },
    "compression_ratio_decoding": "CompressionRatioDecodingPress compresses while decoding, not the prefill",
    "prefill_decoding": "PrefillDecodingPress only pairs a prefill press with a decoding press",
    "composed": "ComposedPress only chains other presses",
    "key_rerotation": "KeyRerotationPress only re-rotates the keys another press keeps",
    "chunk": "ChunkPress only runs another press chunk by chunk",
    "per_layer_compression": "PerLayerCompressionPress only gives another press per-layer ratios (flash "
    "attention only)",
}
#: other spellings accepted on the command line (also before a variant's ``@``)
ALIASES = {
    "streamingllm": "streaming_llm", "adakv": "adakv_snapkv", "ada-snapkv": "adakv_snapkv",
    "kvzip+": "kvzip_plus", "restorekv+": "restorekv_plus",
}  # fmt: skip


#: transformers' ``QuantizedCache`` as kvpress's pipeline takes it (``pipe(..., cache=...)``): a press
#: name ``NAME+CACHE`` runs press ``NAME`` (``no_press``: none) on that cache, which stores the kept
#: entries quantized (kvpress requantizes a layer after compressing it). The settings are
#: transformers 5.2's defaults (quanto backend, ``q_group_size`` 64, ``axis_key`` = ``axis_value`` =
#: 0, a full-precision residual of 128 tokens): the anchors of the equal-bytes comparison.
CACHES: dict[str, dict[str, Any]] = {
    f"quanto{bits}": {"backend": "quanto", "nbits": bits, "q_group_size": 64, "residual_length": 128}
    for bits in (4, 2)
}


def split_cache(name: str) -> tuple[str, str | None]:
    """``snapkv+quanto4`` → (``snapkv``, ``quanto4``); a name without a ``+CACHE`` (``kvzip+`` is
    KVzip+, not a cache) → (name, ``None``)."""
    base, _, cache = name.rpartition("+")
    return (base, cache) if base and cache else (name, None)


def canonical_name(raw: str) -> str:
    """``raw`` as the tables spell it: lower case, ``kvpress:`` dropped, aliases and ``-`` for ``_``
    resolved (``Ada-SnapKV@paper`` → ``adakv_snapkv@paper``), a ``+CACHE`` kept as it is."""
    press, cache = split_cache(raw.strip().lower().removeprefix(PREFIX))
    base, at, variant = press.partition("@")
    return ALIASES.get(base, base.replace("-", "_")) + at + variant + (f"+{cache}" if cache else "")


def press_names(names: list[str], question_aware: bool = True) -> list[str]:
    """Canonical press names for ``names`` (``all`` = every press but ``no_press``, and for a
    question-agnostic run, ``question_aware`` false, but those of :data:`QUESTION_AWARE_ONLY` too;
    aliases and ``-`` for ``_`` accepted; duplicates dropped); a one-line error naming why for an
    unknown name, a press that cannot run here (:data:`UNAVAILABLE_PRESSES`) and a question-aware-only
    press named for a question-agnostic run."""
    chosen: list[str] = []
    for raw in names:
        name, cache = split_cache(canonical_name(raw))
        if cache is not None:
            if cache not in CACHES:
                raise KVBudgetError(
                    f"unknown cache '{cache}' in kvpress press '{raw}': expected one of {', '.join(CACHES)}"
                )
            if name == "all":
                raise KVBudgetError(f"name presses one by one with a cache, not 'all' ('{raw}')")
            press_names([name], question_aware)  # the press itself: its own one-line error
            chosen.append(f"{name}+{cache}")
            continue
        if name == "all":
            chosen += [
                n for n in PRESSES if n != "no_press" and (question_aware or n not in QUESTION_AWARE_ONLY)
            ]
        elif name in PRESSES:
            if not question_aware and name in QUESTION_AWARE_ONLY:
                raise KVBudgetError(
                    f"kvpress press '{raw}' runs question-aware only: {QUESTION_AWARE_ONLY[name]}"
                )
            chosen.append(name)
        elif name in UNAVAILABLE_PRESSES:
            raise KVBudgetError(f"kvpress press '{raw}' cannot run here: {UNAVAILABLE_PRESSES[name]}")
        else:
            known = ", ".join([*PRESSES, "all"])
            raise KVBudgetError(f"unknown kvpress press '{raw}': expected some of {known}")
    if not chosen:
        raise KVBudgetError("no kvpress press given: expected some of " + ", ".join([*PRESSES, "all"]))
    return list(dict.fromkeys(chosen))


def peer_python(path: str | os.PathLike[str] = DEFAULT_PEER_PYTHON) -> tuple[Path, str]:
    """The kvpress environment's Python and its versions (``kvpress 0.5.5 / transformers 5.2.0``),
    checked without importing torch; a one-line error when it is missing or lacks kvpress."""
    from kvbudget.peer.environment import peer_python_path

    python = peer_python_path(path)
    if python is None:
        raise KVBudgetError(
            f"no kvpress environment at {path}: run `make peer` first (or give --peer-python)"
        )
    code = (
        "import importlib.metadata as m\n"
        "print('kvpress', m.version('kvpress'), '/ transformers', m.version('transformers'))"
    )
    proc = subprocess.run([str(python), "-P", "-c", code], capture_output=True, text=True, env=_peer_env())
    if proc.returncode != 0:
        raise KVBudgetError(f"{python} has no kvpress installed: run `make peer` (it builds .venv-peer)")
    return python, proc.stdout.strip()


def _peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peer environment must not see this checkout's kvbudget
    return env


@dataclass(frozen=True)
class PressSpec:
    """A kvpress press as the runner's rows name a method: ``name`` ``kvpress:NAME`` (method and
    label), ``options`` the press's settings (in the row key, so other settings make other rows).
    A press stores its cache in the model's dtype, under no byte budget (``kv_bits``, ``memory``:
    ``None``, as a :class:`~kvbudget.methods.spec.MethodSpec` without them)."""

    name: str
    options: tuple[tuple[str, str], ...]
    kv_bits: int | None = None
    memory: float | None = None

    @classmethod
    def of(cls, press: str) -> PressSpec:
        """``press``: a name of :data:`PRESSES`, or ``NAME+CACHE`` (the cache's settings join the
        options, its bits are the row's ``kv_bits``)."""
        base, cache = split_cache(press)
        settings = dict(PRESSES[base])
        if cache is not None:
            settings["cache"] = CACHES[cache]
        options = tuple(
            (key, value if isinstance(value, str) else json.dumps(value, sort_keys=True))
            for key, value in sorted(settings.items())
            if value is not None
        )
        return cls(PREFIX + press, options, kv_bits=CACHES[cache]["nbits"] if cache else None)

    @property
    def press(self) -> str:
        """The press's name in :data:`PRESSES` (without a ``+CACHE``)."""
        return split_cache(self.name.removeprefix(PREFIX))[0]

    @property
    def label(self) -> str:
        return self.name


def eval_tasks_only(runner) -> Iterator[tuple[Any, int, int, Any]]:
    """The runner's (task, length, index, sample) grid without perplexity tasks, and without
    shared-context tasks where the run is question-aware (kvpress's pipeline answers several
    questions about one context with the context compressed alone)."""
    for task, length, index, sample in runner.samples():
        if task.family == "perplexity":
            continue
        if task.family == SHARED_CONTEXT and not runner.config.compress_context_only:
            continue
        yield task, length, index, sample


def peer_key(runner, task, sample, spec, ratio: float | None) -> str:
    """A kvpress row's key: a shared-context task's row is its multi-request conversation."""
    mode = MULTI_REQUEST if task.family == SHARED_CONTEXT else None
    return runner.key(task, sample, spec, None, ratio, conversation=mode)


def export_sample(runner, task, length: int, index: int, sample) -> dict[str, Any]:
    """The kvpress runner's sample: the prompt ids the runner prefills, split where its question-
    agnostic prefill splits them (context / question), with the answer length and end-of-answer ids."""
    from kvbudget.engine import build_prompt

    prompt = build_prompt(runner.tokenizer, sample.context, sample.question, sample.answer_prefix)
    exported = {
        "id": f"{task.name}/{length}/{index}", "task": task.name, "length": length,
        "context_ids": prompt.context_ids, "question_ids": prompt.question_ids,
        "max_new_tokens": sample.max_new_tokens, "eos_ids": sorted(runner.eos),
    }  # fmt: skip
    if sample.follow_ups:
        follow_ups = []
        for turn in sample.follow_ups:
            later = build_prompt(runner.tokenizer, sample.context, turn.question, turn.answer_prefix)
            if later.context_ids != prompt.context_ids:
                raise KVBudgetError(
                    "the context tokenises differently before different questions: cannot share it"
                )
            follow_ups.append({"question_ids": later.question_ids, "max_new_tokens": turn.max_new_tokens})
        exported["follow_ups"] = follow_ups
    return exported


def _turns_of(runner, task, sample, result: dict, reference: dict) -> list[dict[str, Any]]:
    """A kvpress multi-request row's turns, scored as the runner scores its own (the full cache's
    answers from kvbudget's ``full`` row of the same sample and mode, when it has one)."""
    eos, decode = runner.eos, runner.tokenizer.decode
    answers = [result, *result["follow_ups"]]
    full_turns = reference.get("turns") or []
    turns = []
    for number, (turn, answer) in enumerate(zip(sample.turns(), answers, strict=True), 1):
        ids = answer["token_ids"]
        text = decode(ids[:-1] if ids and ids[-1] in eos else ids, skip_special_tokens=True)
        full = full_turns[number - 1] if len(full_turns) >= number else {}
        turns.append({
            "turn": number, "question": turn.question, "answers": turn.answers,
            "meta": {k: v for k, v in turn.meta.items() if isinstance(v, (int, float, str))},
            "prediction": text, "score": task.metric(text, turn.answers),
            "full_prediction": full.get("prediction"), "full_score": full.get("score"), "agreement": None,
            "ttft_s": answer["prefill_s"], "decode_s": sum(answer["step_s"]), "kv_bytes": None,
            "entries": None, "draft_accepted": 0,
        })  # fmt: skip
    return turns


def make_jobs(presses: list[str], ratios: list[float], question_aware: bool) -> list[dict[str, Any]]:
    """One job per (press, ratio) — ``no_press`` once, without a ratio."""
    jobs = []
    for name in presses:
        press, cache = split_cache(name)
        for ratio in [None] if PRESSES[press]["press"] is None else ratios:
            jobs.append({**PRESSES[press], "method": PREFIX + name, "budget": None,
                         "compression_ratio": ratio, "question_aware": question_aware,
                         **({"cache": CACHES[cache]} if cache else {})})  # fmt: skip
    return jobs


class _Server:
    """The kvpress runner serving requests (restarted after a run that kills it)."""

    def __init__(self, python: Path, model_dir: Path, work: Path, dtype: str) -> None:
        from kvbudget.peer.environment import runner_script

        self.command = [
            str(python), "-P", str(runner_script()), "--model", str(model_dir),
            "--samples", str(work / "samples.jsonl"), "--jobs", str(work / "jobs.json"), "--dtype", dtype,
            "--warmup", "--serve", "--keep-going",
        ]  # fmt: skip
        self.log = work / "kvpress.log"
        self.server = None

    def run(self, sample: int, job: int) -> dict[str, Any]:
        from kvbudget.peer.environment import RunnerServer

        if self.server is None:  # a runner that cannot start is the user's error: raised
            self.server = RunnerServer("kvpress", self.command, self.log, _peer_env())
        try:
            return self.server.run(sample, job)
        except KVBudgetError as err:  # the process died mid-run: this run is an error row
            self.server = None
            lines = [line for line in str(err).splitlines() if line.strip()]
            return {"error": "the kvpress runner stopped: " + (lines[-1].strip() if lines else "")}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def run_peer_rows(
    config,
    out: Path,
    presses: list[str],
    python: str | os.PathLike[str] = DEFAULT_PEER_PYTHON,
    progress: bool = True,
    model=None,
    tokenizer=None,
) -> int:
    """Append the kvpress rows of ``config``'s grid (``presses`` × its compression ratios) missing
    from ``out/results.jsonl``; returns how many rows were written. The peer environment is checked
    first (one-line error), before any model loads."""
    from tqdm.auto import tqdm

    from kvbudget.eval.runner import MethodSpec, Runner, ratio_budget
    from kvbudget.models import resolve_source

    names = press_names(presses, question_aware=not config.compress_context_only)
    python_path, versions = peer_python(python)
    if not config.compression_ratios and any(PRESSES[split_cache(n)[0]]["press"] is not None for n in names):
        raise KVBudgetError("kvpress rows run at compression ratios: give --compression-ratios")
    runner = Runner(config, Path(out), model=model, tokenizer=tokenizer, progress=False)
    config = runner.config  # normalised (dtype, ratios) as the runner keys its rows
    lm_config = runner.model.config
    layers, heads = lm_config.num_hidden_layers, lm_config.num_key_value_heads
    entry_bytes = model_entry_bytes(lm_config, runner.model.dtype)  # one key and one value
    model_dir = resolve_source(config.model)
    jobs = make_jobs(names, config.compression_ratios, question_aware=not config.compress_context_only)
    specs = [PressSpec.of(job["method"].removeprefix(PREFIX)) for job in jobs]
    full = MethodSpec.parse("full")

    done = runner.store.keys
    by_key = {row["key"]: row for row in runner.store.rows}
    samples: list[dict[str, Any]] = []
    pending: list[tuple[int, int, tuple]] = []  # (sample index in the export, job index, grid entry)
    for entry in eval_tasks_only(runner):
        task, _, _, sample = entry
        todo = [j for j, (spec, job) in enumerate(zip(specs, jobs, strict=True))
                if peer_key(runner, task, sample, spec, job["compression_ratio"]) not in done]  # fmt: skip
        if todo:
            samples.append(export_sample(runner, *entry))
            pending += [(len(samples) - 1, j, entry) for j in todo]
    if not pending:
        return 0
    runner.model = None  # kvpress's process loads its own copy
    work = Path(out) / "kvpress"
    work.mkdir(parents=True, exist_ok=True)
    (work / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (work / "jobs.json").write_text(json.dumps(jobs, indent=1))

    server = _Server(python_path, model_dir, work, config.dtype)
    bar = tqdm(total=len(pending), disable=not progress, desc="kvpress", unit="run", dynamic_ncols=True)
    try:
        for s, j, (task, length, index, sample) in pending:
            spec, ratio = specs[j], jobs[j]["compression_ratio"]
            bar.set_description(f"kvpress {task.name} {length} #{index}")
            result = server.run(s, j)
            n = result.get("compressed_tokens")
            entries = None if ratio is None or n is None else ratio_budget(ratio, n)
            mode = MULTI_REQUEST if task.family == SHARED_CONTEXT else None
            row = runner._base_row(task, length, index, sample, (spec, None, ratio), entries, mode)
            cache = jobs[j].get("cache")
            row.update(
                shared_prefill=False,
                peer={"library": "kvpress", "versions": versions, **PRESSES[spec.press],
                      **({"cache": f"transformers QuantizedCache {cache}"} if cache else {})},
            )  # fmt: skip
            if result.get("error") is not None:
                row.update(prediction=None, score=None, error=result["error"])
            else:
                ids, eos = result["token_ids"], runner.eos
                text = runner.tokenizer.decode(
                    ids[:-1] if ids and ids[-1] in eos else ids, skip_special_tokens=True
                )
                reference = by_key.get(peer_key(runner, task, sample, full, None), {})
                exported = samples[s]
                question = 0 if jobs[j]["question_aware"] else len(exported["question_ids"])
                appended = layers * heads * question  # the question's entries, appended after compression
                steps = result["step_s"]
                # a QuantizedCache's bytes as stored (codes, scales, shifts, the residual), measured by
                # the runner; else entries in the model's dtype. The question's entries: full precision
                stored = result.get("kv_bytes")
                physical = stored if stored is not None else result["allocated_entries"] * entry_bytes
                logical = stored if stored is not None else result["kept_entries"] * entry_bytes
                row.update(
                    prediction=text, score=task.metric(text, sample.answers),
                    full_prediction=reference.get("prediction"), full_score=reference.get("score"),
                    agreement=None, kl=None,
                    prompt_tokens=len(exported["context_ids"]) + len(exported["question_ids"]),
                    compressed_tokens=n, ttft_s=result["prefill_s"],
                    prefill_s=result["prefill_s"] - result["compress_s"], compress_s=result["compress_s"],
                    lookahead_s=0.0, reselect_s=0.0, tpot_s=sum(steps) / len(steps) if steps else None,
                    draft_accepted=0, seconds=result["wall_s"], kept_entries=result["kept_entries"],
                    logical_bytes=logical + appended * entry_bytes,
                    physical_bytes=physical + appended * entry_bytes,
                    budgets=None, selection_layer=None, error=None,
                )  # fmt: skip
                if mode is not None:
                    turns = _turns_of(runner, task, sample, result, reference)
                    row.update(
                        turns=turns, score=sum(t["score"] for t in turns) / len(turns),
                        full_score=reference.get("score"), held_bytes=None,
                    )  # fmt: skip
            row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            runner.store.append(row)
            bar.update(1)
    finally:
        bar.close()
        server.close()
    return len(pending)
