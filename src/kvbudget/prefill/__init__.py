"""The prefill: a prompt batch into a compressed :class:`~kvbudget.cache.BudgetCache`, three ways.

Strategies, side by side:

- **layer-wise** (:mod:`kvbudget.prefill.layerwise`): one forward of the model with kvbudget's
  attention attached; each layer compresses its cache right after its attention
  (:class:`~kvbudget.session.CompressionSession`). ``kvbudget.generate`` and the CLI use it;
  ``model.generate`` reaches the same steps through :class:`kvbudget.native.CompressingCache`.
- **derived** (:mod:`kvbudget.prefill.derived`): one full prefill (a
  :class:`~kvbudget.prefill.common.Snapshot`) from which every method's compressed cache is
  derived, bit-identical to its layer-wise run — the evaluation grid's shared prefill.
- **pruned** (:mod:`kvbudget.prefill.pruned`): prune-stage methods (ASL, FastKV, GemFilter,
  PyramidInfer) run the decoder's layers themselves and continue the deeper layers on the tokens
  they selected; both strategies above hand such a method to it.

What they share (prompt batching, the compressed part's forward, lookahead, the uncompressed
question of a question-agnostic run) is :mod:`kvbudget.prefill.common`; a full prefill recorded for
later (the derived strategy's snapshot, KVzap's training pairs) is
:func:`kvbudget.prefill.record.record_prefill`; a decode-stage method's running cache (the chunked
perplexity) is :func:`kvbudget.prefill.layerwise.prefill_for_decoding`. Every prefill goes through
this package, and none moves a session between phases by hand: the session's named transitions do
(:mod:`kvbudget.session`).
"""
