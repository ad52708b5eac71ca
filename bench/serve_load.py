"""`flashbatch bench serve`: an HTTP streaming load client for OpenAI-compatible servers.

Requests (`POST /v1/completions`, `stream: true`, usage in the last chunk) go out at a fixed
concurrency (closed loop) or as Poisson arrivals at `--request-rate` per second (optionally
capped by `--concurrency`). Results follow `vllm bench serve`: completed and failed requests,
request and token throughputs, and mean / median / std / p90 / p99 of

- TTFT: submission to the first chunk that carries text;
- TPOT: (e2e - TTFT) / (output tokens - 1), per request;
- ITL: the gaps between successive text chunks (a chunk may carry several tokens);
- E2EL: submission to the end of the stream.

With `--compare`, it starts flashbatch's server and `mlx_lm.server` on the same model, one after
the other on 127.0.0.1, runs the same load against each and reports flashbatch / mlx-lm ratios.
Only loopback addresses are accepted, and every run is bounded in requests and time.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import ipaddress
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.stats import Timeline, percentile

MAX_REQUESTS = 10_000
PERCENTILES = (50, 90, 99)


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, if its host is a loopback address; else ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to load {host!r}: bench serve only targets loopback addresses "
            "(127.0.0.0/8, ::1, localhost)"
        )
    return url.rstrip("/")


@dataclass
class LoadConfig:
    url: str
    num_requests: int = 32
    concurrency: int | None = 8  # most requests in flight; None = no cap (with a rate)
    request_rate: float | None = None  # Poisson arrivals per second; None = all at once
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = True
    model: str | None = None  # the request's `model` field (omitted: the server's default)
    seed: int = 0
    request_timeout: float = 300.0
    max_duration: float = 600.0  # the whole run; requests still going then fail

    def validate(self) -> None:
        check_loopback(self.url)
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests must be in 1..{MAX_REQUESTS}")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency, a request rate, or both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request rate must be > 0")
        if not self.max_duration > 0:
            raise ValueError("max_duration must be > 0")


@dataclass
class ServeRecord(Timeline):
    """One request as the client saw it."""

    prompt_index: int
    scheduled: float = math.nan  # Poisson arrival time (or the run's start)
    submitted: float = math.nan
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    finished: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    tokens_from: str = "usage"  # or "chunks" when the server sent no usage
    speculation: dict | None = None  # flashbatch's drafted/accepted/verify_steps
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times or self.finished is None or self.output_tokens < 2:
            return None
        return (self.finished - self.chunk_times[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_json(self, origin: float) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "submitted": self.submitted - origin,
            "chunk_times": [t - origin for t in self.chunk_times],
            "finished": None if self.finished is None else self.finished - origin,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "tokens_from": self.tokens_from,
            "speculation": self.speculation,
            "error": self.error,
        }


@dataclass
class LoadResult:
    started: float
    ended: float
    records: list[ServeRecord]


def arrival_times(count: int, rate: float | None, seed: int) -> list[float]:
    """Offsets (s) from the start: Poisson arrivals at `rate`, or all at 0."""
    if rate is None or math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    now, out = 0.0, []
    for _ in range(count):
        out.append(now)
        now += rng.expovariate(rate)
    return out


async def _one(client, cfg: LoadConfig, prompt: str, record: ServeRecord, clock) -> None:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.model:
        body["model"] = cfg.model
    record.submitted = clock()
    text_chunks = 0
    usage = None
    try:
        async with client.stream("POST", cfg.url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock()
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("flashbatch"):
                    record.speculation = chunk["flashbatch"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    record.chunk_times.append(now)
                    text_chunks += 1
        record.finished = clock()
    except Exception as exc:  # noqa: BLE001  (a failed request is counted, not raised)
        record.error = f"{type(exc).__name__}: {exc}"
        return
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:
        record.output_tokens, record.tokens_from = text_chunks, "chunks"
    if record.output_tokens and not record.chunk_times:
        record.error = "no text in the stream"


async def run_load(
    cfg: LoadConfig, prompts: Sequence[str], clock: Callable[[], float] = time.perf_counter
) -> LoadResult:
    """Send `cfg.num_requests` streaming requests (prompts cycled) and record their timing."""
    import httpx

    cfg.validate()
    cfg.url = check_loopback(cfg.url)
    if not prompts:
        raise ValueError("no prompts")
    offsets = arrival_times(cfg.num_requests, cfg.request_rate, cfg.seed)
    records = [ServeRecord(prompt_index=i % len(prompts)) for i in range(cfg.num_requests)]
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    connections = cfg.concurrency or cfg.num_requests
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        started = clock()

        async def request(record: ServeRecord, offset: float) -> None:
            record.scheduled = started + offset
            delay = offset - (clock() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                await _one(client, cfg, prompts[record.prompt_index], record, clock)
                return
            async with gate:
                await _one(client, cfg, prompts[record.prompt_index], record, clock)

        tasks = [asyncio.ensure_future(request(r, o)) for r, o in zip(records, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=cfg.max_duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        ended = clock()
    for record in records:
        if not record.ok and record.error is None:
            record.error = f"not finished within --max-duration {cfg.max_duration:g} s"
    return LoadResult(started, ended, records)


def _stats(name: str, values_ms: list[float]) -> dict[str, float]:
    out = {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else math.nan,
        f"median_{name}_ms": percentile(values_ms, 50),
        f"std_{name}_ms": statistics.pstdev(values_ms) if values_ms else math.nan,
    }
    for q in PERCENTILES:
        if q != 50:
            out[f"p{q}_{name}_ms"] = percentile(values_ms, q)
    return out


def summarize_load(result: LoadResult) -> dict[str, Any]:
    """vLLM-bench-style metrics, all from the recorded timestamps."""
    ok = [r for r in result.records if r.ok]
    duration = result.ended - result.started
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    errors = [r.error for r in result.records if not r.ok]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(result.records) - len(ok),
        "errors": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": total_out / duration if duration > 0 else math.nan,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else math.nan,
    }
    summary.update(_stats("ttft", [r.ttft * 1e3 for r in ok if r.ttft is not None]))
    summary.update(_stats("tpot", [r.tpot * 1e3 for r in ok if r.tpot is not None]))
    summary.update(_stats("itl", [x * 1e3 for r in ok for x in r.itls()]))
    summary.update(_stats("e2el", [r.e2e * 1e3 for r in ok if r.e2e is not None]))
    spec = [r.speculation for r in ok if r.speculation]
    if spec:
        drafted = sum(s.get("drafted_tokens", 0) for s in spec)
        accepted = sum(s.get("accepted_tokens", 0) for s in spec)
        steps = sum(s.get("verify_steps", 0) for s in spec)
        committed = sum(r.output_tokens - 1 for r in ok if r.speculation)
        summary["spec_acceptance"] = accepted / drafted if drafted else math.nan
        summary["spec_tau"] = committed / steps if steps else math.nan
    return summary


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    def line(label: str, value: Any, spec: str = ".2f") -> str:
        text = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else (
            format(value, spec) if isinstance(value, float) else str(value))  # fmt: skip
        return f"{label:<40}{text:>12}"

    out = [f"{' ' + title + ' ':=^52}"]
    out.append(line("Successful requests:", summary["completed"]))
    out.append(line("Failed requests:", summary["failed"]))
    out.append(line("Benchmark duration (s):", summary["duration_s"]))
    out.append(line("Total input tokens:", summary["total_input_tokens"]))
    out.append(line("Total generated tokens:", summary["total_output_tokens"]))
    out.append(line("Request throughput (req/s):", summary["request_throughput"]))
    out.append(line("Output token throughput (tok/s):", summary["output_throughput"]))
    out.append(line("Total token throughput (tok/s):", summary["total_token_throughput"]))
    sections = (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    )
    for key, heading in sections:
        out.append(f"{heading:-^52}")
        name = key.upper()
        out.append(line(f"Mean {name} (ms):", summary[f"mean_{key}_ms"]))
        out.append(line(f"Median {name} (ms):", summary[f"median_{key}_ms"]))
        for q in PERCENTILES:
            if q != 50:
                out.append(line(f"P{q} {name} (ms):", summary[f"p{q}_{key}_ms"]))
    if "spec_tau" in summary:
        out.append(f"{'Speculative decoding (flashbatch)':-^52}")
        out.append(line("Acceptance rate:", summary["spec_acceptance"]))
        out.append(line("Tokens per verify step (tau):", summary["spec_tau"]))
    for error in summary.get("errors") or []:
        out.append(f"error: {error[:200]}")
    out.append("=" * 52)
    return "\n".join(out)


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on 127.0.0.1: started, waited for, stopped (SIGTERM, then kill)."""

    def __init__(self, name: str, command: list[str], port: int, env: dict | None = None,
                 log_path: Path | None = None, startup_timeout: float = 300.0) -> None:  # fmt: skip
        self.name, self.command, self.port = name, command, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"bench-{name}-{port}.log"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        import httpx

        self._log = open(self.log_path, "w+")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=self.env)  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        body = {"prompt": "hello", "max_tokens": 1, "temperature": 0.0}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:  # ready once a one-token completion succeeds (the model is loaded)
                reply = httpx.post(self.url + "/v1/completions", json=body, timeout=60,
                                   trust_env=False)  # fmt: skip
                if reply.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        log = self.read_log()
        self.stop()
        raise RuntimeError(f"{self.name} server did not become ready:\n{log[-3000:]}")

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
            self.log_path.unlink(missing_ok=True)  # a start-up failure quotes it in its error

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def flashbatch_command(target: str, drafter: str | None, port: int, extra: Sequence[str] = ()):
    command = [sys.executable, "-m", "engine.cli", "serve", "--target", str(target),
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--drafter", str(drafter) if drafter else "none", *extra]  # fmt: skip
    return command


def mlx_lm_command(model_dir: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host",
            "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *extra]  # fmt: skip


def stored_dtypes(model_dir: Path) -> set[str]:
    """The dtypes of a model directory's safetensors weights (read from the headers)."""
    dtypes: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes


def mlx_lm_model_dir(target: str, work: Path) -> tuple[str, str]:
    """A model directory that makes mlx_lm.server compute in flashbatch's dtype, and a note.

    flashbatch casts the target to float32 on the CPU backend; mlx_lm.server keeps the stored
    dtype. For the same arithmetic, a bf16/fp16 checkpoint gets a float32 copy for mlx-lm."""
    import engine  # noqa: F401  (fast BLAS before mlx)
    from engine.backend.platform import compute_dtype
    from engine.models.loading import load_target_model
    from engine.models.resolve import resolve_target

    target = str(resolve_target(target))  # a .gguf file or a model name: its mlx-lm directory
    if compute_dtype() is None or stored_dtypes(Path(target)) <= {"F32"}:
        return str(target), "the checkpoint as stored (same dtype as flashbatch)"
    from mlx_lm.utils import save_model

    model, _ = load_target_model(target)
    work.mkdir(parents=True, exist_ok=True)
    save_model(work, model)
    for item in Path(target).iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and "index" not in item.name:
            shutil.copy(item, work / item.name)
    config = json.loads((work / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (work / "config.json").write_text(json.dumps(config, indent=2))
    return str(work), "a float32 copy of the target (flashbatch computes in float32 here)"


def blas_env() -> tuple[dict[str, str], str]:
    """LD_PRELOAD of the OpenBLAS flashbatch preloads, so mlx_lm.server gets the same BLAS."""
    import engine  # noqa: F401
    from engine.backend.platform import blas_status

    status = blas_status()
    if status.name != "openblas" or not status.path:
        return {}, status.name
    preload = " ".join(p for p in (status.path, os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload}, f"openblas via LD_PRELOAD ({status.path})"


# ----------------------------------------------------------------------------- command line
def _prompts(args: Any) -> list[str]:
    if getattr(args, "prompt", None):
        return list(args.prompt)
    from bench.suite import workload_texts

    return workload_texts(args.workload)


def _load_config(args: Any, url: str) -> LoadConfig:
    return LoadConfig(
        url=url, num_requests=args.num_requests, concurrency=args.concurrency,
        request_rate=args.request_rate, max_tokens=args.max_tokens,
        temperature=args.temperature, ignore_eos=args.ignore_eos, model=args.model,
        seed=args.seed, request_timeout=args.request_timeout, max_duration=args.max_duration,
    )  # fmt: skip


def _write(out_dir: Path, name: str, payload: dict, text: str) -> None:
    from bench.suite import _clean

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(_clean(payload), indent=1) + "\n")
    (out_dir / f"{name}.md").write_text("```\n" + text + "\n```\n")


def _measure(args: Any, url: str, prompts: list[str]) -> tuple[LoadResult, dict]:
    cfg = _load_config(args, url)
    if args.warmup:
        warm = LoadConfig(url=url, num_requests=2, concurrency=2, max_tokens=4, model=cfg.model,
                          max_duration=min(120.0, cfg.max_duration))  # fmt: skip
        asyncio.run(run_load(warm, prompts))
    result = asyncio.run(run_load(cfg, prompts))
    return result, summarize_load(result)


def _payload(args: Any, result: LoadResult, summary: dict) -> dict:
    return {
        "summary": summary,
        "config": asdict(_load_config(args, args.url)),
        "requests": [r.to_json(result.started) for r in result.records],
    }


RATIO_KEYS = (
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "requests/s", True),
    ("median_ttft_ms", "median TTFT (ms)", False),
    ("median_tpot_ms", "median TPOT (ms)", False),
    ("median_itl_ms", "median ITL (ms)", False),
    ("median_e2el_ms", "median E2EL (ms)", False),
    ("p99_e2el_ms", "p99 E2EL (ms)", False),
)


def ratio_table(flashbatch: dict, mlx_lm: dict) -> str:
    lines = [
        "| metric | flashbatch | mlx_lm.server | flashbatch / mlx-lm | better |",
        "|---|---:|---:|---:|---|",
    ]
    for key, label, higher_better in RATIO_KEYS:
        a, b = flashbatch.get(key), mlx_lm.get(key)
        ratio = a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None
        cells = [f"{v:.2f}" if v is not None and not math.isnan(v) else "n/a" for v in (a, b)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}x'} | "
                     f"{'higher' if higher_better else 'lower'} |")  # fmt: skip
    return "\n".join(lines)


def main(args: Any) -> int:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out or Path("results") / f"{stamp}-serve")
    prompts = _prompts(args)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    if not args.compare:
        try:
            args.url = check_loopback(args.url)
            _load_config(args, args.url).validate()
        except ValueError as exc:
            print(f"bench serve: {exc}", file=sys.stderr)
            return 2
        result, summary = _measure(args, args.url, prompts)
        text = format_summary(summary, f"{args.url}")
        print(text)
        _write(out_dir, "serve", _payload(args, result, summary), text)
        print(f"\nresults: {out_dir}/serve.json", file=sys.stderr)
        return 0 if summary["completed"] else 1
    return _compare(args, prompts, out_dir)


def _compare(args: Any, prompts: list[str], out_dir: Path) -> int:
    from engine.bundled.pair import bundled_paths

    target, drafter = args.target, args.drafter
    if target is None:
        bundled_target, bundled_drafter = bundled_paths()
        if not (bundled_target / "config.json").is_file():
            print("bench serve --compare: pass --target (the bundled pair is not built)",
                  file=sys.stderr)  # fmt: skip
            return 2
        target = str(bundled_target)
        if drafter is None and (bundled_drafter / "config.json").is_file():
            drafter = str(bundled_drafter)
    if drafter in ("", "none"):
        drafter = None
    extra = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.num_speculative_tokens is not None:
        extra += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    env, blas_note = blas_env()
    summaries: dict[str, dict] = {}
    payload: dict[str, Any] = {"target": target, "drafter": drafter, "servers": {}}
    texts = []
    with tempfile.TemporaryDirectory(prefix="bench-mlx-lm-") as tmp:
        mlx_dir, dtype_note = mlx_lm_model_dir(target, Path(tmp) / "model")
        payload["mlx_lm_model"] = dtype_note
        payload["mlx_lm_blas"] = blas_note
        servers = [
            ("flashbatch", lambda port: flashbatch_command(target, drafter, port, extra), {}),
            (
                "mlx_lm.server",
                lambda port: mlx_lm_command(
                    mlx_dir, port, ["--decode-concurrency", str(args.max_num_seqs)]
                ),
                env,
            ),  # fmt: skip
        ]
        for name, command, server_env in servers:
            port = free_port()
            print(f"starting {name} on 127.0.0.1:{port} ...", file=sys.stderr, flush=True)
            try:
                with ServerProcess(name, command(port), port, env=server_env) as server:
                    result, summary = _measure(args, server.url, prompts)
            except Exception as exc:  # noqa: BLE001  (reported, not hidden)
                summary = {"completed": 0, "failed": args.num_requests, "error": str(exc)}
                print(f"{name}: FAILED: {exc}", file=sys.stderr)
                summaries[name] = summary
                payload["servers"][name] = {"summary": summary}
                continue
            summaries[name] = summary
            text = format_summary(summary, name)
            texts.append(text)
            print(text, flush=True)
            payload["servers"][name] = {
                "summary": summary,
                "requests": [r.to_json(result.started) for r in result.records],
            }
    fb, ml = summaries.get("flashbatch", {}), summaries.get("mlx_lm.server", {})
    load = (f"{args.num_requests} requests, "
            + (f"Poisson {args.request_rate:g} req/s" if args.request_rate else "")
            + (", " if args.request_rate and args.concurrency else "")
            + (f"concurrency {args.concurrency}" if args.concurrency else "")
            + f", {args.max_tokens} tokens, temperature {args.temperature:g}")  # fmt: skip
    header = (f"target {target}; flashbatch drafter {drafter}; mlx_lm.server gets "
              f"{dtype_note}, BLAS {blas_note}; load: {load}")  # fmt: skip
    table = ratio_table(fb, ml) if fb.get("completed") and ml.get("completed") else (
        "no ratio: a server failed (see above)")  # fmt: skip
    print("\n" + header + "\n\n" + table)
    payload["config"] = asdict(_load_config(args, "http://127.0.0.1:0"))
    payload["ratio_table"] = table
    _write(out_dir, "serve-compare", payload, "\n\n".join(texts + [header, table]))
    print(f"\nresults: {out_dir}/serve-compare.json", file=sys.stderr)
    ok = fb.get("completed") and ml.get("completed")
    return 0 if ok else 1
