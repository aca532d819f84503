"""Distributed evaluation on Ray: one grid, many worker actors, one resumable results file.

The unit of work is one sample, as in the local runner (:meth:`kvbudget.eval.runner.Runner.run_sample`):
its shared prefill and every pending (method, budget or ratio) run, so the sharing is kept. Each
worker is a Ray actor that loads the model once and runs samples; the driver plans the grid (it
needs no model, only the tokenizer, which it asks a worker for), hands out one sample per idle
worker and writes each sample's rows through the results store as they come back
(``DIR/results.jsonl``: the same keys, fsync and append-only file as a local run, so either kind
of run resumes the other's file). Only the driver writes.

Faults:

- a worker that dies (killed, out of memory, its node lost) loses its unfinished sample, which
  goes back to the front of the queue for the next idle worker, at most ``max_retries`` times
  (then its runs become error rows); the dead worker is replaced while work is left (at most
  ``workers × max(1, max_retries)`` replacements in a run). A sample's rows are written only once
  the whole sample is back, and a key already in the file is never written again.
- a sample that fails for a reason of its own (its prompt, its reference run, one method) gives
  error rows, as locally, and the run goes on.
- killing the driver loses only the samples in flight: rerunning the command resumes.

Ray is an optional extra (``pip install 'kvbudget[ray]'``); nothing here imports it until a
distributed run starts (:func:`require_ray`).
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvbudget.errors import KVBudgetError
from kvbudget.eval.runner import EvalConfig, MethodSpec, Runner
from kvbudget.eval.sample import Sample
from kvbudget.extras import needs_extra


def require_ray() -> Any:
    """The ``ray`` module, or a one-line :class:`~kvbudget.errors.MissingExtraError` naming the extra."""
    with needs_extra("ray", "distributed evaluation (--workers, --ray-address)"):
        import ray
    return ray


@dataclass
class RayOptions:
    """How a distributed run is placed.

    Attributes:
        workers: worker actors; ``None``: as many as the cluster's resources hold (its GPUs over
            ``gpus_per_worker`` when that is above 0, else its CPUs over ``threads_per_worker``).
        address: ``None`` starts a local Ray cluster sized for the workers (and stops it after);
            ``"auto"`` or ``host:port`` joins a running cluster (``ray start --head``).
        gpus_per_worker: GPUs each actor requests (Ray makes them its visible devices).
        threads_per_worker: CPUs each actor requests, and its torch threads.
        device: where each actor loads the model (``cpu``, ``cuda``, ``auto``). Ray shows an
            actor only the GPUs it requested, so ``auto`` is ``cuda`` exactly when
            ``gpus_per_worker`` is above 0.
        max_retries: how many times a sample whose worker died is run again before its rows
            become error rows.
        runtime_env: Ray runtime environment for the actors (environment variables, a working
            directory, packages), passed as it is.
    """

    workers: int | None = None
    address: str | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int = 1
    device: str = "auto"
    max_retries: int = 2
    runtime_env: dict[str, Any] | None = None

    def validate(self) -> None:
        """One-line errors for values no cluster could take."""
        if self.workers is not None and (isinstance(self.workers, bool) or self.workers < 1):
            raise KVBudgetError(f"--workers must be at least 1, got {self.workers}")
        if self.threads_per_worker < 1:
            raise KVBudgetError(f"--threads-per-worker must be at least 1, got {self.threads_per_worker}")
        if not (self.gpus_per_worker >= 0 and math.isfinite(self.gpus_per_worker)):
            raise KVBudgetError(f"--gpus-per-worker must be 0 or more, got {self.gpus_per_worker}")
        if self.max_retries < 0:
            raise KVBudgetError(f"max_retries must be 0 or more, got {self.max_retries}")
        if self.address is not None and not self.address.strip():
            raise KVBudgetError("--ray-address is empty: give auto or host:port")
        if self.device.startswith("cuda") and self.gpus_per_worker <= 0:
            raise KVBudgetError(
                f"--device {self.device} needs --gpus-per-worker (an actor sees only the GPUs it asks for)"
            )


class SampleWorker:
    """A worker actor's state: the model, loaded once, and a :class:`Runner` without a results file.

    ``model_source`` is what the model is loaded from (the driver's ``config.model`` made absolute
    when it is a local path); the rows' keys keep ``config["model"]`` as the driver wrote it.
    """

    def __init__(self, config: dict[str, Any], model_source: str, device: str, threads: int) -> None:
        import torch

        from kvbudget.models import load_model

        torch.set_num_threads(threads)
        config = EvalConfig(**config)
        model, tokenizer = load_model(model_source, dtype=config.dtype, device=device)
        self.runner = Runner(config, None, model=model, tokenizer=tokenizer, progress=False)

    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    def run(
        self,
        task: str,
        length: int,
        index: int,
        sample: Sample,
        pending: list[tuple[MethodSpec, int | None, float | None]],
    ) -> list[dict[str, Any]]:
        """Every pending run of one sample; its rows (error rows included), in run order."""
        from kvbudget.eval.tasks import get_task

        rows: list[dict[str, Any]] = []
        self.runner.run_sample(get_task(task), length, index, sample, pending, rows.append)
        return rows


@dataclass
class Unit:
    """One sample and its pending runs; ``attempts``: how many workers died running it."""

    task: str
    length: int
    index: int
    sample: Sample
    pending: list[tuple[MethodSpec, int | None, float | None]]
    attempts: int = 0
    causes: list[str] = field(default_factory=list)


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


class RayPool:
    """Ray actors of one class, each loaded once, and a queue of units handed to idle actors.

    Shared by the distributed evaluation (:class:`RayEval`, one sample per unit) and the distributed
    perplexity grid of ``kvbudget tune`` (:func:`kvbudget.tuning.tune`, one grid point and passage
    per unit). ``actor`` is the actor's class and ``args`` its constructor's arguments. A unit is any
    object with ``attempts`` and ``causes`` fields (:class:`Unit`); the caller says how one is sent
    (``submit``) and what becomes of its result, its own failure, or too many worker deaths.

    ``workers`` holds the live actor handles while :meth:`dispatch` runs (e.g. to watch or kill
    one); ``retried`` counts units handed out again after their worker died, ``replaced`` the
    workers started in place of dead ones.
    """

    def __init__(self, options: RayOptions, actor: type, args: tuple[Any, ...]) -> None:
        options.validate()
        self.ray = require_ray()
        self.options = options
        self.actor = actor
        self.args = args
        self.workers: list[Any] = []
        self.retried = 0
        self.replaced = 0
        self._started_ray = False

    def start(self) -> int:
        """Join or start the cluster and start the workers; returns how many."""
        self._connect()
        count = self._worker_count()
        self.workers = [self.start_worker() for _ in range(count)]
        return count

    def _connect(self) -> None:
        ray, opts = self.ray, self.options
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
        if opts.address is None:  # a local cluster with room for every worker
            workers = opts.workers or max(1, (os.cpu_count() or 1) // opts.threads_per_worker)
            kwargs["num_cpus"] = workers * opts.threads_per_worker
        else:
            kwargs = {"address": opts.address, "log_to_driver": False}
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = f"reach the Ray cluster at {opts.address}" if opts.address else "start a local cluster"
            raise KVBudgetError(f"cannot {where}: {_one_line(err)}") from None
        self._started_ray = True

    def _worker_count(self) -> int:
        opts = self.options
        resources = self.ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
        if opts.workers is None:
            fit = gpus / opts.gpus_per_worker if opts.gpus_per_worker > 0 else cpus / opts.threads_per_worker
            workers = max(1, int(fit))
        else:
            workers = opts.workers
        if workers * opts.threads_per_worker > cpus or workers * opts.gpus_per_worker > gpus:
            raise KVBudgetError(
                f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs: too few for {workers} workers with "
                f"{opts.threads_per_worker} threads and {opts.gpus_per_worker:g} GPUs each"
            )
        return workers

    def start_worker(self) -> Any:
        opts = self.options
        actor = self.ray.remote(self.actor).options(
            num_cpus=opts.threads_per_worker, num_gpus=opts.gpus_per_worker, max_restarts=0,
            max_task_retries=0, runtime_env=opts.runtime_env,
        )  # fmt: skip
        return actor.remote(*self.args)

    def first(self, call: Callable[[Any], Any]) -> Any:
        """``call(worker)``'s result on the first worker (e.g. its tokenizer), waiting for it to load."""
        try:
            return self.ray.get(call(self.workers[0]))
        except self.ray.exceptions.RayError as err:
            raise KVBudgetError(f"a Ray worker could not start: {_one_line(err)}") from None

    def _kill(self, worker: Any) -> None:
        try:
            self.ray.kill(worker)
        except Exception:  # already gone
            pass

    def stop(self) -> None:
        """Kill the workers, and stop the cluster when :meth:`start` started it."""
        for worker in self.workers:
            self._kill(worker)
        self.workers = []
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False

    def dispatch(
        self,
        queue: deque[Any],
        submit: Callable[[Any, Any], Any],
        done: Callable[[Any, Any], None],
        failed: Callable[[Any, BaseException], None],
        gave_up: Callable[[Any, BaseException], None],
        what: str = "unit",
        resume: str = "rerun to resume",
        bar: tqdm | None = None,
    ) -> None:
        """Run every unit of ``queue``: ``submit(worker, unit)`` returns the Ray reference of its
        result, handed to ``done(unit, result)``; a unit whose code raised goes to ``failed(unit,
        cause)``; one whose worker died goes back to the front of the queue, at most
        ``options.max_retries`` times, then to ``gave_up(unit, cause)``. ``what`` names a unit in
        that cause, ``resume`` ends the error raised when every worker died."""
        ray = self.ray
        idle = list(self.workers)
        in_flight: dict[Any, tuple[Any, Any]] = {}
        replacements = len(self.workers) * max(1, self.options.max_retries)
        while queue or in_flight:
            while idle and queue:
                worker, unit = idle.pop(0), queue.popleft()
                in_flight[submit(worker, unit)] = (worker, unit)
            if not in_flight:
                raise KVBudgetError(f"every Ray worker died ({self.replaced} replaced); {resume}")
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            worker, unit = in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as err:  # the unit's own code raised
                idle.append(worker)
                failed(unit, getattr(err, "cause", None) or err)
                continue
            except ray.exceptions.RayError as err:  # the worker died: its unit goes back in the queue
                unit.attempts += 1
                unit.causes.append(_one_line(err))
                self.workers = [w for w in self.workers if w is not worker]
                self._kill(worker)  # in case it is only unreachable
                if unit.attempts > self.options.max_retries:
                    cause = f"the Ray worker died {unit.attempts} times running this {what}"
                    gave_up(unit, RuntimeError(f"{cause} ({unit.causes[-1]})"))
                else:
                    self.retried += 1
                    queue.appendleft(unit)
                if (queue or in_flight) and self.replaced < replacements:
                    self.replaced += 1
                    fresh = self.start_worker()
                    self.workers.append(fresh)
                    idle.append(fresh)
                if bar is not None:
                    bar.set_postfix(retried=self.retried, replaced=self.replaced)
                continue
            done(unit, result)
            idle.append(worker)


