"""The path a ``kvbudget.generate`` run takes through kvbudget's modules during its prefill (#73).

    .venv/bin/python lab/scripts/trace_prefill_path.py [--method asl] [--path]

A tiny random Llama (tests/conftest.py's ``tiny_model``) generates one token with ``method`` (a
prune-stage method by default); ``sys.setprofile`` follows every Python call from
``kvbudget.engine.generate`` until its ``prefill(...)`` returns. A *visit* is a call that enters a
kvbudget module from another one (the nearest kvbudget frame below it on the stack); a *return* is
the frame of such a visit handing control back to a different kvbudget module (a generator's yield
counts as a return, its resumption as a visit).

Two views are printed:

- **orchestration**: only the calls made outside the model's forward (no ``nn.Module`` call on
  the stack): how the prefill strategy, the session, the method and the cache hand work to each
  other before and after the forwards;
- **everything**: every module transition, the per-layer attention hook and the method's scoring
  included (one line per module).

``--path`` also prints the orchestration path itself, one transition a line.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "kvbudget"


def _module_of(frame: FrameType) -> str | None:
    """The kvbudget module a frame runs in (``prefill/pruned.py``), or ``None`` outside kvbudget."""
    filename = frame.f_code.co_filename
    if not filename.startswith(str(PACKAGE)):
        return None
    return str(Path(filename).relative_to(PACKAGE))


def _is_module_call(frame: FrameType) -> bool:
    """Whether the frame is torch's ``nn.Module.__call__`` (the model's forward, or a submodule's)."""
    code = frame.f_code
    return code.co_name == "_call_impl" and code.co_filename.endswith("torch/nn/modules/module.py")


class PathTracer:
    """A ``sys.setprofile`` hook counting visits to and returns from kvbudget modules.

    Attributes:
        visits, returns: per view (``"orchestration"``, ``"everything"``), per module, the counts.
        arrivals: per view, per module, how often control came to it: visits to it, and returns
            into it from another module (the back and forth a reader follows).
        path: the orchestration view's transitions, ``(arrow, from_module, to_module, function)``.
    """

    def __init__(self) -> None:
        self.stack: list[tuple[str | None, bool]] = []  # per frame: its module, and nn.Module call
        self.model_depth = 0  # nn.Module calls on the stack
        self.visits: dict[str, Counter[str]] = {"orchestration": Counter(), "everything": Counter()}
        self.returns: dict[str, Counter[str]] = {"orchestration": Counter(), "everything": Counter()}
        self.arrivals: dict[str, Counter[str]] = {"orchestration": Counter(), "everything": Counter()}
        self.path: list[tuple[str, str, str, str]] = []

    def _nearest_module(self) -> str:
        for module, _ in reversed(self.stack):
            if module is not None:
                return module
        return "(caller)"

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module, module_call = _module_of(frame), _is_module_call(frame)
            caller = self._nearest_module()
            if module is not None and module != caller:
                self._count(self.visits, module, self.model_depth == 0)
                self._count(self.arrivals, module, self.model_depth == 0)
                if self.model_depth == 0:
                    self.path.append(("->", caller, module, frame.f_code.co_name))
            self.stack.append((module, module_call))
            self.model_depth += module_call
        elif event == "return" and self.stack:
            module, module_call = self.stack.pop()
            self.model_depth -= module_call
            caller = self._nearest_module()
            if module is not None and module != caller:
                self._count(self.returns, module, self.model_depth == 0)
                self._count(self.arrivals, caller, self.model_depth == 0)
                if self.model_depth == 0:
                    self.path.append(("<-", module, caller, frame.f_code.co_name))

    def _count(self, counts: dict[str, Counter[str]], module: str, outside_model: bool) -> None:
        counts["everything"][module] += 1
        if outside_model:
            counts["orchestration"][module] += 1


def trace(method: str, budget: int) -> PathTracer:
    """Run ``kvbudget.generate`` on a tiny model with ``method`` and trace its prefill."""
    sys.path.insert(0, str(ROOT / "tests"))
    import kvbudget.engine as engine
    from conftest import tiny_model, tiny_tokenizer

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    context = "The quick brown fox jumps over the lazy dog. " * 6
    engine.generate(model, tokenizer, context, "Who jumps?", method=method, budget=budget, max_new_tokens=1)

    tracer = PathTracer()
    real_prefill = engine.prefill

    def traced_prefill(*args: Any, **kwargs: Any) -> Any:
        sys.setprofile(tracer)
        try:
            return real_prefill(*args, **kwargs)
        finally:
            sys.setprofile(None)

    engine.prefill = traced_prefill
    try:
        engine.generate(
            model, tokenizer, context, "Who jumps?", method=method, budget=budget, max_new_tokens=1
        )
    finally:
        engine.prefill = real_prefill
    return tracer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", default="asl")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--path", action="store_true", help="print the orchestration path too")
    args = parser.parse_args()
    tracer = trace(args.method, args.budget)
    for view in ("orchestration", "everything"):
        visits, returns, arrivals = tracer.visits[view], tracer.returns[view], tracer.arrivals[view]
        print(f"{view}: {sum(visits.values())} visits, {sum(returns.values())} returns")
        for module in sorted(arrivals, key=lambda m: (-arrivals[m], m)):
            print(
                f"  {module:32s} visits {visits[module]:4d}  returns {returns[module]:4d}"
                f"  arrivals {arrivals[module]:4d}"
            )
    if args.path:
        print("orchestration path:")
        for arrow, source, target, function in tracer.path:
            print(
                f"  {source} {arrow} {target}  ({function})"
                if arrow == "->"
                else f"  {target} {arrow} {source}  (from {function})"
            )


if __name__ == "__main__":
    main()
