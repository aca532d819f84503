"""KVzap (arXiv:2601.07891) against its definition, written out here with loops.

``score[l, h, i] = f_l(x_{l,i})[h]``: ``x_{l,i}`` is layer ``l``'s attention input at token ``i``
(the decoder layer's input normalised by its ``input_layernorm``, read here from transformers' own
``output_hidden_states``), ``f_l`` a linear map or ``Linear → GELU → Linear``. At a budget every KV
head keeps its ``B`` best-scored entries; with a threshold every entry scoring at least ``T`` and
the last ``threshold_window``. The surrogate's training pairs are KVzip+'s scores (checked against
``kvzip+``'s own selection), the ridge fit against the normal equations solved by numpy, the MLP
fit by what it learns.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.errors import KVBudgetError, MethodOptionError, ProfileError
from kvbudget.methods.kvzap_surrogate import (
    Surrogate,
    fit_linear,
    fit_mlp,
    kvzip_plus_pairs,
    load_surrogate,
    rank_correlation,
    save_surrogate,
)
from kvbudget.methods.registry import make_method
from kvbudget.prefill.common import Prompt, prefill_inputs
from kvbudget.prefill.derived import derive, take_snapshot
from kvbudget.profiles import config_hash

LAYERS, KV, HIDDEN = 4, 2, 64  # conftest's TINY


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


def _surrogate(model, kind: str, seed: int = 0) -> Surrogate:
    gen = seeded(seed)
    if kind == "linear":
        tensors = {
            "weight": torch.randn(LAYERS, KV, HIDDEN, generator=gen),
            "bias": torch.randn(LAYERS, KV, generator=gen),
        }
    else:
        tensors = {
            "w1": torch.randn(LAYERS, 8, HIDDEN, generator=gen),
            "b1": torch.randn(LAYERS, 8, generator=gen),
            "w2": torch.randn(LAYERS, KV, 8, generator=gen),
            "b2": torch.randn(LAYERS, KV, generator=gen),
        }
    return Surrogate(kind, tensors, {"config_hash": config_hash(model.config)})


def _attention_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[n, hidden]``: transformers' hidden states entering each layer, normalised."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        return [model.model.layers[i].input_layernorm(states[i])[0] for i in range(LAYERS)]


def _predicted(surrogate: Surrogate, layer: int, x: torch.Tensor, h: int) -> list[float]:
    """The surrogate's score of every token for head ``h``, one token at a time."""
    t = {k: v[layer].double() for k, v in surrogate.tensors.items()}
    out = []
    for i in range(x.shape[0]):
        xi = x[i].double()
        if surrogate.kind == "linear":
            out.append(float(sum(t["weight"][h, j] * xi[j] for j in range(HIDDEN)) + t["bias"][h]))
        else:
            pre = [float(t["w1"][u] @ xi + t["b1"][u]) for u in range(t["w1"].shape[0])]
            act = [0.5 * p * (1 + math.erf(p / math.sqrt(2))) for p in pre]  # GELU, exact
            out.append(sum(t["w2"][h, u].item() * a for u, a in enumerate(act)) + float(t["b2"][h]))
    return out


def _kept(cache) -> list[list[list[int]]]:
    return [[sorted(layer.head(h)[2][0].tolist()) for h in range(KV)] for layer in cache.layers]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kvzap_keeps_each_heads_best_predicted_entries(model, kind, tmp_path) -> None:
    surrogate = _surrogate(model, kind)
    path = save_surrogate(surrogate, tmp_path / f"{kind}.safetensors")
    ids = torch.randint(3, 90, (1, 90), generator=seeded(2))
    cache = kvbudget.compress(
        model, ids, method=make_method("kvzap", kind=kind, surrogate=str(path)), budget=25
    )
    inputs = _attention_inputs(model, ids)
    for layer in range(LAYERS):
        for h in range(KV):
            scores = _predicted(surrogate, layer, inputs[layer], h)
            best = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:25])
            assert _kept(cache)[layer][h] == best, (layer, h)


