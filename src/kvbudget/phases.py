"""The words a run is told in: a session's :class:`Phase` and a method's :class:`Stage`.

A :class:`Phase` says what a compression session's next forward is; only the session moves between
phases, through its named transitions (:class:`kvbudget.session.CompressionSession`:
``begin_prefill``, ``begin_decode``, ``begin_record``, ``stop``, ``begin_reconstruct``); everyone
else reads ``session.phase``. A :class:`Stage` says where a method acts; a method class declares its
stages (``Method.stages``, a tuple of them) and every check reads them as members of this enum.

Both are string enums so their values print, serialise and join as before (``"prefill"``); code
compares members, never strings. They sit at the bottom of the import graph: the cache and the
attention read the phase of the session riding on a cache without knowing the session.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """What a session's next forward is.

    ``PREFILL``: compress each layer right after its attention (post-prefill methods only record
    each layer, and compress all of them after the last); ``DECODE``: decode-stage methods trim each
    layer back to its budget after every step; ``RECORD``: keep each layer's queries and compress
    nothing (a snapshot's full prefill); ``OFF``: the forward appends uncompressed (a question after
    the compression); ``RECONSTRUCT``: KVzip's reconstruction pass over its own session.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    RECORD = "record"
    OFF = "off"
    RECONSTRUCT = "reconstruct"


class Stage(StrEnum):
    """Where a method acts (``Method.stages`` lists them; an empty tuple: it never compresses).

    ``PREFILL``: each layer right after its prefill attention; ``PRUNE``: the prefill runs the
    decoder layers itself and the method shrinks the sequence deeper layers see
    (:mod:`kvbudget.prefill.pruned`); ``POST_PREFILL``: every layer once the last one is prefilled
    (each layer recorded first); ``LOOKAHEAD``: after the prefill, from pseudo-decoded queries;
    ``DECODE``: after every decode step, each layer back to its budget.
    """

    PREFILL = "prefill"
    PRUNE = "prune"
    POST_PREFILL = "post_prefill"
    LOOKAHEAD = "lookahead"
    DECODE = "decode"


#: the stages that compress a layer right after its prefill attention (the session calls
#: ``Method.compress_layer`` for them)
COMPRESS_AT_PREFILL = frozenset({Stage.PREFILL, Stage.PRUNE})


class PhaseError(RuntimeError):
    """An illegal phase transition: a bug in kvbudget (the caller's order of steps), not a user error."""
