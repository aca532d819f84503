"""Papers' comparison settings: a seed paper's baselines configured the way that paper ran them.

A seed paper compares itself with baselines set up its own way (ASL runs FastKV with window 32
and average pooling; LAVa's Appendix D gives every baseline max-pool kernel 7). Our methods keep
their own papers' defaults; a preset applies the comparing paper's settings on top of them. Write
``method@preset`` wherever a method name is accepted (``make_method("fastkv@asl")``, ``--methods
fastkv@asl,gemfilter@asl``, ``--method snapkv@lava``); options given explicitly still win.
``kvbudget methods`` lists the presets.

Each entry maps a preset to ``{method: {option: value}}``, with the paper's words beside it.
"""

from __future__ import annotations

from typing import Any

from kvbudget.errors import UnknownMethodError

#: preset → method → options (the comparing paper's settings for that baseline)
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # --- asl: ASL's comparison settings (entries below) ---
    # --- lava: LAVa's Appendix D settings (entries below) ---
}

#: preset → where its settings come from (shown by ``kvbudget methods``)
PRESET_SOURCES: dict[str, str] = {
    # --- sources (one line per preset) ---
}


def split_preset(name: str) -> tuple[str, str | None]:
    """``"fastkv@asl"`` → ``("fastkv", "asl")``; a plain name → ``(name, None)``."""
    base, sep, preset = name.partition("@")
    return base, (preset if sep else None)


def preset_options(name: str) -> tuple[str, dict[str, Any]]:
    """The base method name and the options its preset sets (none for a plain name).

    Raises :class:`UnknownMethodError` for an unknown preset or one that does not cover the method.
    """
    base, preset = split_preset(name)
    if preset is None:
        return base, {}
    if preset not in PRESETS:
        known = ", ".join(PRESETS) or "none"
        raise UnknownMethodError(f"unknown preset '{preset}' in '{name}': presets are {known}")
    methods = PRESETS[preset]
    if base not in methods:
        raise UnknownMethodError(
            f"preset '{preset}' has no settings for '{base}': it covers {', '.join(methods)}"
        )
    return base, dict(methods[base])
