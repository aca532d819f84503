"""``kvbudget serve``: an OpenAI-compatible server decoding many compressed caches in one batch.

Layers, lowest first: :mod:`~kvbudget.serve.batcher` (torch: prefill one request, decode every
active sequence in one forward over a :class:`~kvbudget.joined_cache.JoinedCache`),
:mod:`~kvbudget.serve.scheduler` (the model's worker thread: admission under the memory cap, the
queue, conversation reuse), :mod:`~kvbudget.serve.openai_api` (request validation and OpenAI's
response shapes), :mod:`~kvbudget.serve.app` (the ASGI app; needs ``kvbudget[serve]``) and
:mod:`~kvbudget.serve.ray_deployment` (replicas of that app on Ray Serve; needs ``kvbudget[ray]``).
docs/serving.md is the user's guide.
"""
