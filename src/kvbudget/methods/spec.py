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
    """A method name with options, parsed from ``name`` or ``name:key=value,key=value``.

    ``kv_bits`` (written ``name:kv_bits=4`` like an option, but not the method's: the cache's) stores
    what the method keeps at 2, 4 or 8 bits (``None``: the model's dtype; 16 is read as ``None``).
    ``memory`` (``name:memory=0.125``) is a byte budget instead (``kvbudget.generate(memory=)``): the
    run has no budget or ratio of its own.
    """

    name: str
    options: tuple[tuple[str, str], ...] = ()
    kv_bits: int | None = None
    memory: float | None = None

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        name, _, rest = text.partition(":")
        options = []
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise MethodOptionError(f"method option must be key=value, got {pair!r} in {text!r}")
            options.append((key.strip(), value.strip()))
        bits = [value for key, value in options if key == "kv_bits"]
        memories = [value for key, value in options if key == "memory"]
        options = [(key, value) for key, value in options if key not in ("kv_bits", "memory")]
        kv_bits = None
        if bits:
            if len(bits) > 1 or not bits[0].isdigit() or int(bits[0]) not in (2, 4, 8, 16):
                raise MethodOptionError(f"kv_bits must be one of 2, 4, 8 or 16, got {bits[-1]!r} in {text!r}")
            kv_bits = None if int(bits[0]) == 16 else int(bits[0])
        memory = None
        if memories:
            try:
                memory = float(memories[-1])
            except ValueError:
                memory = -1.0
            if len(memories) > 1 or not 0 < memory <= 1 or kv_bits is not None:
                raise MethodOptionError(
                    f"memory must be one share of the full cache's bytes in (0, 1], no kv_bits, in {text!r}"
                )
        spec = cls(name.strip(), tuple(options), kv_bits, memory)
        spec.build()  # validate now, not mid-run
        return spec

    def build(self) -> Method:
        return make_method(self.name, **dict(self.options))

    @property
    def label(self) -> str:
        pairs = list(self.options) + ([("kv_bits", str(self.kv_bits))] if self.kv_bits is not None else [])
        pairs += [("memory", f"{self.memory:g}")] if self.memory is not None else []
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in pairs) if pairs else "")


def split_storage(text: str) -> tuple[str, int | None, float | None]:
    """``name:opts,kv_bits=b`` or ``name:opts,memory=f`` → (``name:opts``, ``b`` or ``None``, ``f`` or
    ``None``): the storage a spec names, apart from its method (``kv_bits=16`` kept as 16, so that it
    can override a default of fewer bits)."""
    spec = MethodSpec.parse(text)
    keys = {pair.partition("=")[0].strip() for pair in text.partition(":")[2].split(",")}
    bits = 16 if spec.kv_bits is None and "kv_bits" in keys else spec.kv_bits  # parse reads 16 as None
    return MethodSpec(spec.name, spec.options).label, bits, spec.memory


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["window=64", "pooling=avg"]`` → ``{"window": "64", "pooling": "avg"}`` (the CLI's ``--opt``)."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MethodOptionError(f"--opt expects key=value, got {pair!r}")
        options[key.strip()] = value.strip()
    return options
