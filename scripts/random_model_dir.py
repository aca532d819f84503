"""Write a model folder for ``kvbudget bench --random-weights``: a real model's sizes, no weights.

    .venv/bin/python scripts/random_model_dir.py OUT [--config qwen2.5-7b] [--max-positions 131072]
        [--tokenizer-from qwen2.5-coder-0.5b]

``OUT`` gets ``config.json`` with the sizes of the named model's published config and the tokenizer
of the fetched ``qwen2.5-coder-0.5b`` (the same Qwen2.5 vocabulary: every id it makes is below the
larger model's ``vocab_size``), or of another registry model or folder (``--tokenizer-from``).
``--max-positions`` raises the context the model accepts; with random weights no RoPE scaling is
needed to time a long prompt. docs/gpu.md uses it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Qwen2.5-7B-Instruct's config.json (hub: Qwen/Qwen2.5-7B-Instruct), the sizes only.
CONFIGS = {
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
        "max_position_embeddings": 32768,
    },
}
TOKENIZER_MODEL = "qwen2.5-coder-0.5b"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="qwen2.5-7b", choices=sorted(CONFIGS))
    parser.add_argument("--max-positions", type=int, default=None)
    parser.add_argument("--tokenizer-from", default=TOKENIZER_MODEL, help="registry model or folder")
    args = parser.parse_args(argv)
    from kvbudget.errors import KVBudgetError
    from kvbudget.models import resolve_source

    try:
        source = resolve_source(args.tokenizer_from)
    except KVBudgetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.max_positions is not None and args.max_positions < 1:
        print(f"error: --max-positions must be positive, got {args.max_positions}", file=sys.stderr)
        return 2
    config = dict(CONFIGS[args.config])
    if args.max_positions:
        config["max_position_embeddings"] = args.max_positions
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, args.out / name)
    print(f"{args.out}: {args.config} sizes, {config['max_position_embeddings']} positions, no weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
