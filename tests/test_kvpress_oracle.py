"""Oracle: kvbudget's snapkv, configured like kvpress's SnapKVPress, keeps the same entries.

kvpress runs in its own environment (``make peer`` builds ``.venv-peer``: it needs transformers
< 5.3); the test saves a tiny random Llama, runs kvpress's press on it through the standalone
runner, and compares the kept positions per layer and KV head with ours. Skipped only when the
peer environment is absent.

KeyDiff, LagKV, ChunkKV (over SnapKV), ObservedAttention (our ``observed-attention``; kvpress runs
it with eager attention), StreamingLLM, AdaKV over SnapKV (``ada-snapkv`` with floor 0) and Q-Filters
are compared the same way, with settings matched
(``NEW_PEERS``) at budgets where both sides are exact. Q-Filters' press downloads its filters from
the hub, impossible here: a small script subclasses ``QFilterPress`` to take our profile's filters
from a file instead. What is not compared: KeyDiff's and Q-Filters' decode-stage eviction (kvpress
compresses the prefill only), LagKV's uneven splits (kvpress leaves them to ``topk``'s order among
equal rank scores) and ChunkKV's layer-wise index reuse (kvpress has none).

Every registered method whose class (or combination) names a kvpress press (``kvpress``) has an
oracle here, or a line in ``NOT_COMPARED`` saying why none can match:
``test_every_kvpress_counterpart_has_an_oracle`` (which runs without the peer environment) fails
until it does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import seeded, tiny_model
from kvbudget.bench.peer import PEERS, peer_python_path, runner_script
from kvbudget.engine import compress
from kvbudget.eval.peer_rows import PRESSES

PEER = peer_python_path(Path(__file__).resolve().parents[1] / ".venv-peer" / "bin" / "python")


def needs_peer() -> None:
    """Skip a test whose oracle runs kvpress when the peer environment is absent."""
    if PEER is None:
        pytest.skip("no kvpress environment (.venv-peer): run `make peer`")


BUDGETS = (80, 100, 160)


def _ids(seed: int) -> list[int]:
    return torch.randint(3, 96, (300,), generator=seeded(seed)).tolist()


@pytest.fixture(scope="module")
def peer_kept(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """kvpress's kept positions for every job of this file's index oracles, on two 300-token prompts,
    in one runner call (one start of kvpress's interpreter): SnapKV at three budgets, the newer
    scorers (``NEW_PEERS``) and the 2026 presses (``ORACLE_2026``).

    The model is saved with a tokenizer without a chat template: KVzipPress loads it from the
    model's path to tokenise its requests, and so does our KVzip (prefix none, suffix ``"\\n"``).
    """
    needs_peer()
    from transformers import AutoModelForCausalLM

    from conftest import tiny_tokenizer

    tmp = tmp_path_factory.mktemp("kvpress")
    tiny_model("llama", seed=3).save_pretrained(tmp / "model")
    tiny_tokenizer().save_pretrained(tmp / "model")
    samples = [
        {"id": f"s{seed}", "context_ids": _ids(seed), "question_ids": [], "eos_ids": [], "max_new_tokens": 1}
        for seed in (1, 2)
    ]
    (tmp / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    surrogates = _kvzap_surrogates(tiny_model("llama", seed=3), tmp)
    jobs = [{**PEERS["snapkv"][1], "method": "snapkv", "budget": b} for b in BUDGETS]
    jobs += [{**press, "method": name, "budget": b} for name, (_, press, bs) in NEW_PEERS.items() for b in bs]
    jobs += [{**job, "kvzap_weights": surrogates[job["kvzap_weights"]]} if "kvzap_weights" in job else job
             for job in ORACLE_2026.values()]  # fmt: skip
    assert len({(job["method"], job["budget"]) for job in jobs}) == len(jobs)
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run(
        [str(PEER), "-P", str(runner_script()), "--model", str(tmp / "model"),
         "--samples", str(tmp / "samples.jsonl"), "--jobs", str(tmp / "jobs.json"),
         "--out", str(tmp / "out.jsonl"), "--indices"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(tmp / "model").eval()  # name_or_path: the saved folder
    return {"model": model, "ids": {s["id"]: s["context_ids"] for s in samples},
            "kept": {(r["method"], r["sample"], r["budget"]): r["indices"] for r in rows},
            "kvzap": surrogates}  # fmt: skip


@pytest.fixture(scope="module")
def oracle(peer_kept: dict) -> dict:
    """kvpress's SnapKVPress kept positions for two prompts × three budgets."""
    kept = {
        (sample, budget): v for (method, sample, budget), v in peer_kept["kept"].items() if method == "snapkv"
    }
    return {"model": peer_kept["model"], "ids": peer_kept["ids"], "kept": kept}


def our_indices(model, ids: list[int], method: str, budget: int) -> list[list[list[int]]]:
    from kvbudget.eval.runner import MethodSpec

    cache = compress(model, torch.tensor([ids]), method=MethodSpec.parse(method).build(), budget=budget)
    return [[layer.head(h)[2][0].tolist() for h in range(layer.num_heads)] for layer in cache.layers]


@pytest.mark.parametrize("sample", ["s1", "s2"])
@pytest.mark.parametrize("budget", [80, 160])
def test_snapkv_keeps_kvpress_indices(oracle: dict, sample: str, budget: int) -> None:
    model = oracle["model"]
    theirs = oracle["kept"][(sample, budget)]
    ours = our_indices(model, oracle["ids"][sample], PEERS["snapkv"][0], budget)
    assert len(ours) == len(theirs) == model.config.num_hidden_layers
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        assert len(mine) == len(peer) == model.config.num_key_value_heads
        for head, (a, b) in enumerate(zip(mine, peer, strict=True)):
            assert len(a) == budget
            assert a == b, f"layer {layer} head {head}: {sorted(set(a) ^ set(b))} differ"


def test_default_snapkv_differs_from_kvpress(oracle: dict) -> None:
    """The comparison has teeth: our paper defaults (window 32, maxpool 7, sum) keep other entries."""
    ours = our_indices(oracle["model"], oracle["ids"]["s1"], "snapkv", 100)
    assert ours != oracle["kept"][("s1", 100)]


@pytest.fixture(scope="module")
def end_to_end(oracle: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """kvpress's runner on a prompt with a question: SnapKV at budget 90, question-agnostic and
    question-aware (one runner call); rows by ``aware``."""
    tmp = tmp_path_factory.mktemp("kvpress-answers")
    sample = {"id": "q", "context_ids": oracle["ids"]["s1"], "question_ids": _ids(7)[:12], "eos_ids": [],
              "max_new_tokens": 6}  # fmt: skip
    (tmp / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    jobs = [{**PEERS["snapkv"][1], "method": f"snapkv-{aware}", "budget": 90, "question_aware": aware}
            for aware in (False, True)]  # fmt: skip
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    oracle["model"].save_pretrained(tmp / "model")
    subprocess.run(
        [str(PEER), "-P", str(runner_script()), "--model", str(tmp / "model"),
         "--samples", str(tmp / "samples.jsonl"), "--jobs", str(tmp / "jobs.json"),
         "--out", str(tmp / "out.jsonl")],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
    return {"sample": sample, "rows": {row["method"] == "snapkv-True": row for row in rows}}


@pytest.mark.parametrize("aware", [False, True])
def test_answers_match_kvpress_end_to_end(oracle: dict, end_to_end: dict, aware: bool) -> None:
    """`bench peer`'s two paths — kvpress's runner and our `run_ours` — decode the same tokens,
    question-agnostic and question-aware, for SnapKV with kvpress's settings."""
    from kvbudget.bench.peer import run_ours

    model = oracle["model"]
    theirs = end_to_end["rows"][aware]
    ours = run_ours(model, end_to_end["sample"], "snapkv", 90, question_aware=aware)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert theirs["kept_entries"] == ours["kept_entries"] == layers * heads * 90
    assert len(ours["token_ids"]) == 6
    assert ours["token_ids"] == theirs["token_ids"]


# ----------------------------------------------------------------------- keydiff, lagkv, chunkkv, qfilter
#: our method spec ↔ kvpress job, with settings matched; budgets where both sides are exact:
#: LagKV (4 sinks, lag 32, 300 tokens: 8 scored partitions, a tail of 40) splits the rest evenly
#: over the partitions (kvpress's equal rank scores leave an uneven split to topk's tie order);
#: ``lagkv@leaderboard`` is the ``kvpress:lagkv`` rows' own job (PRESSES: the class defaults, 4 sinks,
#: lag 128; 300 tokens: one scored partition, a tail of 168), kept by ``lagkv:sinks=4`` (issue #48);
#: ChunkKV's window of 60 is three whole chunks of 20 (kvpress chunks the window too and scores it
#: above everything, so its three chunks are always kept, as our protected window), and a budget of
#: 60 + 20k is k whole chunks on both sides.
NEW_PEERS: dict[str, tuple[str, dict, tuple[int, ...]]] = {
    "keydiff": ("keydiff", {"press": "KeyDiffPress"}, (80, 160)),
    "lagkv": ("lagkv:sinks=4,lag_size=32", {"press": "LagKVPress", "kwargs": {"n_sink": 4, "lag_size": 32}},
              (84, 124)),
    "lagkv@leaderboard": ("lagkv:sinks=4", PRESSES["lagkv"], (200, 240)),
    "chunkkv": (
        "chunkkv:window=60,kernel=5,pooling=avg,reduce_rows=mean,chunk_size=20",
        {"press": "ChunkKVPress", "kwargs": {"chunk_length": 20},
         "inner": {"press": "SnapKVPress", "kwargs": {"window_size": 60, "kernel_size": 5}}},
        (100, 160),
    ),
    "observed-attention": (
        "observed-attention", {"press": "ObservedAttentionPress", "attn": "eager"}, (80, 160)
    ),
    "streamingllm": (
        "streamingllm:sinks=4", {"press": "StreamingLLMPress", "kwargs": {"n_sink": 4}}, (80, 160)
    ),
    # AdaKV's floor 0 on both sides: one top-k over the layer's heads (kvpress's floor 0.2 forces each
    # head's own top int(0.2·B) in; ours is AdaKV's n_h(1 − α) + α·B', as for expected-attention below)
    "ada-snapkv": (
        "ada-snapkv:window=64,kernel=5,pooling=avg,reduce_rows=mean,floor_alpha=0.0",
        {"press": "AdaKVPress", "kwargs": {"alpha_safeguard": 0.0},
         "inner": {"press": "SnapKVPress", "kwargs": {"window_size": 64, "kernel_size": 5}}},
        (100, 160),
    ),
}  # fmt: skip

#: kvpress's QFilterPress downloads its filters from the hub; this script (run by the peer Python)
#: subclasses it to take the filters from a file instead, then records the kept positions the way
#: the runner's ``--indices`` does (kept keys matched against the full cache's)
QFILTER_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from kvpress import QFilterPress

model_dir, spec_path, out_path = sys.argv[1:]
spec = json.load(open(spec_path))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
filters = torch.tensor(spec["q_filters"], dtype=torch.float32)

class FileQFilterPress(QFilterPress):
    def post_init_from_model(self, model):
        self.q_filters = filters

ctx = torch.tensor([spec["ids"]])
n = ctx.shape[1]
rows = {}
with torch.inference_mode():
    full = DynamicCache()
    model.model(input_ids=ctx, past_key_values=full)
    for budget in spec["budgets"]:
        cache = DynamicCache()
        with FileQFilterPress(compression_ratio=1.0 - (budget + 0.25) / n)(model):
            model.model(input_ids=ctx, past_key_values=cache)
        layers = []
        for li, layer in enumerate(cache.layers):
            heads = []
            for h in range(layer.keys.shape[1]):
                dist = torch.cdist(layer.keys[0, h].double(), full.layers[li].keys[0, h].double())
                assert float(dist.min(-1).values.max()) < 1e-6
                heads.append(sorted(dist.min(-1).indices.tolist()))
            layers.append(heads)
        rows[str(budget)] = layers
json.dump(rows, open(out_path, "w"))
"""


@pytest.fixture(scope="module")
def new_oracle(peer_kept: dict) -> dict:
    """kvpress's KeyDiff, LagKV, ChunkKV(SnapKV) and ObservedAttention (eager attention) kept positions
    on the oracle's model and prompts."""
    return {key: v for key, v in peer_kept["kept"].items() if key[0] in NEW_PEERS}


def _assert_same(ours: list, theirs: list, budget: int) -> None:
    """The same positions per layer and head; each layer keeps ``budget`` a head on average (AdaKV's
    heads differ, the others keep exactly ``budget``)."""
    assert len(ours) == len(theirs)
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        assert sum(len(a) for a in mine) == len(mine) * budget
        for head, (a, b) in enumerate(zip(mine, peer, strict=True)):
            assert a == b, f"layer {layer} head {head}: {sorted(set(a) ^ set(b))} differ"


@pytest.mark.parametrize("sample", ["s1", "s2"])
@pytest.mark.parametrize("name", list(NEW_PEERS))
def test_new_scorers_keep_kvpress_indices(oracle: dict, new_oracle: dict, name: str, sample: str) -> None:
    spec, _, budgets = NEW_PEERS[name]
    for budget in budgets:
        ours = our_indices(oracle["model"], oracle["ids"][sample], spec, budget)
        _assert_same(ours, new_oracle[(name, sample, budget)], budget)


def test_new_scorer_comparisons_have_teeth(oracle: dict, new_oracle: dict) -> None:
    """Plausible wrong settings keep other entries: LagKV with kvbudget's default sinks, ChunkKV
    with SnapKV's max pooling, KeyDiff with a window, observed attention summed (H2O) or with a
    window, StreamingLLM with 8 sinks, Ada-SnapKV with our default floor."""
    ids = oracle["ids"]["s1"]
    model = oracle["model"]
    assert our_indices(model, ids, "lagkv:sinks=16,lag_size=32", 84) != new_oracle[("lagkv", "s1", 84)]
    assert our_indices(model, ids, "lagkv", 200) != new_oracle[("lagkv@leaderboard", "s1", 200)]  # 16 sinks
    wrong = "chunkkv:window=60,kernel=5,pooling=max,reduce_rows=mean,chunk_size=20"
    assert our_indices(model, ids, wrong, 100) != new_oracle[("chunkkv", "s1", 100)]
    assert our_indices(model, ids, "keydiff:window=32", 80) != new_oracle[("keydiff", "s1", 80)]
    # H2O's sums (the `bench peer` pair of ObservedAttentionPress) rank early tokens higher
    observed = new_oracle[("observed-attention", "s1", 80)]
    assert our_indices(model, ids, "h2o:heavy_fraction=1.0", 80) != observed
    assert our_indices(model, ids, "observed-attention:window=8", 80) != observed
    assert our_indices(model, ids, "streamingllm:sinks=8", 80) != new_oracle[("streamingllm", "s1", 80)]
    wrong = "ada-snapkv:window=64,kernel=5,pooling=avg,reduce_rows=mean,floor_alpha=0.2"  # our default floor
    assert our_indices(model, ids, wrong, 100) != new_oracle[("ada-snapkv", "s1", 100)]


def test_qfilter_keeps_kvpress_indices_with_the_same_filters(oracle: dict, tmp_path: Path) -> None:
    """kvpress's QFilterPress with the filters of our profile (negated: the authors store −f and keep
    the smallest ⟨k, −f⟩) keeps what our `qfilter` keeps with window 0."""
    from kvbudget.profile_prompts import BUILTIN_TEXT
    from kvbudget.profiles import build_profile, folded_prompt, save_profile

    model = oracle["model"]
    prompt = folded_prompt("text", BUILTIN_TEXT, "text", model.config.vocab_size, limit=200)
    path = save_profile(build_profile(model, [prompt]), tmp_path / "profile.json")
    filters = json.loads(path.read_text())["query_filters"]
    model.save_pretrained(tmp_path / "model")
    budgets = [80, 160]
    spec = {"ids": oracle["ids"]["s1"], "budgets": budgets, "q_filters": (-torch.tensor(filters)).tolist()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "qfilter.py").write_text(QFILTER_SCRIPT)
    subprocess.run(
        [str(PEER), "-P", str(tmp_path / "qfilter.py"), str(tmp_path / "model"), str(tmp_path / "spec.json"),
         str(tmp_path / "out.json")],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    theirs = json.loads((tmp_path / "out.json").read_text())
    for budget in budgets:
        ours = our_indices(model, oracle["ids"]["s1"], f"qfilter:window=0,profile={path}", budget)
        _assert_same(ours, theirs[str(budget)], budget)
    assert our_indices(model, oracle["ids"]["s1"], f"qfilter:window=16,profile={path}", 80) != theirs["80"]


# ------------------------------------------------------------ expected-attention and kvzip oracles
def _ratio_job(
    method: str, press: str, kwargs: dict, budget: int, ratio: float | None = None, inner=None
) -> dict:
    job = {"method": method, "press": press, "kwargs": kwargs, "budget": budget}
    if (
        ratio is not None
    ):  # the press gets this ratio unchanged (KVzip prunes int(L·H·n·ratio) over the model)
        job["compression_ratio"] = ratio
    if inner is not None:
        job["inner"] = inner
    return job


_EA_INNER = {"press": "ExpectedAttentionPress", "kwargs": {"epsilon": 0.01}}
ORACLE_2026 = {
    # ours ↔ kvpress job
    "expected-attention:adaptive=false,epsilon=0.0": _ratio_job("ea", "ExpectedAttentionPress", {}, 100),
    "expected-attention:floor_alpha=0.0": _ratio_job(
        "ea-ada", "AdaKVPress", {"alpha_safeguard": 0.0}, 100, inner=_EA_INNER
    ),  # fmt: skip
    "expected-attention:floor=kvpress": _ratio_job("ea-ada-floor", "AdaKVPress", {}, 100, inner=_EA_INNER),
    "expected-attention:floor=kvpress,floor_alpha=0.9": _ratio_job(
        "ea-ada-floor-0.9", "AdaKVPress", {"alpha_safeguard": 0.9}, 100, inner=_EA_INNER
    ),  # fmt: skip
    "kvzip": _ratio_job("kvzip", "KVzipPress", {}, 150, 0.5),
    "kvzip:level=layer": _ratio_job("kvzip-layer", "KVzipPress", {"layerwise": True}, 150, 0.5),
    "kvzip:chunk=100": _ratio_job("kvzip-chunk", "KVzipPress", {"chunk_size": 100}, 150, 0.5),
    "kvzip+": _ratio_job("kvzip-plus", "KVzipPress", {"kvzip_plus_normalization": True}, 150, 0.5),
    "kvgrad": _ratio_job("kvgrad", "KVgradPress", {}, 150, 0.5),
    "kvgrad:chunk=100": _ratio_job("kvgrad-chunk", "KVgradPress", {"chunk_size": 100}, 150, 0.5),
    # "seed": the runner seeds torch's global generator before the press's prefill (the sketches)
    "leverage": {**_ratio_job("leverage", "LeverageScorePress", {}, 150, 0.5), "seed": 0},
    "leverage:sketch=8": {
        **_ratio_job("leverage-8", "LeverageScorePress", {"sketch_dimension": 8}, 150, 0.5),
        "seed": 0,
    },
    "compactor": {**_ratio_job("compactor", "CompactorPress", {}, 150, 0.5), "seed": 0},
    "compactor:chunk=100,sketch=8": {
        **_ratio_job("compactor-100", "CompactorPress", {"chunk_size": 100, "sketch_dimension": 8}, 150, 0.5),
        "seed": 0,
    },
    "compactor:chunk=96,blending=1.0": {
        **_ratio_job("compactor-96", "CompactorPress", {"chunk_size": 96, "blending": 1.0}, 150, 0.5),
        "seed": 0,
    },
    # "kvzap_weights": the surrogate of that kind the fixture writes, given to both sides
    "kvzap:kind=linear": {
        **_ratio_job("kvzap-linear", "KVzapPress", {"model_type": "linear"}, 150, 0.5),
        "kvzap_weights": "linear",
    },
    "kvzap": {
        **_ratio_job("kvzap-mlp", "KVzapPress", {"model_type": "mlp"}, 150, 0.5),
        "kvzap_weights": "mlp",
    },
    # the paper's threshold (DMSPress around KVzapPress): the last 32 kept, the rest by score ≥ 0
    **{
        f"{name}:kind=linear,threshold=0.0,threshold_window=32": {
            **_ratio_job(
                f"{name}-dms",
                "DMSPress",
                {"threshold": 0.0, "sliding_window_size": 32},
                150,
                0.5,
                inner={"press": "KVzapPress", "kwargs": {"model_type": "linear"}},
            ),
            "kvzap_weights": "linear",
        }  # fmt: skip
        for name in ("kvzap", "kvzap-decoding")
    },
}


def _kvzap_surrogates(model, folder: Path) -> dict[str, str]:
    """A random surrogate of each kind for ``model`` (the oracle's: no training needed to compare)."""
    from kvbudget.methods.kvzap_surrogate import Surrogate, save_surrogate
    from kvbudget.profiles import config_hash

    c = model.config
    layers, kv, hidden = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size
    gen = torch.Generator().manual_seed(11)
    shapes = {
        "linear": {"weight": (layers, kv, hidden), "bias": (layers, kv)},
        "mlp": {"w1": (layers, 32, hidden), "b1": (layers, 32), "w2": (layers, kv, 32), "b2": (layers, kv)},
    }
    meta = {"config_hash": config_hash(c)}
    return {
        kind: str(
            save_surrogate(
                Surrogate(kind, {k: torch.randn(*s, generator=gen) for k, s in t.items()}, meta),
                folder / f"kvzap-{kind}.safetensors",
            )
        )  # fmt: skip
        for kind, t in shapes.items()
    }


#: methods whose layer-0 scores depend on the token alone (a token's pre-RoPE keys are the same
#: wherever it stands): a repeated token's entries tie exactly there and each side's top-k breaks
#: the tie its own way, so layer 0 is compared as the kept tokens (a multiset), deeper layers as positions
#: (kvzap: layer 0's attention input is the token's embedding, normed)
TIED_BY_TOKEN = {"leverage", "kvzap", "kvzap-decoding"}


@pytest.fixture(scope="module")
def oracle_2026(peer_kept: dict) -> dict:
    """kvpress's kept positions for Expected Attention, KVzip and the 2026 presses on the two
    300-token prompts."""
    methods = {job["method"] for job in ORACLE_2026.values()}
    kept = {(sample, method): v for (method, sample, _), v in peer_kept["kept"].items() if method in methods}
    return {**peer_kept, "kept": kept}


def _kept_2026(model, ids: list[int], spec: str, job: dict, **options) -> list[list[list[int]]]:
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.methods.registry import make_method

    parsed = MethodSpec.parse(spec)
    method = make_method(parsed.name, **{**dict(parsed.options), **options})
    if "compression_ratio" in job:
        cache = compress(model, torch.tensor([ids]), method=method, ratio=1.0 - job["compression_ratio"])
    else:
        cache = compress(model, torch.tensor([ids]), method=method, budget=job["budget"])
    return [[layer.head(h)[2][0].tolist() for h in range(layer.num_heads)] for layer in cache.layers]


@pytest.mark.parametrize("sample", ["s1", "s2"])
@pytest.mark.parametrize("spec", list(ORACLE_2026))
def test_new_methods_keep_kvpress_indices(oracle_2026: dict, spec: str, sample: str) -> None:
    """Expected Attention and KVzip configured like kvpress keep kvpress's positions, per layer and head.

    Matched: ``ExpectedAttentionPress`` (uniform heads, ε 0) ↔ ``adaptive=false,epsilon=0``;
    ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2), alpha_safeguard=0)`` ↔ ``floor_alpha=0`` (both
    one top-k over the layer's heads); kvpress's leaderboard entry, ``AdaKVPress(ExpectedAttentionPress(
    epsilon=1e-2))`` (its floor 0.2: each head's own top ``int(0.2·B)`` first) ↔ ``floor=kvpress``,
    and at floor 0.9 (where it binds) ↔ ``floor=kvpress,floor_alpha=0.9``;
    ``KVzipPress`` at ratio 0.5 ↔ ``kvzip`` at ratio 0.5 (one top-k over every layer and head),
    ``layerwise=True`` ↔ ``level=layer``, ``chunk_size=100`` ↔ ``chunk=100`` (three passes, later
    ones quoting the previous chunk's last 8 tokens; kvpress's request text is ours without the
    trailing space, so that case sets ``continue_prompt``); ``KVgradPress`` ↔ ``kvgrad`` (its backward
    pass per chunk; chunk 512, one pass here) and ``chunk_size=100`` ↔ ``kvgrad:chunk=100``;
    ``LeverageScorePress`` ↔ ``leverage`` (the sketches: kvpress draws them from torch's global
    generator, which the runner seeds with the job's ``seed`` before the prefill; ours from a CPU
    generator seeded with the same ``seed``), at the default sketch (48 columns, wider than this
    model's head of 16: the scores are the exact leverage but for the ridge) and at 8 columns (the
    draw decides); layer 0 as kept tokens (``TIED_BY_TOKEN``). ``CompactorPress`` ↔ ``compactor``
    (the same seeded sketches; 288 candidates between its 8 sinks and window of 4: chunks of 256 and
    a short 32 by default, 100, 100 and a short 88, or three whole chunks of 96; ``β`` the ratio 0.5,
    or 1 given on both sides).

    Not matched, by design: the default head floor (kvpress forces each head's top ``int(0.2·B)``
    in; our default is AdaKV's ``n_h(1 − α) + α·B'``, as ``ada-snapkv``), and KVzip with a
    chat template (kvpress scores the template's prefix 0 and evicts it first after its 4 sinks;
    we keep it whole, as the authors' code keeps the system prompt).
    """
    job = ORACLE_2026[spec]
    options = {}
    if spec in ("kvzip:chunk=100", "kvgrad:chunk=100"):
        options["continue_prompt"] = "\n\nRepeat the part of the previous context exactly, starting with"
    if "kvzap_weights" in job:  # the surrogate kvpress's KVzapPress was given
        options["surrogate"] = oracle_2026["kvzap"][job["kvzap_weights"]]
    model = oracle_2026["model"]
    theirs = oracle_2026["kept"][(sample, job["method"])]
    ours = _kept_2026(model, oracle_2026["ids"][sample], spec, job, **options)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(ours) == len(theirs) == layers
    total = sum(len(h) for layer in ours for h in layer)
    assert total == sum(len(h) for layer in theirs for h in layer)
    if "threshold" in spec:  # each head keeps what scores at least the threshold, whatever the budget
        assert total != layers * heads * job["budget"]
    else:
        assert total == layers * heads * job["budget"]
    ids = oracle_2026["ids"][sample]
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        for head, (a, b) in enumerate(zip(mine, peer, strict=True)):
            if layer == 0 and spec.partition(":")[0] in TIED_BY_TOKEN:
                a, b = sorted(ids[i] for i in a), sorted(ids[i] for i in b)
            assert a == b, f"layer {layer} head {head}: {sorted(set(a) ^ set(b))} differ"


def test_new_methods_oracle_has_teeth(oracle_2026: dict) -> None:
    """Our defaults keep other entries than the matched settings (ε, head floor; kvzip chunking), and
    kvpress's floor binds at 0.9 (without a floor this model's heads keep 80 to 120 entries of an
    average 100, so the default 0.2 does not bind here)."""
    ids = oracle_2026["ids"]["s1"]
    model = oracle_2026["model"]
    ea_default = _kept_2026(model, ids, "expected-attention", {"budget": 100})
    assert ea_default != oracle_2026["kept"][("s1", "ea")]
    assert ea_default != oracle_2026["kept"][("s1", "ea-ada")]
    assert ea_default != oracle_2026["kept"][("s1", "ea-ada-floor")]
    assert oracle_2026["kept"][("s1", "ea-ada-floor-0.9")] != oracle_2026["kept"][("s1", "ea-ada")]
    assert oracle_2026["kept"][("s1", "kvzip-chunk")] != oracle_2026["kept"][("s1", "kvzip")]
    assert oracle_2026["kept"][("s1", "kvzip-plus")] != oracle_2026["kept"][("s1", "kvzip")]
    assert oracle_2026["kept"][("s1", "kvgrad")] != oracle_2026["kept"][("s1", "kvzip-plus")]
    assert oracle_2026["kept"][("s1", "kvgrad-chunk")] != oracle_2026["kept"][("s1", "kvgrad")]
    other_draw = _kept_2026(model, ids, "leverage:sketch=8,seed=1", ORACLE_2026["leverage:sketch=8"])
    assert other_draw[1:] != oracle_2026["kept"][("s1", "leverage-8")][1:]  # another seed, other sketches
    other_draw = _kept_2026(model, ids, "compactor:chunk=100,sketch=8,seed=1", ORACLE_2026["compactor"])
    assert other_draw != oracle_2026["kept"][("s1", "compactor-100")]
    assert oracle_2026["kept"][("s1", "kvzap-linear")] != oracle_2026["kept"][("s1", "kvzap-mlp")]
    unblended = _kept_2026(model, ids, "compactor:blending=0.0", ORACLE_2026["compactor"])
    assert unblended != oracle_2026["kept"][("s1", "compactor")]  # the leverage term counts


# ------------------------------------------------------------------ every kvpress counterpart is compared
#: methods with a kvpress press (``kvpress``) whose kept positions cannot equal the press's, and why
#: (measured on this file's model and prompts; `kvbudget bench peer` still pairs some of them)
NOT_COMPARED: dict[str, str] = {
    "random": "RandomPress draws torch.rand over the keys' shape; ours draws per row over its valid "
    "entries from a per-layer seed: the same distribution, other numbers",
    "knorm": "layer 0 holds equal key norms (a repeated token's keys differ only by RoPE, which keeps "
    "the norm): ties at the cut are broken by each side's top-k order (1 or 2 entries swapped per case)",
    "tova": "2 to 6 entries swapped per case (of 4 layers × 2 heads × 80–160), not traced to one cause; "
    "TOVAPress pads the last token's score above every other and scores through SnapKV's one-query "
    "window attention",
    "pyramidkv": "PyramidKVPress derives its layer budgets from the compression ratio with its own float "
    "formula and a uniform fallback; ours is the authors' floored schedule (tests/test_composition.py): "
    "the layers keep other counts (layer 0 at B = 100: 135 here, 100 there)",
    "cam": "CAMPress merges while decoding (a DecodingPress); the kvpress runner compresses the prefill",
}


def oracle_presses() -> dict[str, set[str]]:
    """Every method compared on kept positions in this file → the presses (and inner presses) its
    kvpress jobs run."""
    from kvbudget.eval.runner import MethodSpec

    def presses(job: dict) -> set[str]:
        return {job["press"], *([job["inner"]["press"]] if "inner" in job else [])}

    found: dict[str, set[str]] = {"snapkv": presses(PEERS["snapkv"][1]), "qfilter": {"QFilterPress"}}
    for spec, job, _ in NEW_PEERS.values():
        found.setdefault(MethodSpec.parse(spec).name, set()).update(presses(job))
    for spec, job in ORACLE_2026.items():
        found.setdefault(MethodSpec.parse(spec).name, set()).update(presses(job))
    return found


def test_every_kvpress_counterpart_has_an_oracle() -> None:
    """A method whose class (or combination) names a kvpress press is compared here with that press,
    or ``NOT_COMPARED`` says why it cannot be; every compared method names the press it is compared
    with. Runs without the peer environment."""
    from kvbudget.methods.registry import method_info, method_names

    oracles = oracle_presses()
    counterparts = {name: method_info(name).kvpress for name in method_names() if method_info(name).kvpress}
    missing = sorted(set(counterparts) - set(oracles) - set(NOT_COMPARED))
    assert not missing, (
        f"kvpress counterparts without an oracle: {', '.join(missing)} — add one to NEW_PEERS (or "
        "ORACLE_2026), or say in NOT_COMPARED why kept positions cannot match"
    )
    for name, presses in oracles.items():
        assert counterparts.get(name) in presses, (
            f"{name}: kvpress={counterparts.get(name)!r}, oracle runs {presses}"
        )
    stale = sorted(set(NOT_COMPARED) - set(counterparts))
    assert not stale, f"NOT_COMPARED names methods without a kvpress counterpart: {', '.join(stale)}"
    assert not set(NOT_COMPARED) & set(oracles)
