"""Errors raised by kvbudget.

Every error a user can cause derives from :class:`KVBudgetError` (a ``ValueError``), carries a
one-line message naming the bad value and what is allowed, and is turned into exit code 2 by the CLI.
"""

from __future__ import annotations


class KVBudgetError(ValueError):
    """Base class of all user-facing kvbudget errors."""


class UnknownMethodError(KVBudgetError):
    """A method name that is not in the registry, or an unknown ``@preset``."""


class MethodOptionError(KVBudgetError):
    """A method option the method does not have, does not apply to it, or whose value is not allowed.

    The message names the method, the option and the value. ``method``, ``option`` and ``value``
    hold them where the raising code passed them (``None`` otherwise).
    """

    def __init__(self, message: str, method: str | None = None, option: str | None = None, value=None):
        super().__init__(message)
        self.method, self.option, self.value = method, option, value


class UnsupportedMethodError(KVBudgetError):
    """A method that cannot run in the requested setting (e.g. inside ``model.generate``)."""


class BudgetError(KVBudgetError):
    """A budget or ratio outside its allowed range."""


class InputError(KVBudgetError):
    """Bad prompt input: empty context, prompt longer than the model's context, ..."""


class UnsupportedModelError(KVBudgetError):
    """A model architecture the attention hook cannot serve."""


class ArtifactError(KVBudgetError):
    """A registry artifact (model or data) is missing, or its hash does not match."""


class ProfileError(KVBudgetError):
    """An offline profile (BaKlaVa, SqueezeAttention) that is missing, corrupted or for another model."""


class PathError(KVBudgetError):
    """A file or folder argument that is missing, unreadable or not text, or an output folder that
    cannot be created or written."""


class MissingExtraError(KVBudgetError, ImportError):
    """A feature whose optional extra (``kvbudget[eval]``, ``kvbudget[ray]``) is not installed; the
    message names the extra to install (:mod:`kvbudget.extras`). Also an ``ImportError``."""


class ResultsFileError(KVBudgetError):
    """A results file (``results.jsonl``) that holds something other than complete kvbudget rows."""
