"""OpenVINO GenAI beside kvbudget's server: its environment (``make ov`` → ``.venv-ov``), the
standalone runner its Python executes (:mod:`kvbudget.peer.openvino_runner`, which imports no kvbudget
module), run by ``kvbudget bench serve --openvino PYTHON`` on the same prompts under the same KV cap
(:func:`kvbudget.bench.serve_load.openvino_rows` makes its rows).

The runner needs the model as OpenVINO IR, exported once offline from the same Hugging Face folder
kvbudget loads (for a registry model, its 4-bit GGUF weights dequantized):
``optimum-cli export openvino --model HF_DIR --task text-generation-with-past --weight-format fp16
IR_DIR`` (:func:`export_command`).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbudget.errors import KVBudgetError

#: kvbudget's dtype ↔ the OpenVINO element type of the runner's compute and KV cache.
PRECISIONS = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def runner_script() -> Path:
    """Path of the standalone OpenVINO GenAI runner (executed by ``.venv-ov``'s Python)."""
    return Path(__file__).with_name("openvino_runner.py")


def default_ir_dir(model: str) -> Path | None:
    """Where a registry model's IR is looked for: ``$KVBUDGET_HOME/models/<name>/openvino`` (None for
    a model that is not a registry name: its IR folder must be given)."""
    from kvbudget.models import MODELS, model_dir

    return model_dir(model) / "openvino" if model in MODELS else None


def export_command(hf_dir: str | os.PathLike[str], ir_dir: str | os.PathLike[str]) -> str:
    """The offline export of ``hf_dir`` to OpenVINO IR in ``ir_dir`` (run with ``.venv-ov``)."""
    return (f".venv-ov/bin/optimum-cli export openvino --model {hf_dir} --task text-generation-with-past "
            f"--weight-format fp16 {ir_dir}")  # fmt: skip


def check_environment(python: str | os.PathLike[str], ir_dir: Path | None, model: str) -> None:
    """A usable ``python`` (the ``.venv-ov`` one) and an exported ``ir_dir``, or an error saying how."""
    from kvbudget.peer.environment import peer_python_path

    if peer_python_path(python) is None:
        raise KVBudgetError(f"no OpenVINO environment at {python}: run `make ov` first")
    if ir_dir is None:
        raise KVBudgetError(f"--openvino-model is needed: {model} is not a registry model")
    if not (ir_dir / "openvino_model.xml").is_file():
        from kvbudget.models import resolve_source

        hf = resolve_source(model)
        raise KVBudgetError(f"no OpenVINO IR in {ir_dir}: export it once with `{export_command(hf, ir_dir)}`")


def run_runner(
    python: str | os.PathLike[str],
    ir_dir: Path,
    prompts: Sequence[dict[str, Any]],
    cap_bytes: int,
    *,
    keep_fraction: float,
    concurrency: int,
    precision: str,
    workdir: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """Write ``prompts`` (``id``, ``input_ids``, ``max_new_tokens``, ``eos_ids``, ``ignore_eos``) to
    ``workdir/openvino-prompts.jsonl``, run both modes in the runner (``python -P``, no ``PYTHONPATH``:
    this checkout's kvbudget stays off its path) and return its document; its stderr goes to
    ``workdir/openvino.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    names = ("openvino-prompts.jsonl", "openvino.json", "openvino.log")
    prompts_path, out, log = (workdir / name for name in names)
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    command = [str(python), "-P", str(runner_script()), "--model", str(ir_dir),
               "--prompts", str(prompts_path), "--cap-bytes", str(cap_bytes),
               "--keep-fraction", str(keep_fraction), "--concurrency", str(concurrency),
               "--kv-precision", precision, "--inference-precision", precision,
               "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with log.open("w") as stderr:
        try:
            proc = subprocess.run(
                command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise KVBudgetError(f"the OpenVINO runner ran past {timeout_s:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().strip().splitlines()[-8:])
        raise KVBudgetError(f"the OpenVINO runner stopped (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())
