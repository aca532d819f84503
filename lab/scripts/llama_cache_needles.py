"""llama.cpp's KV cache types on needle prompts (the byte budget's serving notes): each of f16, q8_0 and q4_0
serves the first two 1K needle samples alone (one slot), and their answers are printed beside the
expected ones.

    .venv/bin/python lab/scripts/llama_cache_needles.py   (needs `make llama`)
"""

from pathlib import Path

from transformers import AutoTokenizer

from kvbudget.engine import build_prompt
from kvbudget.eval.tasks import get_task
from kvbudget.models import MODELS, model_dir
from kvbudget.peer import llama_cpp

d = model_dir("qwen2.5-coder-0.5b")
tok = AutoTokenizer.from_pretrained(d / "hf")
task = get_task("needle")
samples = list(task.make_samples(tok, 1024, 2, 0))
prompts = [
    {
        "id": i,
        "input_ids": build_prompt(tok, s.context, s.question, s.answer_prefix).ids,
        "max_new_tokens": 16,
        "ignore_eos": False,
    }
    for i, s in enumerate(samples)
]
for t in ("f16", "q8_0", "q4_0"):
    plan = llama_cpp.SlotPlan(t, 1, 1280, 0)
    run = llama_cpp.run_server(
        Path(".llama/bin/llama-server"),
        d / MODELS["qwen2.5-coder-0.5b"].gguf_filename,
        plan,
        prompts,
        clients=1,
        threads=2,
        log=Path(f"/tmp/llq-{t}.log"),
        timeout_s=300,
    )
    print(t, [(r.get("text"), samples[r["id"]].answers) for r in run["requests"]])
