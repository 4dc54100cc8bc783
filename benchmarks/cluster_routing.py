"""Routing on a cluster: span affinity vs round robin vs prefix affinity vs one server.

``minipic serve --replicas N --router R`` runs N vLLM replicas behind one URL (Ray Serve). Each
replica has its own prefix cache, so a span only helps a question whose final prompt lands on a
replica that holds it. What this measures, side by side in ONE run, on the same questions in the
same order, each configuration on a fresh server process (cold caches):

* ``single`` — plain ``minipic serve`` (one vLLM server, no Ray): the reference a cluster is
  compared with (same cores, one cache);
* ``--replicas N`` with each router of ``--routers``: ``span`` (minipic's span-affinity router:
  replicas scored by span blocks held anywhere in the prompt), ``round_robin`` (no affinity: the
  floor), ``prefix`` (Ray's PrefixCacheAffinityRouter: leading-run affinity), ``pow2`` (Ray's
  default);
* ``ROUTER+store`` for each router of ``--store-routers``: the same cluster with
  ``--span-store DIR`` (a fresh empty directory per configuration, removed afterwards), which
  every replica uses as its shared tier: a span one replica computed is loaded by another
  instead of recomputed.

Workload: the bench's warm-corpus shape (``minipic.bench.workloads.rag_workload`` with one
relevant passage and a small shared pool), so passages recur across questions at different
positions and after different system prompts. The batch goes through
``SyncOrchestrator.connect(url).answer_many`` (ISPS: span prefills, then finals).

Per configuration: samples/s (batch wall time), the cache hit rate over final prompts
(sum cached / sum prompt tokens), how much of what the client expected cached was cached (a
span warmed on one replica and a final sent to another shows here), TTFT p50/p95, span prefills
sent, and for clusters the router's own state after the run (``GET /minipic/cluster``: hashing
cost in the ingress, the span router's decision cost and reasons, blocks each replica holds).
Ratios are reported against ``round_robin`` and against ``single`` of the same run; no
thresholds: the numbers are evidence, compared within one run on one machine.

Caveats: every replica gets the same KV budget as the single server, so a cluster holds N times
the cache; on CPU the replicas split the machine's cores (``--replicas-per-node``), the single
server uses them all. An untimed, salted warm-up (``--warmup``) pays each engine's first-request
costs without warming the measured spans.

    python benchmarks/cluster_routing.py                       # SmolLM2, 48 questions, ~15 min
    python benchmarks/cluster_routing.py --model tiny-llama --questions 6 --routers span

Writes ``cluster_routing.json`` and ``cluster_routing.png`` under ``--out`` (plus each server's
log under ``--out/logs``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from minipic.serving.cluster_app import ROUTERS  # the routers `--router` takes
from minipic.serving.replica import free_port

HEALTH_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
CONFIG_PATH = "/minipic/config"
CLUSTER_PATH = "/minipic/cluster"


# -- servers -------------------------------------------------------------------------------------


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Server:
    """``minipic serve`` in a session of its own, its output in ``log``.

    ``replicas``: a cluster answers ``GET /minipic/config`` as soon as ONE engine replica runs
    (it serves with a replica down), so the benchmark waits until ``cluster.running`` reaches
    N; measuring earlier would time a 1-replica cluster."""

    def __init__(self, argv: list[str], log: Path, replicas: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "minipic.cli", "serve", "--port", str(self.port),
                     *argv]
        self.log = log
        self.replicas = replicas
        self.proc: subprocess.Popen[bytes] | None = None

    def _ready(self, config: dict[str, Any]) -> bool:
        if self.replicas is None:
            return True
        return (config.get("cluster") or {}).get("running", 0) >= self.replicas

    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> float:
        """Start and wait until ``GET /minipic/config`` answers 200 with every replica running;
        returns the seconds taken."""
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minipic serve exited with {self.proc.returncode} during "
                                   f"start-up; {self.log} ends:\n{_tail(self.log)}")
            try:
                response = httpx.get(self.url + CONFIG_PATH, timeout=5)
                if response.status_code == 200 and self._ready(response.json()):
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"minipic serve not healthy after {timeout:.0f} s; {self.log} ends:\n"
                           f"{_tail(self.log)}")

    def get_json(self, path: str) -> Any:
        import httpx

        response = httpx.get(self.url + path, timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """SIGTERM ``minipic serve`` (it stops vLLM / the Ray cluster in order), SIGKILL its
        session after ``timeout``; then stop whatever of its session is still running."""
        from minipic.serving.supervise import stop_group

        if self.proc is None:
            return {"exit_code": None, "killed": False, "stop_s": 0.0, "leftovers_killed": False}
        started = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        stop_s = time.monotonic() - started
        # the session's pgid is the server's pid (start_new_session): anything still in it
        leftovers = stop_group(self.proc.pid, 5.0)
        return {"exit_code": self.proc.returncode, "killed": killed, "stop_s": stop_s,
                "leftovers_killed": leftovers}


# -- measuring -----------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float | None:
    from minipic.bench.runner import percentile

    return percentile(values, q) if values else None


def _timed_state(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """The router's numbers for the timed batch alone (``after`` minus the warm-up's)."""
    before = before or {}
    n0, n1 = before.get("requests", 0), after.get("requests", 0)
    hashed = n1 - n0
    out: dict[str, Any] = {
        "router": after.get("router"),
        "requests": hashed,
        "hash_ms_mean": (after.get("hash_ms_mean", 0.0) * n1 - before.get("hash_ms_mean", 0.0)
                         * n0) / hashed if hashed else None,
        "ingress_retries": after.get("ingress_retries", 0) - before.get("ingress_retries", 0),
    }
    if "decisions" in after:
        d0, d1 = before.get("decisions", {}), after["decisions"]
        decisions = {k: v - d0.get(k, 0) for k, v in d1.items() if v - d0.get(k, 0)}
        c0, c1 = sum(d0.values()), sum(d1.values())  # one decision per choose_replicas call
        out["decisions"] = decisions
        out["choose_ms_mean"] = (after.get("choose_ms_mean", 0.0) * c1
                                 - before.get("choose_ms_mean", 0.0) * c0) / (c1 - c0) \
            if c1 > c0 else None
    replicas = after.get("replicas")
    if isinstance(replicas, dict):
        out["replicas_seen"] = len(replicas)  # by the span router: fewer than N is a warning
        out["blocks_held"] = {k: v.get("blocks_held") for k, v in replicas.items()}
        out["matchable"] = {k: v.get("matchable") for k, v in replicas.items()}
    return out


def _metrics(results: Sequence[Any], elapsed: float) -> dict[str, Any]:
    from minipic.orchestrator.errors import MinipicError

    ok = [r for r in results if not isinstance(r, MinipicError)]
    errors = [f"{type(r).__name__}: {r}"[:300] for r in results if isinstance(r, MinipicError)]
    prompt = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)
    expected = sum(a.expected_cached_tokens for a in ok)
    ratios = [a.cached_tokens / a.expected_cached_tokens for a in ok
              if a.expected_cached_tokens > 0]
    return {
        "samples": len(results), "failed": len(errors), "errors": errors[:5],
        "elapsed_s": elapsed, "samples_per_s": len(results) / elapsed,
        "prompt_tokens": prompt, "cached_tokens": cached, "expected_cached_tokens": expected,
        "hit_rate": cached / prompt if prompt else None,
        # what the client expected cached (spans it warmed or believed warm) vs what was
        "expected_hit_ratio": cached / expected if expected else None,
        "expected_ratio_mean": statistics.fmean(ratios) if ratios else None,
        "cache_ok_fraction": sum(a.cache_ok for a in ok) / len(ok) if ok else None,
        "ttft_p50_s": _percentile([a.ttft_s for a in ok], 0.5),
        "ttft_p90_s": _percentile([a.ttft_s for a in ok], 0.9),
        "ttft_p95_s": _percentile([a.ttft_s for a in ok], 0.95),
        "total_p50_s": _percentile([a.total_s for a in ok], 0.5),
        "prefills_sent": sum(a.prefills_sent for a in ok),
        "final_attempts": sum(a.attempts for a in ok),
    }


def measure(name: str, serve_args: list[str], questions: list[dict[str, Any]],
            args: argparse.Namespace, step: Callable[[str], None]) -> dict[str, Any]:
    """One configuration on a fresh server: start, warm up (salted), time the batch, read the
    router's state, stop."""
    from minipic.orchestrator import SyncOrchestrator

    clustered = name != "single"
    server = Server(serve_args, args.out / "logs" / f"{name}.log",
                    args.replicas if clustered else None)
    row: dict[str, Any] = {"name": name, "serve_args": serve_args, "log": str(server.log)}
    try:
        step(f"{name}: starting minipic serve {' '.join(serve_args)}")
        row["startup_s"] = server.start()
        orc = SyncOrchestrator.connect(server.url)
        try:
            if args.warmup:
                step(f"{name}: warm-up ({args.warmup} salted questions, untimed)")
                orc.answer_many(questions[:args.warmup], cache_salt=uuid.uuid4().hex,
                                max_tokens=args.max_tokens)
            before = server.get_json(CLUSTER_PATH) if clustered else None
            step(f"{name}: {len(questions)} questions")
            started = time.perf_counter()
            results = orc.answer_many(questions, max_tokens=args.max_tokens)
            row.update(_metrics(results, time.perf_counter() - started))
            if clustered:
                after = server.get_json(CLUSTER_PATH)
                row["router_state"] = _timed_state(before, after)
                row["router_state_raw"] = after
        finally:
            orc.close()
    except Exception as exc:  # one configuration failing must not lose the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        step(f"{name}: stopping")
        row["stop"] = server.stop()
    return row