class RayEval:
    """A distributed run of an :class:`EvalConfig` into ``out/results.jsonl``.

    ``workers`` holds the live actor handles while :meth:`run` runs (e.g. to watch or kill one);
    ``retried`` counts samples handed out again after their worker died, ``replaced`` the workers
    started in place of dead ones (:class:`RayPool`).
    """

    def __init__(self, config: EvalConfig, out: Path, options: RayOptions, progress: bool = True) -> None:
        options.validate()
        require_ray()
        self.options = options
        self.out = Path(out)
        self.progress = progress
        self.out.mkdir(parents=True, exist_ok=True)
        # validates the grid and opens (and repairs) the results file; no model in the driver
        self.driver = Runner(config, self.out, progress=progress, load=False)
        self.config = self.driver.config
        model = self.config.model
        source = str(Path(model).resolve()) if Path(model).exists() else model
        args = (asdict(self.config), source, options.device, options.threads_per_worker)
        self.pool = RayPool(options, SampleWorker, args)

    @property
    def workers(self) -> list[Any]:
        return self.pool.workers

    @property
    def retried(self) -> int:
        return self.pool.retried

    @property
    def replaced(self) -> int:
        return self.pool.replaced

    # ------------------------------------------------------------------ grid
    def _units(self) -> list[Unit]:
        driver, done = self.driver, self.driver.store.keys
        units = []
        for task, length, index, sample in driver.samples():
            pending = driver.pending_runs(task, sample, done)
            if pending:
                units.append(Unit(task.name, length, index, sample, pending))
        return units

    def _write(self, rows: list[dict[str, Any]], bar: tqdm) -> None:
        written = self.driver.store.keys
        for row in rows:
            if row["key"] not in written:  # never twice, whatever a worker sends
                self.driver.store.append(row)
                written.add(row["key"])
                bar.update(1)

    def _error_rows(self, unit: Unit, err: BaseException) -> list[dict[str, Any]]:
        from kvbudget.eval.tasks import get_task

        task = get_task(unit.task)
        return [
            row
            for run in unit.pending
            for row in self.driver.error_rows(task, unit.length, unit.index, unit.sample, run, None, err)
        ]

    # ------------------------------------------------------------------ run
    def run(self) -> Path:
        """Run every missing row; returns the results path. Rows already in the file are skipped."""
        (self.out / "config.json").write_text(json.dumps(asdict(self.config), indent=2), encoding="utf-8")
        try:
            count = self.pool.start()
            # the first worker to load gives the driver the tokenizer the samples are cut with
            self.driver.tokenizer = self.pool.first(lambda worker: worker.tokenizer.remote())
            queue = deque(self._units())
            total = sum(len(u.pending) for u in queue)
            bar = tqdm(
                total=total, disable=not self.progress, desc=f"eval ×{count} workers", unit="run",
                dynamic_ncols=True,
            )  # fmt: skip
            self.pool.dispatch(
                queue,
                submit=lambda worker, u: worker.run.remote(u.task, u.length, u.index, u.sample, u.pending),
                done=lambda unit, rows: self._write(rows, bar),
                failed=lambda unit, err: self._write(self._error_rows(unit, err), bar),
                gave_up=lambda unit, err: self._write(self._error_rows(unit, err), bar),
                what="sample",
                resume=f"the rows so far are in {self.driver.store.path}: rerun to resume",
                bar=bar,
            )
            bar.close()
        finally:
            self.pool.stop()
        return self.driver.store.path


def run_eval_distributed(
    config: EvalConfig, out: Path, options: RayOptions | None = None, progress: bool = True
) -> Path:
    """Run ``config`` on Ray workers into ``out/results.jsonl`` (resuming) and return its path."""
    return RayEval(config, out, options or RayOptions(), progress=progress).run()
