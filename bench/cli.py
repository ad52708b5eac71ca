"""`flashbatch bench run` and `flashbatch bench serve`: their arguments (cheap to import; the
implementations load lazily)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from bench.choices import DEFAULT_AR_DRAFT, ENGINE_KINDS, WORKLOADS


def _csv(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        help="mlx-lm model directory, .gguf file or model name (default: the bundled target)",
    )
    parser.add_argument(
        "--drafter", help="DFlash drafter directory (default: the bundled drafter; 'none': off)"
    )
    parser.add_argument(
        "--ar-draft", default=DEFAULT_AR_DRAFT,
        help="autoregressive draft model for mlx-lm speculative decoding "
        f"(default: {DEFAULT_AR_DRAFT}; build it with bench/train_ar_draft.py)",
    )  # fmt: skip
    parser.add_argument(
        "--num-draft-tokens", type=int, default=3, help="mlx-lm speculative draft tokens"
    )
    parser.add_argument(
        "--workloads", type=_csv(str), help=f"comma-separated (default {','.join(WORKLOADS)})"
    )
    parser.add_argument(
        "--workload-set", choices=("bundled", "mix"),
        help="bundled: the bundled pair's raw-text workloads; mix: held-out prompts of the "
        "chat-model mix, chat kinds in the chat template (default: bundled for the bundled "
        "target, mix for any other)",
    )  # fmt: skip
    parser.add_argument("--temperatures", type=_csv(float), help="comma-separated (default 0,1)")
    parser.add_argument(
        "--concurrency", type=_csv(int), help="comma-separated (default 1,2,4,8,16,32)"
    )
    parser.add_argument(
        "--requests", type=int,
        help="requests per cell at concurrency 1; max(this, 2 x concurrency) above (16)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (64)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds; medians reported (3)")
    parser.add_argument(
        "--policies", type=_csv(str),
        help="flashbatch engines: off, fixed depths, adaptive (adaptive-unguarded: without the "
        "never-slower guard), each optionally @dflash, @lookup "
        "or @dflash+lookup (draft sources; unsuffixed: both with a drafter, else lookup); "
        "default off,3,7,adaptive",
    )  # fmt: skip
    parser.add_argument(
        "--engines", type=_csv(str), help=f"engine kinds (default {','.join(ENGINE_KINDS)})"
    )
    parser.add_argument("--max-prompt-tokens", type=int, help="keep each prompt's last N tokens")
    parser.add_argument(
        "--stop-at-eos", action="store_true",
        help="every engine ends a request at the target's EOS, as a user's request ends "
        "(default: EOS ignored, every request max_tokens long)",
    )  # fmt: skip
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false",
        help="skip the untimed warm-up of each engine (by default each is warmed up first)",
    )  # fmt: skip
    parser.add_argument("--out", help="results folder (default results/<timestamp>)")
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false",
        help="show no progress while running (by default a progress line is kept up to date)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run in minutes: completion, greedy, concurrency 1,2, 4 requests x 16 "
        "tokens, 2 rounds, policies off,3,adaptive (explicit flags still win)",
    )  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000",
        help="a running OpenAI-compatible server (loopback only)",
    )  # fmt: skip
    parser.add_argument(
        "--compare", action="store_true",
        help="start flashbatch's server and mlx_lm.server on --target (one after the other, on "
        "127.0.0.1), run the same load against each and report the ratio",
    )  # fmt: skip
    parser.add_argument(
        "--target", help="--compare: model directory, .gguf or name (default: bundled target)"
    )
    parser.add_argument("--drafter", help="--compare: flashbatch's DFlash drafter ('none': off)")
    parser.add_argument(
        "--num-speculative-tokens", type=int, help="--compare: flashbatch's depth (unset: adaptive)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=32,
        help="--compare: batch size of both servers (flashbatch --max-num-seqs, mlx_lm.server "
        "--decode-concurrency)",
    )  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the run")
    parser.add_argument("--concurrency", type=int, help="most requests in flight (default 8)")
    parser.add_argument(
        "--request-rate", type=float, help="Poisson arrivals per second (default: all at once)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="let requests end at EOS (by default they ask ignore_eos, so each is --max-tokens "
        "long)",
    )  # fmt: skip
    parser.add_argument("--model", help="the requests' model field (default: omitted)")
    parser.add_argument(
        "--workload", default="completion", choices=WORKLOADS, help="the kind of prompts sent"
    )
    parser.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; replaces the workload)"
    )
    parser.add_argument("--seed", type=int, default=0, help="Poisson arrivals' seed")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="one request's limit (s)"
    )
    parser.add_argument(
        "--max-duration", type=float, default=600.0, help="the whole run's limit (s)"
    )
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false",
        help="skip the untimed warm-up (by default two short requests are sent first)",
    )  # fmt: skip
    parser.add_argument("--out", help="results folder (default results/<timestamp>-serve)")


def add_bench_parser(sub: Any) -> None:
    """The `bench` command with its `run` and `serve` subcommands."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks against peers: run (engines in-process), serve (HTTP load)",
        description="Benchmarks against peers (mlx-lm): side-by-side ratios, tables and plots.",
    )
    steps = bench.add_subparsers(dest="bench_command", required=True)
    run = steps.add_parser(
        "run",
        help="mlx-lm and flashbatch engines side by side in one process",
        description="mlx-lm (stream_generate, BatchGenerator, AR-draft speculative) and "
        "flashbatch (drafting off, fixed depths, adaptive) on the same target, prompts and "
        "dtype, interleaved rounds; writes results.json, results.md and plots.",
    )
    add_run_arguments(run)
    serve = steps.add_parser(
        "serve",
        help="HTTP streaming load against an OpenAI-compatible server (vLLM-bench style)",
        description="Fixed concurrency or Poisson arrivals against a loopback server; "
        "--compare runs flashbatch's server and mlx_lm.server on the same model.",
    )
    add_serve_arguments(serve)
    report = steps.add_parser(
        "report",
        help="rewrite a bench run's results.md from its results.json (current report format)",
        description="Re-render results.md (tables, paired-round verdicts) from results.json; "
        "plots are left as they are.",
    )
    report.add_argument("results_dir", help="a folder written by `flashbatch bench run`")
    bench.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "run":
        from bench.suite import main
    elif args.bench_command == "report":
        from bench.report import main
    else:
        from bench.serve_load import main
    return main(args)