def test_a_threshold_keeps_what_scores_above_it_and_the_recent_window(model, tmp_path) -> None:
    surrogate = _surrogate(model, "linear", seed=4)
    path = save_surrogate(surrogate, tmp_path / "linear.safetensors")
    ids = torch.randint(3, 90, (1, 80), generator=seeded(5))
    inputs = _attention_inputs(model, ids)
    threshold = float(np.median(_predicted(surrogate, 2, inputs[2], 0)))
    method = make_method(
        "kvzap", kind="linear", surrogate=str(path), threshold=threshold, threshold_window=10
    )
    cache = kvbudget.compress(model, ids, method=method, budget=40)
    counts = set()
    for layer in range(LAYERS):
        for h in range(KV):
            scores = _predicted(surrogate, layer, inputs[layer], h)
            expected = [i for i, s in enumerate(scores) if s >= threshold or i >= 80 - 10]
            assert _kept(cache)[layer][h] == expected, (layer, h)
            counts.add(len(expected))
    assert len(counts) > 1  # each head keeps what its scores say, not the budget


def test_a_snapshot_derives_kvzap_only_with_the_attention_inputs(model, tmp_path) -> None:
    path = save_surrogate(_surrogate(model, "linear"), tmp_path / "linear.safetensors")
    method = make_method("kvzap", kind="linear", surrogate=str(path))
    inputs = prefill_inputs([Prompt(list(range(3, 83)), [])], pad_id=0)
    with pytest.raises(KVBudgetError, match=r"take it with take_snapshot\(\.\.\., attention_inputs=True\)"):
        derive(model, take_snapshot(model, inputs), method, budget=20)
    derived, *_ = derive(model, take_snapshot(model, inputs, attention_inputs=True), method, budget=20)
    direct = kvbudget.compress(model, torch.tensor([list(range(3, 83))]), method=method, budget=20)
    assert _kept(derived) == _kept(direct)


def test_the_surrogate_file_is_checked_against_the_model(model, tmp_path) -> None:
    surrogate = _surrogate(model, "mlp")
    path = save_surrogate(surrogate, tmp_path / "mlp.safetensors")
    loaded = load_surrogate(path, model)
    assert loaded.kind == "mlp" and all(
        torch.equal(loaded.tensors[k], v) for k, v in surrogate.tensors.items()
    )
    other = tiny_model("qwen2")
    other.config.num_hidden_layers = 3  # another architecture: another config hash
    with pytest.raises(ProfileError, match=r"was trained for another model .*kvbudget train kvzap"):
        load_surrogate(path, other)
    with pytest.raises(ProfileError, match="does not exist; run `kvbudget train kvzap"):
        load_surrogate(tmp_path / "missing.safetensors")
    with pytest.raises(ProfileError, match="is not a KVzap surrogate"):
        save_surrogate(Surrogate("linear", {"weight": torch.zeros(1, 1, 1)}), tmp_path / "bad.safetensors")
        load_surrogate(tmp_path / "bad.safetensors")
    with pytest.raises(kvbudget.errors.MethodOptionError, match="kind must be linear or mlp"):
        make_method("kvzap", kind="cubic")


def test_training_pairs_are_the_attention_inputs_and_kvzip_plus_scores(model) -> None:
    """``x`` is each layer's attention input and ``exp(y)`` ranks the entries as ``kvzip+`` does: at
    ``level=head`` its kept entries are the 4 sinks and each head's best scores of ``exp(y)``."""
    ids = torch.randint(3, 90, (1, 100), generator=seeded(7))
    x, y = kvzip_plus_pairs(model, ids[0].tolist())
    assert x.shape == (LAYERS, 96, HIDDEN) and y.shape == (LAYERS, 96, KV)  # KVzip's 4 sinks left out
    for layer, expected in enumerate(_attention_inputs(model, ids)):
        torch.testing.assert_close(x[layer], expected[4:].float())
    cache = kvbudget.compress(model, ids, method=make_method("kvzip+", level="head", chunk=2048), budget=30)
    for layer in range(LAYERS):
        for h in range(KV):
            best = y[layer, :, h].argsort(descending=True)[:26] + 4
            assert _kept(cache)[layer][h] == [0, 1, 2, 3, *sorted(best.tolist())], (layer, h)


