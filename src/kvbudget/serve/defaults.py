"""``kvbudget serve``'s default compressions, in one place for the CLI, the scheduler, the batcher
and Ray Serve replicas.

They are chosen by the rule in docs/leaderboard.md ("The server's default"): the cheapest
configuration that holds later turns of a conversation. Until its measurements are complete the
server keeps SnapKV for conversations and KVzip under a byte budget of 12.5% for shared documents.
"""

from __future__ import annotations

#: how a request that names no compression is compressed (a method spec, ``--method``)
METHOD = "snapkv"
#: the fraction of its prompt that method keeps (``--ratio``); None: ``kvbudget.generate``'s default
#: budget, 128 entries a KV head
RATIO: float | None = None
#: how a shared document is compressed when its creator names no method (``--document-method``)
DOCUMENT_METHOD = "kvzip:memory=0.125"
#: the fraction of a document its method keeps when the spec names no size (``kvzip``, ``kvzip:kv_bits=4``)
DOCUMENT_RATIO = 0.5
