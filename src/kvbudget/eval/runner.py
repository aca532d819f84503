"""The evaluation grid runner: tasks × lengths × samples × methods × budgets.

Shared prefill (default): each sample is prefilled once with the full cache
(:func:`kvbudget.prefill.derived.take_snapshot`); the full-cache answer, its teacher-forced
log-probabilities and every (method, budget) cache derive from that snapshot. Prune-stage methods
(ASL, FastKV, GemFilter, PyramidInfer) change the prefill forward only after the layer where they
cut: when the grid has one, the snapshot keeps each layer's hidden states and such a method runs
only its deeper layers on the kept tokens (:func:`kvbudget.prefill.pruned.derive_pruned`). With
``shared=False`` every run prefills on its own (layer-wise compression, as ``generate`` does) —
the two give bit-identical predictions; the shared one is several times faster.

Budgets come two ways: entries per KV head (``budgets``), or compression ratios
(``compression_ratios``) with kvpress's meaning — the fraction of the compressed tokens removed, so
a sample of ``n`` compressed tokens keeps ``max(1, int(n · (1 − ratio)))`` entries per KV head, the
count kvpress's ``ScorerPress.compress`` keeps. The compressed tokens are the whole prompt, or
only the context with ``compress_context_only`` (kvpress's default, ``query_aware=False``). A ratio
row records both: ``compression_ratio`` and the resulting ``budget``.

Rows go to ``DIR/results.jsonl`` (see :mod:`kvbudget.eval.store`): one per sample × method ×
budget (or ratio), keyed by a config hash that holds the ratio for ratio rows; a rerun skips
finished rows, so adding a method, budget or ratio to the same command runs only the new rows
(``methods=["all"]`` takes every registered method at run time: a method registered later is
added by rerunning the command). A crashing run becomes an error row and the grid goes on.

One sample is the unit of work (:meth:`Runner.run_sample`: its shared prefill and every pending
(method, budget) run, each row handed to a callback as it is made), so a sample can run elsewhere
and its rows be written here: :mod:`kvbudget.eval.distributed` runs samples on Ray actors (each
a ``Runner`` with no results file) while the driver's ``Runner`` (no model) writes the rows.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget import engine, models
from kvbudget.engine import RunTimes, build_prompt, decode_loop, prefill_inputs, selection_layer
from kvbudget.errors import BudgetError, KVBudgetError
from kvbudget.eval.conversation import MODES, Conversation, TurnOutcome, check_shareable
from kvbudget.eval.draft import decode_with_draft
from kvbudget.eval.fidelity import mean_kl, teacher_forced_logprobs, token_agreement
from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.store import ResultStore, config_key
from kvbudget.eval.tasks import get_task
from kvbudget.eval.tasks.base import SHARED_CONTEXT, TaskSpec
from kvbudget.eval.tasks.perplexity import CONTEXT_SHARE, chunked_perplexity, scored_from
from kvbudget.methods.base import Method
from kvbudget.methods.registry import make_method, method_names
from kvbudget.methods.spec import MethodSpec
from kvbudget.models import resolve_dtype
from kvbudget.phases import Stage
from kvbudget.prefill.common import Snapshot, eos_ids
from kvbudget.prefill.derived import derive, take_snapshot
from kvbudget.session import CompressionSession


def ratio_budget(compression_ratio: float, compressed_tokens: int) -> int:
    """Entries per KV head left when ``compression_ratio`` of ``compressed_tokens`` are removed.

    kvpress's definition (``ScorerPress``: "fraction of key-value pairs to remove"; it keeps
    ``max(1, int(k_len * (1 - compression_ratio)))``): ratio 0.75 keeps a quarter of the tokens.
    """
    return max(1, int(compressed_tokens * (1 - compression_ratio)))


def expand_methods(methods: list[str]) -> list[str]:
    """``all`` → every registered method (in registry order), at its place; duplicates dropped."""
    expanded: list[str] = []
    for method in methods:
        for name in method_names() if method.strip() == "all" else [method]:
            if name not in expanded:
                expanded.append(name)
    return expanded


@dataclass
class EvalConfig:
    """What to run; ``limit`` samples per task and length.

    ``budgets`` are entries per KV head; ``compression_ratios`` are fractions of the compressed
    tokens removed (kvpress's ``compression_ratio``, in [0, 1)), turned into entries per KV head
    per sample by :func:`ratio_budget`. ``methods`` may hold ``all`` (every registered method).
    ``dtype``: float32, bfloat16 or float16 (aliases such as bf16 are normalised).
    """

    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: ["needle"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "ada-snapkv"])
    budgets: list[int] = field(default_factory=lambda: [64, 128])
    compression_ratios: list[float] = field(default_factory=list)
    limit: int = 5
    seed: int = 0
    compress_context_only: bool = False
    shared: bool = True
    dtype: str = "float32"
    max_new_tokens: int | None = None  # caps every task's own generation length when set


@dataclass
class Conversed:
    """One run of a shared-context sample: its turns by mode, and what the compression cost.

    ``stats``: the cache's (:meth:`BudgetCache.stats`) right after the first prompt's compression;
    ``budgets``: entries kept per layer and KV head then."""

    turns: dict[str, list[TurnOutcome]]
    prefill_s: float
    compress_s: float
    stats: dict[str, Any]
    budgets: list[list[int]]
    prompt_tokens: int


@dataclass
class RunOutcome:
    """One (method, budget) run on one sample, before scoring."""

    token_ids: list[int]
    text: str
    logprobs: torch.Tensor | None
    ttft_s: float
    prefill_s: float
    compress_s: float
    tpot_s: float
    stats: dict[str, Any]
    budgets: list[list[int]]
    draft_accepted: int = 0
    lookahead_s: float = 0.0  # lookahead methods: parts of compress_s
    reselect_s: float = 0.0
    selection_layer: int | None = None


class Runner:
    """Runs an :class:`EvalConfig` into ``out/results.jsonl``."""

    def __init__(
        self,
        config: EvalConfig,
        out: Path,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        progress: bool = True,
        sample_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        device: str | torch.device = "cpu",
        load: bool = True,
    ) -> None:
        """``sample_guard``, when given, makes a context manager entered around each sample's runs
        (e.g. a lock that lets other jobs on the machine take turns between samples).

        ``out=None``: no results file is opened (a worker that only computes rows, see
        :meth:`run_sample`). ``device``: where a model loaded here goes (``cpu``, ``cuda``,
        ``auto``). ``load=False``: no model at all, a driver that plans the grid and writes rows
        computed elsewhere (its ``tokenizer``, which :meth:`samples` needs, may be set later)."""
        dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")  # one-line error when unknown
        for ratio in config.compression_ratios:
            if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and 0.0 <= ratio < 1.0):
                raise BudgetError(
                    f"compression ratio must be in [0, 1) (the fraction of tokens removed, as kvpress), "
                    f"got {ratio!r}"
                )
        config = dataclasses.replace(
            config, dtype=dtype, methods=expand_methods(config.methods),
            compression_ratios=[float(r) for r in config.compression_ratios],
        )  # fmt: skip
        self.config = config
        self.out = Path(out) if out is not None else None
        self.progress = progress
        self.sample_guard = sample_guard or contextlib.nullcontext
        self.tasks = [get_task(name) for name in config.tasks]
        self.specs = [MethodSpec.parse(m) for m in config.methods]
        for budget in config.budgets:
            if budget <= 0:
                raise KVBudgetError(f"budgets must be positive, got {budget}")
        if not config.budgets and not config.compression_ratios and any(s.name != "full" for s in self.specs):
            raise BudgetError("no budgets: give budgets (entries per KV head) or compression ratios")
        if load and (model is None or tokenizer is None):
            model, tokenizer = models.load_model(config.model, dtype=config.dtype, device=device)
        self.model, self.tokenizer = model, tokenizer
        self.store = ResultStore(self.out / "results.jsonl") if self.out is not None else None
        if model is not None:
            self.eos = eos_ids(model, tokenizer)
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # ------------------------------------------------------------------ grid
    def runs(self) -> list[tuple[MethodSpec, int | None, float | None]]:
        """The (method, budget, compression ratio) runs of one sample: each method at every budget
        (ratio ``None``) and every ratio (budget ``None``); ``full`` runs once, with neither."""
        triples: list[tuple[MethodSpec, int | None, float | None]] = []
        for spec in self.specs:
            if spec.name == "full" or spec.memory is not None:  # once: no budget or ratio of its own
                triples.append((spec, None, None))
            else:
                triples.extend((spec, b, None) for b in self.config.budgets)
                triples.extend((spec, None, r) for r in self.config.compression_ratios)
        return triples

    def samples(self) -> Iterator[tuple[TaskSpec, int, int, Sample]]:
        for task in self.tasks:
            for length in self.config.lengths:
                for index, sample in enumerate(
                    task.make_samples(self.tokenizer, length, self.config.limit, self.config.seed)
                ):
                    if self.config.max_new_tokens is not None:
                        sample.max_new_tokens = min(sample.max_new_tokens, self.config.max_new_tokens)
                    yield task, length, index, sample

    def key(
        self,
        task: TaskSpec,
        sample: Sample,
        spec: MethodSpec,
        budget: int | None,
        ratio: float | None = None,
        conversation: str | None = None,
    ) -> str:
        """The row's config hash; a ratio row's holds the ratio (budget rows' keys are as before ratios);
        a shared-context row's holds its follow-up questions and its mode (``conversation``)."""
        fields = {
            "model": self.config.model, "task": task.name, "context": config_key({"c": sample.context}),
            "question": sample.question, "prefix": sample.answer_prefix, "max_new": sample.max_new_tokens,
            "method": spec.name, "options": spec.options, "budget": budget,
            "agnostic": self.config.compress_context_only, "dtype": self.config.dtype,
        }  # fmt: skip
        if spec.kv_bits is not None:  # rows stored in the model's dtype keep their keys
            fields["kv_bits"] = spec.kv_bits
        if spec.memory is not None:
            fields["memory"] = spec.memory
        if ratio is not None:
            fields["compression_ratio"] = ratio
        if task.family == "perplexity":  # rows scored on another span are other rows
            fields["context_share"] = CONTEXT_SHARE
        if conversation is not None:
            fields["follow_ups"] = [
                (t.question, t.answer_prefix, t.max_new_tokens) for t in sample.follow_ups
            ]
            fields["conversation"] = conversation
        return config_key(fields)

    def row_keys(self, task: TaskSpec, sample: Sample, run: tuple) -> list[str]:
        """The keys of the rows one (method, budget, ratio) run of a sample writes: one, or one per
        conversation mode for a shared-context task."""
        if task.family == SHARED_CONTEXT:
            return [self.key(task, sample, *run, conversation=mode) for mode in MODES]
        return [self.key(task, sample, *run)]

    def pending_runs(
        self, task: TaskSpec, sample: Sample, done: set[str]
    ) -> list[tuple[MethodSpec, int | None, float | None]]:
        """The runs of a sample with a row not in ``done``."""
        return [run for run in self.runs() if any(k not in done for k in self.row_keys(task, sample, run))]

    def run(self) -> Path:
        """Run every missing row; returns the results path."""
        grid = list(self.samples())
        done = self.store.keys
        todo = sum(len(self.pending_runs(t, s, done)) for t, _, _, s in grid)
        bar = tqdm(total=todo, disable=not self.progress, desc="eval", unit="run", dynamic_ncols=True)
        for task, length, index, sample in grid:
            pending = self.pending_runs(task, sample, done)
            if not pending:
                continue
            bar.set_description(f"{task.name} {length} #{index}")
            last_keys = {self.row_keys(task, sample, run)[-1] for run in pending}

            def write(row: dict, last_keys: set[str] = last_keys) -> None:
                if row["key"] in done:  # a shared-context run whose other mode's row was written before
                    return
                self.store.append(row)
                if row["key"] in last_keys:
                    bar.update(1)

            with self.sample_guard():
                self.run_sample(task, length, index, sample, pending, write)
        bar.close()
        return self.store.path

    # ------------------------------------------------------------------ one sample
    def run_sample(
        self,
        task: TaskSpec,
        length: int,
        index: int,
        sample: Sample,
        pending: list[tuple[MethodSpec, int | None, float | None]],
        emit: Callable[[dict], None],
    ) -> None:
        """Run ``pending`` (method, budget, ratio) runs of one sample, handing each row to ``emit`` as
        it is made (a run that crashes gives an error row). When the sample itself fails (its
        prompt, its full-cache reference run), every run not yet emitted becomes an error row."""
        emitted: set[str] = set()

        def once(row: dict) -> None:
            emitted.add(row["key"])
            emit(row)

        try:
            self._run_sample(task, length, index, sample, pending, once)
        except Exception as err:
            for run in pending:
                for row in self.error_rows(task, length, index, sample, run, None, err):
                    if row["key"] not in emitted:
                        once(row)

    def _run_sample(
        self, task: TaskSpec, length: int, index: int, sample: Sample, pending: list, emit: Callable
    ) -> None:
        if task.family == "perplexity":
            self._run_perplexity(task, length, index, sample, pending, emit)
            return
        if task.family == SHARED_CONTEXT:
            self._run_shared_context(task, length, index, sample, pending, emit)
            return
        prompt = build_prompt(self.tokenizer, sample.context, sample.question, sample.answer_prefix)
        inputs = prefill_inputs([prompt], self.pad_id, self.config.compress_context_only)
        methods = [run[0].build() for run in pending]
        prune = any(Stage.PRUNE in method.stages for method in methods)  # they derive from hidden states
        inputs_read = any(method.wants_attention_inputs for method in methods)  # KVzap scores from them
        snapshot = (
            take_snapshot(self.model, inputs, hidden_states=prune, attention_inputs=inputs_read)
            if self.config.shared
            else None
        )
        reference = self._run_one(snapshot, prompt, sample, make_method("full"), None, teacher=None)
        answers: list[list[int]] = []  # earlier runs' answers: drafts for the later ones
        for run in pending:
            spec, budget, ratio = run
            entries = budget if ratio is None else ratio_budget(ratio, inputs.compressed_until)
            if spec.name == "full" and spec.kv_bits is None:
                outcome = reference
            else:
                try:
                    outcome = self._run_one(
                        snapshot, prompt, sample, spec.build(), entries, teacher=reference,
                        candidates=answers, kv_bits=spec.kv_bits, memory=spec.memory,
                    )  # fmt: skip
                    answers.insert(0, outcome.token_ids)
                except Exception as err:
                    emit(self._error_row(task, length, index, sample, run, entries, err))
                    continue
            row = self._result_row(
                task, length, index, sample, run, entries, outcome, reference, len(prompt.ids)
            )
            emit(row)

    def _compressed(
        self,
        snapshot: Snapshot | None,
        prompt: Any,
        method: Method,
        budget: int | None,
        kv_bits: int | None = None,
        memory: float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """``prompt``'s cache compressed by ``method`` to ``budget`` (default: the prompt's length),
        derived from ``snapshot`` or prefilled on its own, and stored at ``kv_bits``; the cache, last
        logits, mask and last position (what decoding continues from: a two-pass method re-indexes
        its tokens) and the prefill's wall seconds (a snapshot's prefill plus the method's
        compression)."""
        budget = budget if budget is not None else len(prompt.ids)
        compressed = len(prompt.context_ids) if self.config.compress_context_only else len(prompt.ids)
        if memory is not None:
            budget = engine.memory_budget(self.model, method, memory, compressed)
        start = time.perf_counter()
        if snapshot is None:
            session = CompressionSession(
                method, self.model.config.num_hidden_layers, budget=budget, kv_bits=kv_bits, memory=memory
            )
            session.memory_tokens = compressed
            cache, logits, mask, last_pos = engine.prefill(
                self.model, [prompt], session, self.pad_id, self.config.compress_context_only, self.eos
            )
            cache.quantize(kv_bits)
            return cache, logits, mask, last_pos, time.perf_counter() - start
        cache, logits, mask, last_pos = derive(
            self.model, snapshot, method, budget=budget, eos=self.eos, kv_bits=kv_bits, memory=memory,
            memory_tokens=compressed,
        )  # fmt: skip
        cache.quantize(kv_bits)
        if Stage.PRUNE in method.stages:  # the deeper layers it ran on the kept tokens are prefill too
            return cache, logits, mask, last_pos, snapshot.seconds + time.perf_counter() - start
        return (
            cache,
            logits,
            mask,
            last_pos,
            snapshot.seconds + cache.session.compress_seconds,
        )  # deriving is compressing

    def _run_one(
        self,
        snapshot: Snapshot | None,
        prompt: Any,
        sample: Sample,
        method: Method,
        budget: int | None,
        teacher: RunOutcome | None,
        candidates: list[list[int]] = (),
        kv_bits: int | None = None,
        memory: float | None = None,
    ) -> RunOutcome:
        """Generate with one method (its cache stored at ``kv_bits``); with ``teacher``, also its
        log-probs on the teacher's answer."""
        cache, logits, mask, last_pos, prefill_wall = self._compressed(
            snapshot, prompt, method, budget, kv_bits, memory
        )
        stats = cache.stats(0)
        budgets = cache.session.kept[0].tolist()
        step_by_step = Stage.DECODE in method.stages
        if teacher is None:  # the full-cache reference: its own answer, then its log-probs on it
            forced = copy.deepcopy(cache)
            decoded = decode_loop(self.model, cache, logits, mask, last_pos, self.eos, sample.max_new_tokens)
            ids, accepted = decoded.generated[0], 0
            times = RunTimes.of(prefill_wall, cache.session, decoded)
            logprobs = teacher_forced_logprobs(self.model, forced, logits, ids, mask, last_pos, step_by_step)
        else:  # the reference answer is a draft: one pass gives log-probs and the agreeing prefix
            drafted = decode_with_draft(
                self.model, cache, logits, teacher.token_ids, mask, last_pos, self.eos,
                sample.max_new_tokens, step_by_step, candidates,
            )  # fmt: skip
            ids, accepted, logprobs = drafted.token_ids, drafted.accepted, drafted.logprobs
            compress_s = cache.session.compress_seconds  # the first token is argmax(logits): no time
            times = RunTimes(prefill_wall, compress_s, 0.0, drafted.seconds, drafted.steps)
        text_ids = ids[:-1] if ids and ids[-1] in self.eos else ids
        return RunOutcome(
            token_ids=ids,
            text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
            logprobs=logprobs,
            ttft_s=times.ttft,
            prefill_s=times.prefill,
            compress_s=times.compress,
            tpot_s=times.tpot,
            stats=stats.as_dict(),
            budgets=budgets,
            draft_accepted=accepted,
            lookahead_s=cache.session.lookahead_seconds,
            reselect_s=cache.session.reselect_seconds,
            selection_layer=selection_layer(cache.session, 0),
        )

    def _run_shared_context(
        self, task: TaskSpec, length: int, index: int, sample: Sample, pending: list, emit: Callable
    ) -> None:
        """Shared-context rows (:mod:`kvbudget.eval.conversation`): the first prompt prefilled once
        (shared) and compressed per run, every turn answered in both modes; one row per run and mode,
        scored per turn. The full cache's answers are each run's drafts."""
        turns = sample.turns()
        prompts = [build_prompt(self.tokenizer, sample.context, t.question, t.answer_prefix) for t in turns]
        inputs = prefill_inputs([prompts[0]], self.pad_id, self.config.compress_context_only)
        methods = [run[0].build() for run in pending]
        inputs_read = any(method.wants_attention_inputs for method in methods)
        snapshot = (
            take_snapshot(self.model, inputs, attention_inputs=inputs_read) if self.config.shared else None
        )
        reference = self._converse(snapshot, prompts, turns, make_method("full"), None, None)
        drafts = {mode: [t.token_ids for t in outcome] for mode, outcome in reference.turns.items()}
        for run, method in zip(pending, methods, strict=True):
            spec, budget, ratio = run
            entries = budget if ratio is None else ratio_budget(ratio, inputs.compressed_until)
            if spec.name == "full" and spec.kv_bits is None:
                outcome = reference
            else:
                try:
                    check_shareable(method.stages, method.name)
                    outcome = self._converse(
                        snapshot, prompts, turns, method, entries, drafts, spec.kv_bits, spec.memory
                    )
                except Exception as err:
                    for row in self.error_rows(task, length, index, sample, run, entries, err):
                        emit(row)
                    continue
            for mode in MODES:
                emit(
                    self._conversation_row(
                        task, length, index, sample, run, entries, mode, outcome, reference
                    )
                )

    def _converse(
        self,
        snapshot: Snapshot | None,
        prompts: list[Any],
        turns: list[FollowUp],
        method: Method,
        budget: int | None,
        drafts: dict[str, list[list[int]]] | None,
        kv_bits: int | None = None,
        memory: float | None = None,
    ) -> Conversed:
        """Compress the first prompt with ``method`` (stored at ``kv_bits``) and answer every turn in
        both modes."""
        cache, logits, mask, last_pos, prefill_wall = self._compressed(
            snapshot, prompts[0], method, budget, kv_bits, memory
        )
        compress_s, stats = cache.session.compress_seconds, cache.stats(0).as_dict()
        budgets = cache.session.kept[0].tolist()
        talk = Conversation(self.model, self.tokenizer, self.eos, Stage.DECODE in method.stages)
        outcomes = talk.run(cache, logits, mask, last_pos, prompts, turns, drafts)
        return Conversed(outcomes, prefill_wall, compress_s, stats, budgets, len(prompts[0].ids))

    def _conversation_row(
        self, task, length, index, sample, run, entries, mode: str, outcome: Conversed, reference: Conversed
    ) -> dict:
        """One shared-context row: a run's turns in one mode, each scored; ``score`` is their mean."""
        row = self._base_row(task, length, index, sample, run, entries, mode)
        turns = []
        for number, (turn, mine, full) in enumerate(
            zip(sample.turns(), outcome.turns[mode], reference.turns[mode], strict=True), 1
        ):
            turns.append({
                "turn": number, "question": turn.question, "answers": turn.answers,
                "meta": {k: v for k, v in turn.meta.items() if isinstance(v, (int, float, str))},
                "prediction": mine.text, "score": task.metric(mine.text, turn.answers),
                "full_prediction": full.text, "full_score": task.metric(full.text, turn.answers),
                "agreement": token_agreement(full.token_ids, mine.token_ids),
                "ttft_s": mine.ttft_s, "decode_s": mine.decode_s, "kv_bytes": mine.kv_bytes,
                "entries": mine.entries, "draft_accepted": mine.draft_accepted,
            })  # fmt: skip
        first = outcome.turns[mode][0]
        row.update(
            prediction=first.text,
            score=sum(t["score"] for t in turns) / len(turns),
            full_score=sum(t["full_score"] for t in turns) / len(turns),
            agreement=sum(t["agreement"] for t in turns) / len(turns),
            turns=turns,
            prompt_tokens=outcome.prompt_tokens,
            ttft_s=first.ttft_s + outcome.prefill_s,
            prefill_s=outcome.prefill_s,
            compress_s=outcome.compress_s,
            logical_bytes=outcome.stats["logical_bytes"],
            physical_bytes=outcome.stats["physical_bytes"],
            held_bytes=max(t.kv_bytes for t in outcome.turns[mode]),
            budgets=outcome.budgets,
            **_byte_budget(outcome.stats),
            error=None,
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )  # fmt: skip
        return row

    def _run_perplexity(self, task: TaskSpec, length: int, index: int, sample: Sample, pending, emit) -> None:
        """Perplexity rows: score = perplexity of the passage with the cache held at the budget, every
        run (the full cache's too) scored on the same tokens, from :func:`scored_from` on."""
        ids = torch.tensor([self.tokenizer(sample.context, add_special_tokens=False)["input_ids"]])
        first_scored = scored_from(ids.shape[1])
        full = chunked_perplexity(self.model, ids, make_method("full"), None, first_chunk=first_scored)
        for run in pending:
            spec, budget, ratio = run
            entries = budget if ratio is None else ratio_budget(ratio, ids.shape[1])  # of the whole passage
            row = self._base_row(task, length, index, sample, run, entries)
            start = time.perf_counter()
            try:
                if spec.kv_bits is not None or spec.memory is not None:
                    raise KVBudgetError(
                        "kv_bits, memory: perplexity runs store the cache in the model's dtype"
                    )
                method = spec.build()
                result = (
                    full if spec.name == "full"
                    else chunked_perplexity(self.model, ids, method, entries, first_chunk=first_scored)
                )  # fmt: skip
            except Exception as err:
                emit(self._error_row(task, length, index, sample, run, entries, err))
                continue
            row.update(
                prediction="", score=result.perplexity, full_score=full.perplexity, nll=result.nll,
                scored_tokens=result.tokens, scored_from=first_scored,
                max_entries_per_head=result.max_entries_per_head,
                prompt_tokens=ids.shape[1], seconds=time.perf_counter() - start, error=None,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"),
            )  # fmt: skip
            emit(row)

    # ------------------------------------------------------------------ rows
    def _base_row(
        self,
        task: TaskSpec,
        length: int,
        index: int,
        sample: Sample,
        run: tuple,
        entries: int | None,
        conversation: str | None = None,
    ) -> dict:
        """The row's fields before its outcome; ``run`` is (method, budget, ratio), ``entries`` the
        budget it ran at (a ratio's, once resolved on the sample; ``None`` if never resolved);
        ``conversation``: a shared-context row's mode."""
        spec, budget, ratio = run
        extra = {} if conversation is None else {"conversation": conversation}
        return {
            "key": self.key(task, sample, spec, budget, ratio, conversation),
            **extra,
            "model": self.config.model,
            "dtype": self.config.dtype,
            "task": task.name,
            "family": task.family,
            "metric": task.metric_name,
            "length": length,
            "sample": index,
            "meta": {k: v for k, v in sample.meta.items() if isinstance(v, (int, float, str))},
            "method": spec.name,
            "label": spec.label,
            "options": dict(spec.options),
            "kv_bits": spec.kv_bits or 16,
            "memory": spec.memory,
            "budget": budget if ratio is None else entries,
            "compression_ratio": ratio,
            "mode": "agnostic" if self.config.compress_context_only else "aware",
            "shared_prefill": self.config.shared,
            "answers": sample.answers,
        }

    def _result_row(
        self, task, length, index, sample, run, entries, outcome: RunOutcome, reference: RunOutcome, n
    ) -> dict:
        row = self._base_row(task, length, index, sample, run, entries)
        row.update(
            prediction=outcome.text,
            score=task.metric(outcome.text, sample.answers),
            full_prediction=reference.text,
            full_score=task.metric(reference.text, sample.answers),
            agreement=token_agreement(reference.token_ids, outcome.token_ids),
            kl=mean_kl(reference.logprobs, outcome.logprobs),
            prompt_tokens=n,
            ttft_s=outcome.ttft_s,
            prefill_s=outcome.prefill_s,
            compress_s=outcome.compress_s,
            lookahead_s=outcome.lookahead_s,
            reselect_s=outcome.reselect_s,
            tpot_s=None if math.isnan(outcome.tpot_s) else outcome.tpot_s,
            draft_accepted=outcome.draft_accepted,
            logical_bytes=outcome.stats["logical_bytes"],
            physical_bytes=outcome.stats["physical_bytes"],
            budgets=outcome.budgets,
            **_byte_budget(outcome.stats),
            selection_layer=outcome.selection_layer,
            error=None,
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        return row

    def error_rows(self, task, length, index, sample, run, entries, err: BaseException) -> list[dict]:
        """The error rows of a run that failed: one per row it would have written."""
        if task.family != SHARED_CONTEXT:
            return [self._error_row(task, length, index, sample, run, entries, err)]
        return [
            self._error_row(task, length, index, sample, run, entries, err, conversation=mode)
            for mode in MODES
        ]

    def _error_row(
        self, task, length, index, sample, run, entries, err: BaseException, conversation=None
    ) -> dict:
        row = self._base_row(task, length, index, sample, run, entries, conversation)
        detail = traceback.format_exception_only(type(err), err)[-1].strip()
        row.update(prediction=None, score=None, error=detail, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        return row


def run_eval(config: EvalConfig, out: Path, progress: bool = True, **kwargs: Any) -> Path:
    """Run ``config`` into ``out/results.jsonl`` (resuming) and return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(config, out, progress=progress, **kwargs)  # validates before anything is written
    (out / "config.json").write_text(json.dumps(asdict(runner.config), indent=2), encoding="utf-8")
    return runner.run()


def _byte_budget(stats: dict[str, Any]) -> dict[str, Any]:
    """A byte budget's choice for a row (entries per precision per layer, target and stored bytes),
    when the run had one."""
    return {"byte_budget": stats["byte_budget"]} if "byte_budget" in stats else {}
