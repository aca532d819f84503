"""``kvbudget serve`` on a Ray cluster: N replicas of the same server behind Ray Serve's HTTP proxy;
needs ``kvbudget[ray]`` and ``kvbudget[serve]``.

Each replica is a Ray actor that loads the model once and runs what ``kvbudget serve`` runs on one
machine: its own :class:`~kvbudget.serve.scheduler.Scheduler` (one worker thread, its own KV memory
cap, its own queue and its own store of finished conversations) behind the same OpenAI-compatible
app (:func:`~kvbudget.serve.app.create_app`, its routes unchanged: chat, completions, streaming,
models, health, metrics, the API key). Ray Serve's proxy takes each HTTP request and hands it to
one replica; every answer carries the header ``x-kvbudget-replica: host:pid`` naming the replica
that served it.

Limits:

- The cap is per replica: N replicas hold up to N × ``memory_cap`` of KV cache, each under its own
  cap; no replica sees another's memory.
- Each replica keeps its own finished conversations. A follow-up reuses its conversation's
  compressed cache only when Serve routes it to the replica that served the earlier turn; routed
  elsewhere it is answered all the same, with its whole prompt prefilled again (``reused_tokens``
  0 in its usage). Serve routes by load, not by conversation.
- A replica takes at most ``max_queue`` requests at once (decoding, or waiting for room under its
  cap); more wait in Serve's queue for a replica with a free slot, so the scheduler's own queue
  never fills (no 429 from it).
- ``/health`` and ``/metrics`` answer for whichever replica the request reached (the header says
  which); Ray's dashboard and metrics see the cluster.
- Every node that may run a replica needs the model: fetch a registry model on each node
  (``kvbudget fetch model NAME``) or give a path every node can read.

Three ways in: :func:`deploy` (Python: start Serve's proxy on a port and deploy), :func:`build_app`
(the Serve application, for ``serve.run``), and :func:`app_builder` (``serve run
kvbudget.serve.ray_deployment:app_builder model=... replicas=2 memory_cap=2GiB``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbudget.engine import check_size
from kvbudget.errors import InputError, MissingExtraError
from kvbudget.extras import extra_hint, needs_extra, require_extra
from kvbudget.methods.spec import MethodSpec
from kvbudget.serve import defaults
from kvbudget.serve.batcher import Compression, full_cache_size_refusal
from kvbudget.units import parse_size

#: a zero-argument function returning ``(model, tokenizer)``; it runs in each replica
ModelFactory = Callable[[], tuple[Any, Any]]

#: the response header naming the replica that answered
REPLICA_HEADER = "x-kvbudget-replica"

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ReplicaConfig:
    """What each replica runs (validated on the driver, before any replica starts).

    Attributes:
        model: a registry name, a local Hugging Face directory or ``.gguf`` file (loaded with
            :func:`kvbudget.load_model`), or a :data:`ModelFactory` (Ray pickles it to the replicas).
        memory_cap: KV bytes each replica may hold, all its conversations together.
        default: the compression of a request that names none.
        max_queue: requests a replica takes at once (Serve's ``max_ongoing_requests``).
        api_key: require ``Authorization: Bearer KEY`` on ``/v1`` and ``/metrics``.
        served_name: the model's name in the API.
        device, dtype: where and how :func:`kvbudget.load_model` loads the weights (not used with a
            factory).
        cache_dir, cache_dir_cap: a folder every replica writes its shared documents to and finds the
            others' in (``kvbudget serve --cache-dir``), and the bytes it may hold.
        document_method: how a document is compressed when its creator names no method.
    """

    model: str | ModelFactory
    memory_cap: int
    default: Compression
    max_queue: int
    api_key: str | None
    served_name: str
    device: str
    dtype: str
    cache_dir: str | None = None
    cache_dir_cap: int = 10 << 30
    document_method: str = defaults.DOCUMENT_METHOD


class ServeReplica:
    """One replica: the model, loaded once, its scheduler under its own cap, and the app serving it.

    Ray Serve builds the ASGI app after the constructor (``__serve_build_asgi_app__``) and runs its
    lifespan, which starts the scheduler's worker thread (and stops it when the replica stops)."""

    def __init__(self, config: ReplicaConfig) -> None:
        from kvbudget.models import load_model
        from kvbudget.serve.app import prometheus_metrics
        from kvbudget.serve.scheduler import Scheduler

        if callable(config.model):
            model, tokenizer = config.model()
        else:
            model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
        self.config = config
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self.registry, metrics = prometheus_metrics()
        document_dir = None
        if config.cache_dir is not None:
            from kvbudget.serve.document_dir import DocumentDir

            document_dir = DocumentDir(config.cache_dir, config.cache_dir_cap)
        self.scheduler = Scheduler(
            model, tokenizer, config.memory_cap, config.default, max_queue=config.max_queue, metrics=metrics,
            document_default=Compression.for_document(config.document_method),
            document_dir=document_dir,
        )  # fmt: skip

    def __serve_build_asgi_app__(self) -> Any:
        from kvbudget.serve.app import create_app

        app = create_app(self.scheduler, self.config.served_name, self.registry, self.config.api_key)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        return app


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries :data:`REPLICA_HEADER` with the replica's name."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def ray_serve() -> Any:
    """The ``ray.serve`` module; one line naming the extra when Ray, Serve's own packages (FastAPI,
    aiohttp, ...: ``ray[serve]``) or the serving extra are missing."""
    what = "a Ray Serve deployment"
    require_extra("serve", what)
    with needs_extra("ray", what):
        try:
            from ray import serve
        except ImportError as err:  # Ray without ray[serve]'s packages
            if (err.name or "").split(".")[0] == "ray":
                raise
            raise MissingExtraError(extra_hint("ray", what, [f"{err.name} (ray[serve])"])) from None
    return serve


def replica_config(
    model: str | os.PathLike[str] | ModelFactory = "smollm2-135m",
    memory_cap: int | str = "2GiB",
    method: str = defaults.METHOD,
    budget: int | None = None,
    ratio: float | None = defaults.RATIO,
    max_queue: int = 64,
    api_key: str | None = None,
    served_name: str | None = None,
    device: str = "auto",
    dtype: str = "bfloat16",
    cache_dir: str | os.PathLike[str] | None = None,
    cache_dir_cap: int | str = "10GiB",
    document_method: str = defaults.DOCUMENT_METHOD,
) -> ReplicaConfig:
    """A :class:`ReplicaConfig` from ``kvbudget serve``'s options, with its one-line errors (a local
    model path is made absolute: a replica's working directory is not the driver's)."""
    cap = memory_cap if isinstance(memory_cap, int) else parse_size(memory_cap)
    if cap <= 0:
        raise InputError(f"memory_cap must be positive, got {memory_cap} bytes")
    check_size(budget, ratio)
    if max_queue < 1:
        raise InputError(f"max_queue must be at least 1, got {max_queue}")
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    spec = MethodSpec.parse(method)  # a bad method fails here, not in every replica
    if budget is not None and method != "full":
        spec.build().check_budget(budget)
    if spec.memory is not None and (budget, ratio) != (None, None):
        raise InputError(f"give memory or budget/ratio, not both: method {method!r} is a byte budget")
    refusal = full_cache_size_refusal(method, budget, ratio, None)
    if refusal is not None:
        raise InputError(refusal)
    if not callable(model):
        name = str(model)
        model = str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else name
        served_name = served_name or name
    elif served_name is None:
        raise InputError("give served_name with a model factory (the model's name in the API)")
    Compression.for_document(document_method)  # a bad spec fails here too
    folder = str(Path(cache_dir).expanduser().resolve()) if cache_dir is not None else None
    dir_cap = cache_dir_cap if isinstance(cache_dir_cap, int) else parse_size(cache_dir_cap, "cache_dir_cap")
    # the spec's own storage too: `snapkv:memory=0.125`, `full:kv_bits=4`
    default = Compression.from_spec(method, ratio=ratio, budget=budget)
    return ReplicaConfig(model, cap, default, max_queue, api_key, served_name, device, dtype, folder, dir_cap,
                         document_method)  # fmt: skip


def build_app(
    model: str | os.PathLike[str] | ModelFactory = "smollm2-135m",
    *,
    replicas: int = 2,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    name: str = "kvbudget",
    **options: Any,
) -> Any:
    """The Ray Serve application (``serve.run(build_app(...))``): ``replicas`` copies of the server,
    each on ``cpus_per_replica`` CPUs and ``gpus_per_replica`` GPUs (Ray shows a replica only the GPUs
    it asked for, so ``device="auto"`` is the GPU exactly when it asked for one). ``options``: those
    of :func:`replica_config` (``memory_cap`` per replica, ``method``, ``budget``/``ratio``,
    ``max_queue``, ``api_key``, ``served_name``, ``device``, ``dtype``)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"replicas must be an integer of at least 1, got {replicas!r}")
    if cpus_per_replica < 0 or gpus_per_replica < 0:
        raise InputError(
            f"cpus_per_replica and gpus_per_replica must be 0 or more, got {cpus_per_replica} and "
            f"{gpus_per_replica}"
        )
    config = replica_config(model, **options)
    serve = ray_serve()
    deployment = serve.deployment(
        serve.ingress()(ServeReplica),
        name=name,
        num_replicas=replicas,
        max_ongoing_requests=config.max_queue,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
    )
    return deployment.bind(config)


def deploy(
    model: str | os.PathLike[str] | ModelFactory = "smollm2-135m",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    route_prefix: str = "/",
    name: str = "kvbudget",
    **options: Any,
) -> str:
    """Deploy :func:`build_app` (``options``: its keywords and :func:`replica_config`'s) on the Ray
    cluster this process is connected to (``ray.init(address=...)`` first; else Ray starts a local
    one), with Serve's HTTP proxy on ``host:port``; returns the base URL once every replica answers.
    The proxy's host and port are the cluster's: set by the first :func:`deploy` (or ``serve
    start``) and kept until ``serve.shutdown()``."""
    if not 0 < port < 65536:
        raise InputError(f"port must be in 1..65535, got {port}")
    if not route_prefix.startswith("/"):
        raise InputError(f"route_prefix must start with '/', got {route_prefix!r}")
    app = build_app(model, name=name, **options)
    serve = ray_serve()
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


#: ``serve run`` arguments (strings on its command line) and how each is read
_BUILDER_ARGS: dict[str, Callable[[str], Any]] = {
    "model": str, "replicas": int, "memory_cap": str, "method": str, "budget": int, "ratio": float,
    "max_queue": int, "api_key": str, "served_name": str, "device": str, "dtype": str,
    "cpus_per_replica": float, "gpus_per_replica": float, "cache_dir": str, "cache_dir_cap": str,
    "document_method": str,
}  # fmt: skip


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run kvbudget.serve.ray_deployment:app_builder key=value ...`` (or a Serve config
    file's ``args``): the keys of :func:`build_app`. Without ``api_key``, ``KVBUDGET_API_KEY`` is
    read, as ``kvbudget serve`` does."""
    unknown = sorted(set(args) - set(_BUILDER_ARGS))
    if unknown:
        raise InputError(f"unknown argument(s) {', '.join(unknown)}: expected {', '.join(_BUILDER_ARGS)}")
    options: dict[str, Any] = {}
    for key, value in args.items():
        try:
            options[key] = _BUILDER_ARGS[key](value)
        except ValueError:
            kind = "an integer" if _BUILDER_ARGS[key] is int else "a number"
            raise InputError(f"{key} must be {kind}, got {value!r}") from None
    if "api_key" not in options and os.environ.get("KVBUDGET_API_KEY"):
        options["api_key"] = os.environ["KVBUDGET_API_KEY"]
    return build_app(**options)
