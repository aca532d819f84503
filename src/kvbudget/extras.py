"""The optional extras and the one-line hint when one is missing.

``pip install kvbudget`` installs what compressing a cache needs (torch, transformers, the GGUF
loader, the CLI). The evaluation harness (:mod:`kvbudget.eval`, :mod:`kvbudget.tuning`,
:mod:`kvbudget.demo`) and the benchmarks (:mod:`kvbudget.bench`) need ``kvbudget[eval]``; distributed
runs and the server's Ray Serve deployment (:mod:`kvbudget.serve.ray_deployment`) need
``kvbudget[ray]``; the server's HTTP side (:mod:`kvbudget.serve.app`) ``kvbudget[serve]``.
Code outside those modules imports them, and the extras' packages, only inside :func:`needs_extra`,
which checks the extra up front and turns its absence into one line::

    with needs_extra("eval", "kvbudget eval"):
        from kvbudget.eval.runner import run_eval
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from kvbudget.errors import MissingExtraError

#: Each extra: (what it is, the import names of the distributions ``pyproject.toml`` lists for it).
#: ``tests/test_dependencies.py`` checks these names against ``pyproject.toml``.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eval": ("the evaluation extra", ("matplotlib", "numpy", "rapidfuzz", "rdata", "rouge_score", "tqdm")),
    "ray": ("the Ray extra", ("ray",)),
    "serve": ("the serving extra", ("prometheus_client", "starlette", "uvicorn")),
}


def missing_modules(extra: str) -> list[str]:
    """The import names of ``extra`` that are not installed (nothing is imported to find out)."""
    return [name for name in EXTRAS[extra][1] if importlib.util.find_spec(name) is None]


def extra_hint(extra: str, what: str, missing: list[str] | None = None) -> str:
    """``"<what> needs the evaluation extra: pip install 'kvbudget[eval]'"`` (one line)."""
    shown = f" (missing: {', '.join(missing)})" if missing else ""
    return f"{what} needs {EXTRAS[extra][0]}: pip install 'kvbudget[{extra}]'{shown}"


def require_extra(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` if one of its packages is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(extra_hint(extra, what, missing))


@contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Check ``extra`` before the block runs (:func:`require_extra`), and turn an ``ImportError`` of
    one of its packages inside the block into :class:`MissingExtraError`. Any other ``ImportError``
    (a missing module that no extra provides, a broken install) passes through unchanged."""
    require_extra(extra, what)
    try:
        yield
    except ImportError as err:
        if isinstance(err, MissingExtraError) or (err.name or "").split(".")[0] not in EXTRAS[extra][1]:
            raise
        raise MissingExtraError(extra_hint(extra, what, [err.name.split(".")[0]])) from None
