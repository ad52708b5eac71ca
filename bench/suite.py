"""`flashbatch bench run`: flashbatch against mlx-lm, side by side in one process.

All engines serve the same target (loaded once for the mlx-lm engines, once per flashbatch
engine, all in the engine's compute dtype), the same prompts and the same sampling. For each
workload x temperature x concurrency ("cell"), every engine serves the cell's requests once
per round; rounds interleave the engines (the order rotates every round) and the table reports
medians. Single-stream engines (mlx-lm `stream_generate`, with and without an AR draft) are
measured at concurrency 1 only: served one after another, concurrent clients get the same
aggregate rate, so that rate also counts as an mlx-lm baseline at every higher concurrency.
Each row's ratio is against the best mlx-lm baseline of its cell.

An engine that cannot start, or that raises, is reported in its rows as failed with its error;
nothing is skipped silently.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import asyncio
import datetime as _dt
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.choices import DEFAULT_AR_DRAFT, ENGINE_KINDS, WORKLOADS
from bench.engines import (
    BenchEngine,
    EngineUnavailable,
    FlashbatchEngine,
    MlxBatchEngine,
    MlxStreamEngine,
    RunParams,
    UnavailableEngine,
)
from bench.stats import RunResult, summarize_rounds, summarize_run

AR_DRAFT_HINT = "run bench/train_ar_draft.py"

QUICK = {
    "workloads": ["completion"],
    "temperatures": [0.0],
    "concurrency": [1, 2],
    "requests": 4,
    "max_tokens": 16,
    "rounds": 2,
    "policies": ["off", "3", "adaptive"],
}


@dataclass
class SuiteConfig:
    target: str
    drafter: str | None = None
    ar_draft: str | None = DEFAULT_AR_DRAFT
    num_draft_tokens: int = 3  # mlx-lm speculative decoding's draft tokens per step
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    requests: int = 16  # per cell at concurrency 1; at least 2 x concurrency above
    max_tokens: int = 64
    rounds: int = 3
    policies: list[str] = field(default_factory=lambda: ["off", "3", "7", "adaptive"])
    engines: list[str] = field(default_factory=lambda: list(ENGINE_KINDS))
    max_prompt_tokens: int | None = None  # keep each prompt's last N tokens
    stop_at_eos: bool = False  # every engine ends a request at EOS (default: EOS ignored)
    # "bundled": the bundled pair's workloads (raw text); "mix": held-out prompts of the chat
    # mix, in the chat template where the kind is chat (real instruct models)
    workload_set: str = "bundled"
    warmup: bool = True
    quick: bool = False
    out_dir: str | None = None

    def requests_at(self, concurrency: int) -> int:
        return self.requests if concurrency == 1 else max(self.requests, 2 * concurrency)


# ----------------------------------------------------------------------------- prompts
def workload_texts(name: str) -> list[str]:
    """The bundled workload's prompts; "mixed" alternates editing (speculation's best case)
    and prose (its hardest), as `bench/engine_core.py` does."""
    from engine.bundled.workloads import load_workloads

    workloads = load_workloads()
    if name == "mixed":
        return [t for pair in zip(workloads["editing"], workloads["prose"]) for t in pair]
    if name == "chat":  # the bundled target is no chat model: its chat stand-in is prose
        name = "prose"
    if name not in workloads:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return workloads[name]


def mix_prompts(name: str, per_kind: int = 64) -> list[Any]:
    """Held-out prompts of the chat-model mix (`drafters.dflash.prompt_mix`): what a server
    for a real instruct model is asked. Chat kinds are wrapped in the chat template."""
    from drafters.dflash.prompt_mix import build_prompts

    prompts = build_prompts("held_out", per_kind)
    by_kind = {k: [p for p in prompts if p.kind == k] for k in ("completion", "editing", "chat",
                                                               "prose")}  # fmt: skip
    if name == "mixed":
        return [p for pair in zip(by_kind["editing"], by_kind["chat"]) for p in pair]
    if name not in by_kind:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return by_kind[name]


def cell_prompts(
    tokenizer: Any,
    workload: str,
    count: int,
    max_prompt_tokens: int | None,
    workload_set: str = "bundled",
) -> list[list[int]]:
    if workload_set == "mix":
        from drafters.dflash.datagen import encode

        chosen = mix_prompts(workload)
        prompts = [encode(tokenizer, p) for p in (chosen * (count // len(chosen) + 1))[:count]]
    else:
        texts = workload_texts(workload)
        chosen = (texts * (count // len(texts) + 1))[:count]
        prompts = [list(tokenizer.encode(t)) for t in chosen]
    if max_prompt_tokens:
        prompts = [p[-max_prompt_tokens:] for p in prompts]
    return prompts


# ----------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class Policy:
    """A flashbatch engine of the suite, parsed from `<depth>[@<sources>]`: `off`, a fixed
    depth, `adaptive`, or `adaptive-unguarded` (the controller without its never-slower
    guard, `scheduler.guard`, to measure it); sources `dflash`, `lookup` or `dflash+lookup`
    (none: the engine's default, both with a DFlash drafter, else lookup)."""

    depth: int | None  # None: adaptive
    sources: list[str] | None
    guarded: bool = True
    label: str = "adaptive"  # the depth part as written: off, adaptive, ... or d=<n>

    @classmethod
    def parse(cls, policy: str) -> Policy:
        from scheduler.sources import parse_sources

        depth, _, named = policy.partition("@")
        sources = None
        if named:
            try:
                sources = parse_sources(named.replace("+", ","))
            except ValueError as exc:
                raise ValueError(f"bad policy {policy!r}: {exc}") from None
        if depth in ("adaptive", "adaptive-unguarded"):
            return cls(None, sources, depth == "adaptive", depth)
        if depth == "off":
            return cls(0, sources, True, "off")
        fixed = int(depth)
        if fixed < 0:
            raise ValueError(f"bad policy {policy!r}: off, adaptive or a depth >= 0")
        return cls(fixed, sources, True, f"d={fixed}")

    @property
    def name(self) -> str:
        sources = self.sources
        return f"flashbatch {self.label}" + (
            f" {'+'.join(sources) or 'none'}" if sources is not None else ""
        )


def policy_depth(policy: str) -> int | None:
    return Policy.parse(policy).depth


def _vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


def _load_ar_draft(path: str | None, target_model: Any) -> Any:
    from engine.models.loading import load_target_model

    if not path:
        raise EngineUnavailable(f"not available: no AR draft model given ({AR_DRAFT_HINT})")
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise EngineUnavailable(
            f"not available: no AR draft model at {directory} ({AR_DRAFT_HINT})"
        )
    draft, _ = load_target_model(directory)
    if _vocab_size(draft) != _vocab_size(target_model):
        raise EngineUnavailable(
            f"not available: the AR draft at {directory} has vocabulary {_vocab_size(draft)}, "
            f"the target {_vocab_size(target_model)} ({AR_DRAFT_HINT} with the target's tokenizer)"
        )
    return draft


def build_engines(cfg: SuiteConfig) -> tuple[Any, list[BenchEngine]]:
    """The tokenizer and the engines the configuration asks for (not started)."""
    from engine.config import EngineConfig
    from engine.models.loading import load_target_model

    unknown = set(cfg.engines) - set(ENGINE_KINDS)
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}; choose from {ENGINE_KINDS}")
    model, tokenizer = load_target_model(cfg.target)
    engines: list[BenchEngine] = []
    if "mlx-lm" in cfg.engines:
        engines.append(MlxStreamEngine("mlx-lm", model, tokenizer))
    if "batch-generator" in cfg.engines:
        eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        engines.append(MlxBatchEngine("mlx-lm batch", model, eos_token_ids=eos))
    if "mlx-lm-spec" in cfg.engines:
        name = f"mlx-lm spec k={cfg.num_draft_tokens}"
        try:
            draft = _load_ar_draft(cfg.ar_draft, model)
            engines.append(MlxStreamEngine(name, model, tokenizer, draft, cfg.num_draft_tokens))
        except Exception as exc:  # noqa: BLE001  (reported as a row, not skipped)
            what = (f"mlx_lm.stream_generate with an AR draft model, {cfg.num_draft_tokens} "
                    "draft tokens per step, one request at a time")  # fmt: skip
            engines.append(UnavailableEngine(name, "mlx-lm", _error(exc), True, what))
    if "flashbatch" in cfg.engines:
        for written in cfg.policies:
            policy = Policy.parse(written)
            depth, sources, name = policy.depth, policy.sources, policy.name
            if depth != 0 and not cfg.drafter and sources is not None and "dflash" in sources:
                reason = "not available: no DFlash drafter (pass --drafter)"
                what = f"AsyncEngine, {'adaptive' if depth is None else 'fixed'} draft depth"
                engines.append(UnavailableEngine(name, "flashbatch", reason, False, what))
                continue
            # No prefix cache: prompts repeat across rounds, cells and the warm-up, so its hits
            # would measure the cache (bench/prefix_ttft.py does), not decoding, and the mlx-lm
            # engines have none.
            config = EngineConfig(
                target=str(cfg.target), drafter=str(cfg.drafter) if cfg.drafter else None,
                max_num_seqs=max(cfg.concurrency), max_waiting_requests=100_000,
                num_speculative_tokens=depth, draft_sources=sources, prefix_cache_bytes=0,
                drafting_guard=policy.guarded,
            )  # fmt: skip
            engines.append(FlashbatchEngine(name, config))
    return tokenizer, engines


