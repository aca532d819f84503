"""``kvbudget tune`` looks parameters up at the ratio it tunes for — the one an evaluation uses."""

from __future__ import annotations

import pytest
import torch

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.methods.baklava import BaKlaVa
from kvbudget.methods.profiled import ProfiledMethod
from kvbudget.methods.registry import make_method
from kvbudget.profiles import build_profile, load_profile, prompt_from_spec, save_profile
from kvbudget.tuning import tune

LENGTH, RATIO, CHUNK = 96, 0.25, 16
BUDGET = 24  # RATIO · LENGTH


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))


@pytest.fixture
def spied(monkeypatch):
    """Every ratio at which a profiled method looked up ``p`` or ``(t, r)``, with the ``p`` it got."""
    calls: list[tuple[str, float, float | None]] = []
    real_p, real_tr = ProfiledMethod.resolved_p, BaKlaVa.resolved_tr

    def resolved_p(self, run, ratio):
        p = real_p(self, run, ratio)
        calls.append(("p", ratio, p))
        return p

    def resolved_tr(self, run, ratio):
        calls.append(("tr", ratio, None))
        return real_tr(self, run, ratio)

    monkeypatch.setattr(ProfiledMethod, "resolved_p", resolved_p)
    monkeypatch.setattr(BaKlaVa, "resolved_tr", resolved_tr)
    return calls


def _profile_path(model, tmp_path):
    """A profile whose stored SqueezeAttention ``p`` differs at 0.25 and at 0.6 = 24 / (24 + 16),
    the ratio the chunked perplexity's first prefill + chunk would otherwise see."""
    tok = tiny_tokenizer()
    profile = build_profile(model, [prompt_from_spec("builtin-text:120", tok)])
    profile.tuned = {
        "squeezeattention": {"0.25": {"best": {"p": 0.7}}, "0.6": {"best": {"p": 0.2}}},
    }
    return save_profile(profile, tmp_path / "p.json")


def test_tuning_looks_up_parameters_at_the_ratio_an_evaluation_uses(tmp_path, spied):
    model = tiny_model()
    path = _profile_path(model, tmp_path)
    texts = [torch.randint(3, 90, (1, LENGTH), generator=seeded(s)) for s in (5, 6)]
    # t = 0.5, r = 0.5 are given by the grid; p (the layer split) is looked up
    entry = tune(
        model, None, path, "baklava", RATIO, length=LENGTH, grid={"t": [0.5], "r": [0.5]}, texts=texts,
        chunk=CHUNK, progress=False,
    )  # fmt: skip
    assert entry["complete"] and entry["settings"]["lookup_ratio"] == RATIO
    assert {kind for kind, _, _ in spied} == {"p", "tr"}
    assert {ratio for _, ratio, _ in spied} == {RATIO}
    assert {p for kind, _, p in spied if kind == "p"} == {0.7}
    assert load_profile(path, model).tuned["baklava"]["0.25"]["best"] == {
        "t": 0.5, "r": 0.5, **{k: entry["best"][k] for k in ("nll", "perplexity")}
    }  # fmt: skip

    # an evaluation at the same ratio: prefill of LENGTH tokens at RATIO · LENGTH, then decode steps
    spied.clear()
    method = make_method("baklava", profile=str(path), t=0.5, r=0.5)
    cache = kvbudget.compress(model, texts[0], method=method, budget=BUDGET)
    with torch.no_grad():
        token = texts[0][:, -1:]
        for _ in range(3):
            token = model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    assert spied and {ratio for _, ratio, _ in spied} == {RATIO}
    assert {p for kind, _, p in spied if kind == "p"} == {0.7}
