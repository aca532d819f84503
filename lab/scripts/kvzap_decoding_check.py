"""KVzap with a threshold, prefill only (`kvzap`) and while decoding too (`kvzap-decoding`), on the
real model: the fraction of entries kept after the prefill and after 40 greedy tokens, and the
answer. The context is the first 6,000 characters of the standard library's textwrap.py.

    python lab/scripts/kvzap_decoding_check.py
"""

import textwrap
import time

import kvbudget
from kvbudget.eval.runner import MethodSpec
from kvbudget.methods.registry import make_method
from kvbudget.models import load_model

SPECS = ("kvzap-decoding:kind=linear,threshold=-4", "kvzap-decoding:kind=linear,threshold=-6",
         "kvzap:kind=linear,threshold=-6")  # fmt: skip


def main() -> None:
    model, tokenizer = load_model("qwen2.5-coder-0.5b")
    entries_per_token = model.config.num_hidden_layers * model.config.num_key_value_heads
    context = open(textwrap.__file__).read()[:6000]
    question = "What does the function dedent do? Answer in one sentence."
    for spec in SPECS:
        parsed = MethodSpec.parse(spec)
        start = time.time()
        method = make_method(parsed.name, **dict(parsed.options))
        r = kvbudget.generate(model, tokenizer, context, question, method=method, budget=64,
                              max_new_tokens=40, compress_context_only=True)  # fmt: skip
        after_prefill = r.cache_trace[0] / ((r.prompt_tokens + 1) * entries_per_token)
        at_end = r.cache_trace[-1] / ((r.prompt_tokens + len(r.token_ids)) * entries_per_token)
        seconds = time.time() - start
        print(f"{spec}: {r.prompt_tokens} prompt tokens, kept {after_prefill:.3f} after the first step, "
              f"{at_end:.3f} after {len(r.token_ids)} tokens, {seconds:.1f} s: {r.text!r}")  # fmt: skip


if __name__ == "__main__":
    main()