def _error(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, EngineUnavailable) else f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- progress
class Progress:
    """tqdm on stderr when it is installed, else one line per step."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_description(label[:60])
            self._bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        elif self.enabled:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------- the run
def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _environment() -> dict[str, Any]:
    import mlx.core as mx

    from engine.backend import process_tuning
    from engine.backend.platform import blas_status, compute_dtype

    try:
        from importlib.metadata import version

        mlx_lm_version = version("mlx-lm")
    except Exception:  # noqa: BLE001
        mlx_lm_version = "unknown"
    dtype = compute_dtype()
    status = blas_status()
    tuning = process_tuning.applied()
    tuned = "off" if tuning is None else f"{tuning.allocator}; {tuning.switch_interval}"
    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "device": str(mx.default_device()),
        "dtype": "checkpoint dtype" if dtype is None else str(dtype).replace("mlx.core.", ""),
        "blas": status.name,
        "process_tuning": tuned,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "command": " ".join(sys.argv),
    }


def _baselines(rows: list[dict]) -> None:
    """Each row's ratio against the best mlx-lm baseline of its cell (see the module doc)."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["workload"], row["temperature"]), []).append(row)
    for cell_rows in cells.values():
        serial = [r for r in cell_rows if r["single_stream"] and r["concurrency"] == 1]
        for concurrency in sorted({r["concurrency"] for r in cell_rows}):
            here = [r for r in cell_rows if r["concurrency"] == concurrency]
            candidates = [
                r
                for r in here + [s for s in serial if s not in here]
                if r["family"] == "mlx-lm" and r["status"] == "ok" and r["tok_s"]
            ]
            best = max(candidates, key=lambda r: r["tok_s"], default=None)
            for row in here:
                row["baseline"] = None if best is None else best["engine"]
                row["baseline_tok_s"] = None if best is None else best["tok_s"]
                ok = best is not None and row["status"] == "ok" and row["tok_s"]
                row["ratio"] = row["tok_s"] / best["tok_s"] if ok else None


