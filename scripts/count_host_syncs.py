"""Count the calls that make a GPU wait for the host, per prefill and per decode step, on the CPU.

    .venv/bin/python scripts/count_host_syncs.py [METHOD ...]   # default: full snapkv lava

On a tiny random Llama (tests/conftest.py), a ``TorchFunctionMode`` counts ``item``, ``tolist``,
``cpu``, ``nonzero`` and the tensor-to-Python conversions (``bool``, ``int``, ``float``, index) in
one prefill with compression (prompts of about 480 and 1,830 tokens, budget 32), then over ten
decode steps. On a GPU each such call waits for the work queued before it. docs/gpu.md uses the
counts.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WAITS = {"item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__index__", "__float__"}


class CountWaits(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in WAITS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    from conftest import tiny_model, tiny_tokenizer
    from kvbudget.engine import build_prompt, decode_loop, prefill
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.session import CompressionSession

    methods = (sys.argv[1:] if argv is None else argv) or ["full", "snapkv", "lava"]
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    for repeats in (10, 40):
        prompt = build_prompt(
            tokenizer, "The quick brown fox jumps over the lazy dog. " * repeats, "What?", ""
        )
        for name in methods:
            session = CompressionSession(
                MethodSpec.parse(name).build(), model.config.num_hidden_layers, budget=32
            )
            at_prefill = CountWaits()
            with at_prefill:
                cache, logits, mask, last = prefill(model, [prompt], session, 0)
            at_decode = CountWaits()
            with at_decode:
                decoded = decode_loop(model, cache, logits, mask, last, set(), 11, trace=False)
            per_step = sum(at_decode.calls.values()) / decoded.steps
            print(f"{name}: {len(prompt.ids)} tokens, {sum(at_prefill.calls.values())} in the prefill, "
                  f"{per_step:.1f} per decode step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