# -- report --------------------------------------------------------------------------------------

RATIO_KEYS = ("samples_per_s", "hit_rate", "expected_hit_ratio", "ttft_p50_s", "ttft_p90_s")


def _ratios(rows: dict[str, dict[str, Any]], reference: str) -> dict[str, dict[str, float]]:
    ref = rows.get(reference)
    if ref is None or "error" in ref:
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        if name == reference or "error" in row:
            continue
        out[name] = {k: row[k] / ref[k] for k in RATIO_KEYS if row.get(k) and ref.get(k)}
    return out


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["configurations"].values() if "error" not in r]
    names = [r["name"] for r in rows]
    colors = ["#999" if n == "single" else "#c84" if n.endswith(STORE_SUFFIX)
              else "#2a7" if n == "span" else "#57a" for n in names]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.8))
    ax1.bar(names, [100 * (r["hit_rate"] or 0) for r in rows], color=colors)
    ax1.set_ylabel("final-prompt tokens cached (%)")
    ax1.set_title("cache hit rate")
    ax2.bar(names, [r["samples_per_s"] for r in rows], color=colors)
    ax2.set_ylabel("samples/s")
    ax2.set_title(f"throughput ({report['config']['questions']} questions)")
    clusters = [r for r in rows if r.get("router_state")]
    x = range(len(clusters))
    hashing = [r["router_state"].get("hash_ms_mean") or 0 for r in clusters]
    choosing = [r["router_state"].get("choose_ms_mean") or 0 for r in clusters]
    ax3.bar(x, hashing, color="#c84", label="hash (ingress)")
    ax3.bar(x, choosing, bottom=hashing, color="#2a7", label="choose (span router)")
    ax3.set_xticks(list(x), [r["name"] for r in clusters])
    ax3.set_ylabel("ms per request")
    ax3.set_title("router cost")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"{report['config']['replicas']} replicas vs one server, "
                 f"model {report['model']}, seed {report['seed']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"cluster routing (seed {report['seed']})")
    for col in ("config", "samples/s", "hit", "cached/exp", "TTFT p50", "TTFT p90", "prefills",
                "failed",
                "hash ms", "choose ms"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, r in report["configurations"].items():
        if "error" in r:
            table.add_row(name, f"[red]{r['error'][:80]}")
            continue
        state = r.get("router_state") or {}
        ttft = [f"{r[k] * 1e3:.0f} ms" if r.get(k) is not None else "-"
                for k in ("ttft_p50_s", "ttft_p90_s")]
        table.add_row(name, _fmt(r["samples_per_s"], ".2f"), _fmt(r["hit_rate"], ".1%"),
                      _fmt(r["expected_hit_ratio"], ".1%"), *ttft,
                      str(r["prefills_sent"]), str(r["failed"]),
                      _fmt(state.get("hash_ms_mean"), ".2f"),
                      _fmt(state.get("choose_ms_mean"), ".3f"))
    return table


def _router_lines(report: dict[str, Any]) -> list[str]:
    """Per cluster: the span router's decisions and the blocks it believes each replica holds."""
    lines = []
    for name, r in report["configurations"].items():
        state = r.get("router_state")
        if not state:
            continue
        parts = [f"{state.get('requests')} requests hashed",
                 f"ingress retries {state.get('ingress_retries')}"]
        if "decisions" in state:
            parts.append("decisions " + ", ".join(f"{k} {v}"
                                                  for k, v in state["decisions"].items()))
        if "blocks_held" in state:
            parts.append(f"blocks held {list(state['blocks_held'].values())}")
            if state.get("replicas_seen") != report["config"]["replicas"]:
                parts.append(f"[red]router saw {state.get('replicas_seen')} replica(s)[/]")
        lines.append(f"{name}: " + "; ".join(parts))
    return lines


# -- main ----------------------------------------------------------------------------------------


def _configurations(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    common = [*(["--model", args.model] if args.model else []),
              *(["--eager"] if args.eager else [])]
    # serve keeps a span store by default: the configurations without one say so, or they would
    # share (and warm each other through) the default directory
    off = ["--span-store", "off"]
    configs = [("single", [*common, *off])]
    for router in args.routers:
        configs.append((router, [*common, "--replicas", str(args.replicas), "--router", router,
                                 *off]))
    for router in args.store_routers:
        # the directory is filled in per run (``_store_dir``): every configuration starts empty
        configs.append((f"{router}{STORE_SUFFIX}", [*common, "--replicas", str(args.replicas),
                                                    "--router", router, "--span-store",
                                                    STORE_PLACEHOLDER]))
    return configs


STORE_SUFFIX = "+store"
STORE_PLACEHOLDER = "{store}"


def _store_dir(serve_args: list[str]) -> tuple[list[str], str | None]:
    """``serve_args`` with a fresh empty store directory in place of the placeholder."""
    if STORE_PLACEHOLDER not in serve_args:
        return serve_args, None
    path = tempfile.mkdtemp(prefix="minipic-cluster-store-")
    return [path if a == STORE_PLACEHOLDER else a for a in serve_args], path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/cluster_routing"))
    p.add_argument("--model", default=None,
                   help="model folder or 'tiny-llama' (default: SmolLM2-135M)")
    p.add_argument("--questions", type=int, default=48)
    p.add_argument("--passages", type=int, default=4, help="documents per question")
    p.add_argument("--pool-factor", type=float, default=0.5,
                   help="shared passage pool = pool_factor * questions (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: random)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default="span,round_robin,prefix",
                   help=f"comma-separated routers to compare with the single server, from "
                        f"{','.join(ROUTERS)} (default: %(default)s)")
    p.add_argument("--store-routers", default="round_robin,span",
                   help="routers to run again with a span store shared by the replicas "
                        "(configuration ROUTER+store; empty: none; default: %(default)s)")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="serve with --eager (skip torch.compile: faster start-up; default on)")
    p.add_argument("--warmup", type=int, default=2,
                   help="questions answered untimed under a throw-away cache salt before the "
                        "batch, per configuration (0: none; default: %(default)s)")
    args = p.parse_args()
    args.routers = [r for r in args.routers.split(",") if r]
    args.store_routers = [r for r in args.store_routers.split(",") if r]
    unknown = sorted((set(args.routers) | set(args.store_routers)) - set(ROUTERS))
    if unknown:
        p.error(f"unknown routers {unknown}; choose from {','.join(ROUTERS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    args.warmup = max(0, min(args.warmup, args.questions))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from minipic.bench.workloads import rag_workload
    from minipic.prompt_builder import PromptBuilder
    from minipic.span_contract.models import resolve_model

    console = Console(width=None if sys.stdout.isatty() else 120)  # logs: room for the table
    console.print(f"cluster_routing: seed {seed}")
    model = resolve_model(args.model)
    count = PromptBuilder.from_pretrained(model).count_tokens
    items = rag_workload(args.questions, count, seed=seed, passages_per_question=args.passages,
                         relevant=1, pool_factor=args.pool_factor)
    questions = [{"question": it.question, "documents": it.documents, "system": it.system}
                 for it in items]
    passages = [d for it in items for d in it.documents]

    configs = _configurations(args)
    rows: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    columns = (TextColumn("[bold]cluster_routing[/]"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console) as progress:
        steps_per = 4 if args.warmup else 3
        task = progress.add_task("", total=steps_per * len(configs))
        first = [True]

        def step(message: str) -> None:
            if not first[0]:
                progress.advance(task)
            first[0] = False
            progress.update(task, description=message)

        for name, planned in configs:
            serve_args, store = _store_dir(planned)
            try:
                row = measure(name, serve_args, questions, args, step)
            finally:
                if store is not None:
                    row_store = {"dir": store, "bytes": sum(
                        f.stat().st_size for f in Path(store).rglob("*") if f.is_file())}
                    shutil.rmtree(store, ignore_errors=True)
            if store is not None:
                row["span_store"] = row_store
            rows[name] = row
            if "error" in row:
                progress.console.print(f"[red]{name}: {row['error']}")
            else:
                progress.console.print(
                    f"{name}: {row['samples_per_s']:.2f} samples/s, hit {row['hit_rate']:.1%}, "
                    f"{row['failed']} failed, started in {row['startup_s']:.0f} s")
        progress.update(task, completed=steps_per * len(configs), description="done")

    report: dict[str, Any] = {
        "seed": seed,
        "model": Path(model).name,
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "seed": seed, "order": [n for n, _ in configs]},
        "workload": {"questions": len(items), "distinct_passages": len(set(passages)),
                     "passage_slots": len(passages),
                     "systems": len({it.system for it in items})},
        "configurations": rows,
        "ratios_note": "configuration / reference, same run; TTFT ratios above 1 are slower",
        "ratios_vs_round_robin": _ratios(rows, "round_robin"),
        # with the store: against round robin with the store (the same store setting)
        "ratios_vs_round_robin+store": _ratios(rows, "round_robin" + STORE_SUFFIX),
        "ratios_vs_single": _ratios(rows, "single"),
        "meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "machine": f"{platform.machine()} {os.cpu_count()} cores",
                 "python": platform.python_version(),
                 "wall_s": time.perf_counter() - started},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_routing.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out / "cluster_routing.png")
    console.print(_summary(report))
    for line in _router_lines(report):
        console.print(line)
    for ref in ("round_robin", "round_robin" + STORE_SUFFIX, "single"):
        for name, ratio in report[f"ratios_vs_{ref}"].items():
            console.print(f"{name} / {ref}: " + ", ".join(f"{k} {v:.2f}x"
                                                          for k, v in ratio.items()))
    console.print(f"wrote {args.out / 'cluster_routing.json'}, {args.out / 'cluster_routing.png'}")


if __name__ == "__main__":
    main()