def test_the_ridge_fit_solves_the_penalised_least_squares() -> None:
    """min ‖y − Xw − b‖² + α‖w‖², the intercept unpenalised: numpy's least squares on the
    augmented system ``[X 1; √α I 0]``."""
    gen = seeded(0)
    x = torch.randn(2, 50, 6, generator=gen)
    y = torch.randn(2, 50, 3, generator=gen)
    fitted = fit_linear(x, y, alpha=2.0)
    for layer in range(2):
        xs = x[layer].double().numpy()
        aug = np.vstack(
            [np.hstack([xs, np.ones((50, 1))]), np.hstack([math.sqrt(2.0) * np.eye(6), np.zeros((6, 1))])]
        )
        target = np.vstack([y[layer].double().numpy(), np.zeros((6, 3))])
        solution = np.linalg.lstsq(aug, target, rcond=None)[0]  # [7, 3]
        np.testing.assert_allclose(fitted.tensors["weight"][layer].numpy(), solution[:6].T, atol=1e-5)
        np.testing.assert_allclose(fitted.tensors["bias"][layer].numpy(), solution[6], atol=1e-5)


def test_the_mlp_learns_a_nonlinear_score_the_line_cannot() -> None:
    gen = seeded(1)
    x = torch.randn(1, 3000, 8, generator=gen)
    y = torch.stack([x[0, :, 0] ** 2 - x[0, :, 1].abs(), torch.sin(x[0, :, 2])], dim=-1)[None]  # [1, m, 2]
    losses = []
    mlp = fit_mlp(
        x[:, :2500], y[:, :2500], epochs=20, lr=5e-3, batch=256, progress=lambda _e, loss: losses.append(loss)
    )
    line = fit_linear(x[:, :2500], y[:, :2500])
    assert losses[-1] < losses[0] / 3
    held = rank_correlation(mlp, x[:, 2500:], y[:, 2500:])[0]
    assert held > 0.9 > rank_correlation(line, x[:, 2500:], y[:, 2500:])[0] + 0.3


def test_train_kvzap_saves_surrogates_that_kvzap_then_uses(model, tmp_path, monkeypatch) -> None:
    from kvbudget import kvzap_training

    text = "".join(chr(32 + (i * 7919) % 90) for i in range(2000))
    monkeypatch.setattr(kvzap_training, "source_texts", lambda source: [text])
    config = kvzap_training.TrainConfig(passages=6, held_out=2, length=120, tokens=60, epochs=3)
    seen = []
    report = kvzap_training.train_kvzap(
        model, tiny_tokenizer(), config, out=tmp_path, progress=lambda *step: seen.append(step)
    )
    assert ("KVzip+ pairs", 6, 6) in seen and ("MLP epochs", 3, 3) in seen
    assert report.pairs == 4 * 60 and set(report.paths) == {"linear", "mlp"}
    for kind, path in report.paths.items():
        assert len(report.correlation[kind]) == LAYERS and all(-1 <= c <= 1 for c in report.correlation[kind])
        loaded = load_surrogate(path, model)
        assert loaded.meta["held_out_rank_correlation"] == report.correlation[kind]
        ids = torch.randint(3, 90, (1, 80), generator=seeded(9))
        cache = kvbudget.compress(
            model, ids, method=make_method("kvzap", kind=kind, surrogate=path), budget=20
        )
        assert all(length == 20 for layer in cache.layers for length in layer.head_lengths()[0].tolist())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--passages", "1"], "--passages must be ≥ 2"),
        (["--kinds", "cubic"], "--kinds takes linear, mlp"),
        (["--tokens", "5000"], "--tokens in 1..length−8"),
        (["--epochs", "0"], "--epochs must be ≥ 1"),
    ],
)
def test_train_kvzap_refuses_bad_options_in_one_line(args, message) -> None:
    from kvbudget.cli import app

    result = CliRunner().invoke(app, ["train", "kvzap", *args])
    assert result.exit_code != 0 and message in result.output
    assert len(result.output.strip().splitlines()) == 1