async def run_suite(
    cfg: SuiteConfig,
    *,
    extra_engines: Sequence[BenchEngine] = (),
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the suite; return the results (also written to `cfg.out_dir` when set)."""
    import mlx.core as mx

    from engine.backend import process_tuning

    started_at = _dt.datetime.now().isoformat(timespec="seconds")
    process_tuning.tune_process_if_wanted()  # every engine, mlx-lm's too, runs under them
    tokenizer, engines = build_engines(cfg)
    engines = list(engines) + list(extra_engines)
    failures: dict[str, str] = {}
    for eng in engines:
        try:
            await eng.start()
        except Exception as exc:  # noqa: BLE001  (reported as failed rows)
            failures[eng.name] = _error(exc)

    cells = [(w, t, c) for w in cfg.workloads for t in cfg.temperatures for c in cfg.concurrency]

    def runs_here(concurrency: int) -> list[BenchEngine]:
        return [e for e in engines if not e.single_stream or concurrency == 1]

    total = sum(cfg.rounds * len(runs_here(c)) for _, _, c in cells)
    bar = Progress(total, progress)
    rows: list[dict[str, Any]] = []
    try:
        if cfg.warmup:  # first calls allocate buffers and build caches: not measured
            warm = cell_prompts(
                tokenizer, cfg.workloads[0], 2, cfg.max_prompt_tokens, cfg.workload_set
            )
            for eng in engines:
                if eng.name in failures:
                    continue
                bar.write(f"warm-up: {eng.name}")
                try:
                    await eng.run(warm, 1 if eng.single_stream else 2, RunParams(4, 0.0), clock)
                except Exception as exc:  # noqa: BLE001
                    failures[eng.name] = "warm-up failed: " + _error(exc)
        for workload, temperature, concurrency in cells:
            prompts = cell_prompts(
                tokenizer, workload, cfg.requests_at(concurrency), cfg.max_prompt_tokens,
                cfg.workload_set,
            )  # fmt: skip
            params = RunParams(cfg.max_tokens, temperature, cfg.stop_at_eos)
            here = runs_here(concurrency)
            runs: dict[str, list[RunResult]] = {e.name: [] for e in here}
            errors: dict[str, str] = {e.name: failures[e.name] for e in here if e.name in failures}
            for round_index in range(cfg.rounds):
                shift = round_index % len(here)
                for eng in here[shift:] + here[:shift]:
                    label = f"{workload} t={temperature:g} c={concurrency} {eng.name}"
                    if eng.name not in errors:
                        try:
                            result = await eng.run(prompts, concurrency, params, clock)
                            failed = [r.error for r in result.records if r.error]
                            if failed:
                                errors[eng.name] = (
                                    f"{len(failed)}/{len(result.records)} requests failed: "
                                    f"{failed[0]}"
                                )
                            runs[eng.name].append(result)
                        except Exception as exc:  # noqa: BLE001
                            errors[eng.name] = _error(exc)
                        mx.clear_cache()
                    bar.step(label)
            for eng in here:
                row: dict[str, Any] = {
                    "workload": workload,
                    "temperature": temperature,
                    "concurrency": concurrency,
                    "engine": eng.name,
                    "family": eng.family,
                    "single_stream": eng.single_stream,
                    "requests_per_round": len(prompts),
                    "status": "failed" if eng.name in errors else "ok",
                    "error": errors.get(eng.name),
                    "tok_s": None,
                }
                if runs[eng.name] and eng.name not in errors:
                    row.update(summarize_rounds(runs[eng.name]))
                row["rounds"] = [
                    {
                        **summarize_run(run),
                        "records": [r.to_json(run.started) for r in run.records],
                    }
                    for run in runs[eng.name]
                ]
                rows.append(row)
            summary = ", ".join(
                f"{r['engine']} {r['tok_s']:.1f}" if r["status"] == "ok" else f"{r['engine']} FAIL"
                for r in rows[-len(here) :]
            )
            bar.write(f"{workload} t={temperature:g} c={concurrency}: {summary} tok/s")
    finally:
        bar.close()
        for eng in engines:
            try:
                await eng.close()
            except Exception:  # noqa: BLE001
                pass
    _baselines(rows)
    results = {
        "meta": {
            "started": started_at,
            "finished": _dt.datetime.now().isoformat(timespec="seconds"),
            "config": asdict(cfg),
            "environment": _environment(),
        },
        "engines": [
            {
                "name": e.name,
                "family": e.family,
                "single_stream": e.single_stream,
                "description": e.description,
                "status": "failed" if e.name in failures else "ok",
                "error": failures.get(e.name),
            }
            for e in engines
        ],
        "rows": rows,
    }
    results = _clean(results)
    if cfg.out_dir:
        write_results(results, Path(cfg.out_dir))
    return results


def write_results(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """results.json, results.md and the PNG plots under `out_dir`."""
    from bench.report import markdown_report, write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    plots, plot_note = write_plots(results, out_dir)
    results.setdefault("meta", {})["plots"] = [str(p.relative_to(out_dir)) for p in plots]
    if plot_note:
        results["meta"]["plots_note"] = plot_note
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")
    paths["markdown"].write_text(markdown_report(results) + "\n")
    return paths


# ----------------------------------------------------------------------------- command line
def config_from_args(args: Any) -> SuiteConfig:
    from engine.bundled.pair import bundled_paths

    bundled_target, bundled_drafter = bundled_paths()
    target = args.target
    drafter = args.drafter
    if target is None:
        if not (bundled_target / "config.json").is_file():
            raise SystemExit(
                "no model to benchmark: pass --target (the bundled pair is not built in this "
                "checkout; see `python -m engine.bundled.build`)"
            )
        target = str(bundled_target)
        if drafter is None and (bundled_drafter / "config.json").is_file():
            drafter = str(bundled_drafter)
    elif drafter is None:
        from engine.models.resolve import default_drafter

        paired = default_drafter(target)  # a named model's own drafter, once it has one
        drafter = str(paired) if paired is not None else None
    if drafter in ("", "none"):
        drafter = None
    cfg = SuiteConfig(target=str(target), drafter=drafter, ar_draft=args.ar_draft or None,
                      num_draft_tokens=args.num_draft_tokens, warmup=args.warmup,
                      quick=args.quick, max_prompt_tokens=args.max_prompt_tokens,
                      stop_at_eos=getattr(args, "stop_at_eos", False))  # fmt: skip
    from engine.models.registry import BUNDLED

    named_bundled = target == BUNDLED and not Path(target).exists()  # `--target bundled`
    is_bundled = named_bundled or Path(target).resolve() == bundled_target.resolve()
    cfg.workload_set = getattr(args, "workload_set", None) or ("bundled" if is_bundled else "mix")
    if cfg.workload_set == "bundled":  # its "chat" is prose again
        cfg.workloads = [w for w in cfg.workloads if w != "chat"]
    if args.quick:
        for key, value in QUICK.items():
            setattr(cfg, key, value)
    for key in ("workloads", "temperatures", "concurrency", "requests", "max_tokens", "rounds",
                "policies", "engines"):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            setattr(cfg, key, value)
    for name in cfg.workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    for name in cfg.engines:
        if name not in ENGINE_KINDS:
            raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(ENGINE_KINDS)}")
    for policy in cfg.policies:
        try:
            policy_depth(policy)
        except ValueError:
            raise SystemExit(
                f"bad policy {policy!r}: off, adaptive or a depth >= 0, optionally "
                "@dflash, @lookup or @dflash+lookup"
            ) from None
    if not cfg.concurrency or min(cfg.concurrency) < 1 or cfg.rounds < 1 or cfg.requests < 1:
        raise SystemExit("concurrency, rounds and requests must be >= 1")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    cfg.out_dir = args.out or str(Path("results") / stamp)
    return cfg


def main(args: Any) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    print(f"flashbatch bench run: target {cfg.target}, drafter {cfg.drafter}", file=sys.stderr)
    results = asyncio.run(run_suite(cfg, progress=args.progress))
    from bench.report import markdown_report

    print(markdown_report(results))
    print(f"\nresults: {cfg.out_dir}/ (results.json, results.md, plots/)")
    failed = [r for r in results["rows"] if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} row(s) failed; see the status column", file=sys.stderr)
    return 0
