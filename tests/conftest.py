"""Shared fixtures: tiny random models built from configs (no download) and the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

#: torch threads per test process: the cores shared among pytest-xdist's workers (``-n N`` sets
#: PYTEST_XDIST_WORKER_COUNT in each), at most 2, so ``make test``'s workers do not oversubscribe them
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device the suite runs on, e.g. cuda: tensors and tiny models are made there "
        "(torch.set_default_device), and tests/test_device.py compares every method there with the CPU",
    )


def pytest_configure(config: pytest.Config) -> None:
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: CUDA is not available on this machine")
    if device.type != "cpu":
        torch.set_default_device(device)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``device`` compare ``--device`` with the CPU: on the CPU alone there is nothing to
    compare, so they run only when ``--device`` names another device."""
    if config.getoption("--device") != "cpu":
        return
    kept = [item for item in items if item.get_closest_marker("device") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def _torch_threads() -> None:
    """Each test starts on :data:`THREADS` torch threads, whatever an earlier test in the process set
    (the bench and throughput runs set ``--threads`` in-process): a test's sums do not depend on
    which tests ran before it in the same worker."""
    torch.set_num_threads(THREADS)


TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def seeded(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on torch's default device: a test's random tensors are made
    on ``--device`` (a cuda tensor needs a cuda generator), and on the CPU nothing changes."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def tiny_model(kind: str = "llama", seed: int = 0) -> PreTrainedModel:
    """A tiny random decoder with GQA (4 query / 2 KV heads, 4 layers), in eval mode.

    Weights are scaled up so next-token distributions are peaked: greedy comparisons are then
    not decided by float noise.
    """
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=0.2))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, initializer_range=0.2))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY, initializer_range=0.2, sliding_window=None))
    else:
        raise ValueError(kind)
    return model.eval()


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_model("llama")


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def any_tiny_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def real_model():
    """The default real model (smollm2-135m), fetched by `make fetch`."""
    from kvbudget.models import load_model

    return load_model("smollm2-135m")


def tiny_tokenizer(chat_template: bool = False):
    """A character-level tokenizer over 96 ids ([PAD]=0, [EOS]=1, [UNK]=2, then characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + TINY["vocab_size"] - 3)]
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    if chat_template:
        tok.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
    return tok


def config_only_model(directory: Path) -> Path:
    """A folder with a tiny Llama's ``config.json`` and a tokenizer, and no weight file (the source of
    a ``random_weights`` load)."""
    LlamaConfig(**TINY).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    assert not list(directory.glob("*.safetensors")) and not list(directory.glob("*.bin"))
    return directory


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    return tiny_tokenizer(chat_template=True)