# ------------------------------------------------------------------ kvzap-decoding
def _decode(model, method, context: list[int], question: list[int], budget: int, steps: int):
    """Prefill ``context`` compressed, ``question`` appended whole, ``steps`` greedy tokens: the
    cache and every token fed to it (the last generated one is not)."""
    from kvbudget.engine import decode_loop, prefill
    from kvbudget.session import CompressionSession

    session = CompressionSession(method, LAYERS, budget=budget)
    prompt = Prompt(context, question)
    cache, logits, mask, last = prefill(model, [prompt], session, 0, compress_context_only=True)
    decoded = decode_loop(model, cache, logits, mask, last, set(), steps)
    return cache, context + question + decoded.generated[0][:-1]


def test_decoding_by_threshold_evicts_what_leaves_the_window_below_it(model, tmp_path) -> None:
    """Layer 0 (its attention input is the token's normalised embedding, whatever the cache holds):
    after the prefill, the question and 12 decode steps, a head holds exactly the tokens scoring at
    least ``T``, the question and the last ``W`` fed; deeper layers hold their last ``W`` and
    differ per head."""
    surrogate = _surrogate(model, "linear", seed=6)
    path = save_surrogate(surrogate, tmp_path / "linear.safetensors")
    context = torch.randint(3, 90, (40,), generator=seeded(7)).tolist()
    question = torch.randint(3, 90, (6,), generator=seeded(8)).tolist()
    x0 = _attention_inputs(model, torch.tensor([context]))[0]
    threshold = float(np.median(_predicted(surrogate, 0, x0, 0)))
    window = 8
    method = make_method("kvzap-decoding", kind="linear", surrogate=str(path), threshold=threshold,
                         threshold_window=window)  # fmt: skip
    cache, fed = _decode(model, method, context, question, budget=20, steps=12)
    n = len(fed)
    assert n == 40 + 6 + 11
    x0 = _attention_inputs(model, torch.tensor([fed]))[0]
    held = _kept(cache)
    for h in range(KV):
        scores = _predicted(surrogate, 0, x0, h)
        kept = [i for i in range(n) if scores[i] >= threshold or i >= n - window or 40 <= i < 46]
        assert held[0][h] == kept, h  # the question (40–45) appended uncompressed stays
    for layer in range(1, LAYERS):
        for h in range(KV):
            assert held[layer][h][-window:] == list(range(n - window, n)), (layer, h)
    assert len({len(heads) for layer in held for heads in layer}) > 1


def test_decoding_at_a_budget_evicts_the_lowest_scored_outside_the_window(model, tmp_path) -> None:
    """Layer 0 step by step: the prefill keeps each head's 16 best-predicted context tokens, the
    question joins outside the budget (and stays), then every fed token enters and, the head over
    16 + 6, the lowest-scored entry outside the question and the newest ``min(W, budget)`` leaves."""
    surrogate = _surrogate(model, "mlp", seed=9)
    path = save_surrogate(surrogate, tmp_path / "mlp.safetensors")
    context = torch.randint(3, 90, (40,), generator=seeded(10)).tolist()
    question = torch.randint(3, 90, (6,), generator=seeded(11)).tolist()
    method = make_method("kvzap-decoding", kind="mlp", surrogate=str(path), threshold_window=4)
    cache, fed = _decode(model, method, context, question, budget=16, steps=10)
    x0 = _attention_inputs(model, torch.tensor([fed]))[0]
    limit = 16 + len(question)
    for h in range(KV):
        scores = _predicted(surrogate, 0, x0, h)
        held = sorted(sorted(range(40), key=lambda i: (-scores[i], i))[:16]) + list(range(40, 46))
        for token in range(46, len(fed)):
            held.append(token)
            if len(held) > limit:
                free = [i for i in held[:-4] if not 40 <= i < 46]  # the question stays
                held.remove(min(free, key=lambda i: (scores[i], -i)))
        assert _kept(cache)[0][h] == held, h
    assert all(len(heads) == limit for layer in _kept(cache) for heads in layer)


def test_a_threshold_given_as_text_is_a_number() -> None:
    """The CLI's ``kvzap:threshold=-6`` (an option whose default is ``None``) becomes ``-6.0``."""
    assert make_method("kvzap", threshold="-6").threshold == -6.0
    assert make_method("kvzap-decoding", threshold="none").threshold is None
    with pytest.raises(MethodOptionError, match=r"^kvzap: option threshold expects float, got 'six'$"):
        make_method("kvzap", threshold="six")
