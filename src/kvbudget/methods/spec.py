"""Method specs as text: ``name:key=value,key=value`` (``--methods``) and ``key=value`` pairs (``--opt``).

A spec's ``name`` and ``options`` are what a results row records and its key hashes
(:meth:`kvbudget.eval.runner.Runner.key`): the text as written, not the options a named
combination or a preset expands to.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method
from kvbudget.methods.registry import make_method


@dataclass(frozen=True)
class MethodSpec:
    """A method name with options, parsed from ``name`` or ``name:key=value,key=value``."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        name, _, rest = text.partition(":")
        options = []
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise MethodOptionError(f"method option must be key=value, got {pair!r} in {text!r}")
            options.append((key.strip(), value.strip()))
        spec = cls(name.strip(), tuple(options))
        spec.build()  # validate now, not mid-run
        return spec

    def build(self) -> Method:
        return make_method(self.name, **dict(self.options))

    @property
    def label(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options) if self.options else "")


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["window=64", "pooling=avg"]`` → ``{"window": "64", "pooling": "avg"}`` (the CLI's ``--opt``)."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MethodOptionError(f"--opt expects key=value, got {pair!r}")
        options[key.strip()] = value.strip()
    return options
