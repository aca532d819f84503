"""``kvbudget serve``'s default compressions, in one place for the CLI, the scheduler, the batcher
and Ray Serve replicas.

They are chosen by the rule in docs/leaderboard.md ("The server's default"): the configuration
with the fewest bytes that holds later turns of a conversation, in both of its modes (one
conversation; separate requests on one context), among those cheap enough to run on every request.
For conversations that is the full cache stored at 4 bits: no entry evicted, a third of the bf16
cache's bytes (every eviction the rule measured, and the byte budgets at 12.5%, lost later turns or
were undecided). For shared documents, whose compression is paid once, it is KVzip keeping half
the document stored at 4 bits (17% of the bytes).
"""

from __future__ import annotations

#: how a request that names no compression is compressed (a method spec, ``--method``)
METHOD = "full:kv_bits=4"
#: the fraction of its prompt that method keeps (``--ratio``); None: the method's own size (the full
#: cache keeps everything; another method ``kvbudget.generate``'s default budget, 128 entries a KV head)
RATIO: float | None = None
#: how a shared document is compressed when its creator names no method (``--document-method``)
DOCUMENT_METHOD = "kvzip:kv_bits=4"
#: the fraction of a document its method keeps when the spec names no size (``kvzip``, ``kvzip:kv_bits=4``)
DOCUMENT_RATIO = 0.5
