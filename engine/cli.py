"""The `flashbatch` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import engine  # noqa: F401  (fast BLAS before mlx)
from engine.models.registry import DEFAULT_MODEL


def _info(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from engine.platform import report_blas

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    status = report_blas()
    a = mx.random.normal((512, 768))
    b = mx.random.normal((768, 2048))
    mx.eval(a, b)
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    gflops = 5 * 2 * 512 * 768 * 2048 / (time.perf_counter() - start) / 1e9
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    print(f"BLAS: {status.name} ({status.detail})")
    print(f"float32 matmul 512x768x2048: {gflops:.1f} GFLOP/s")
    return 0


def _pair_paths(target: str, drafter: str | None) -> tuple[str, str | None]:
    """A target value and its drafter: the one given, or the registry's for a named target
    (when it exists in this checkout); 'none' or '' turns drafting off."""
    from engine.models.resolve import default_drafter

    if drafter is None:
        paired = default_drafter(target)
        drafter = str(paired) if paired is not None else None
    return target, None if drafter in (None, "", "none") else drafter


def _model_error(exc: Exception) -> int:
    print(f"flashbatch: {exc}", file=sys.stderr)
    return 2


def _pull(args: argparse.Namespace) -> int:
    from engine.models.gguf_header import GGUFError
    from engine.models.pull import PullError, pull
    from engine.models.registry import REGISTRY

    if args.list:
        for entry in REGISTRY.values():
            print(f"{entry.name:24} {entry.description} ({entry.license})")
        return 0
    if not args.name:
        print("flashbatch pull: give a model name (--list shows them)", file=sys.stderr)
        return 2
    try:
        print(pull(args.name))
    except (PullError, GGUFError) as exc:
        return _model_error(exc)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.loading import load_pair
    from engine.models.gguf_header import GGUFError
    from engine.models.pull import PullError
    from engine.sampling import SamplingParams
    from engine.speculative import generate

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine.report_blas()
    try:
        pair = load_pair(*_pair_paths(args.target, args.drafter))
    except (PullError, GGUFError, FileNotFoundError) as exc:
        return _model_error(exc)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    prompt_ids = pair.tokenizer.encode(args.prompt)
    start = time.perf_counter()
    result = generate(
        pair.target, prompt_ids, params, drafter=pair.drafter, tokenizer=pair.tokenizer
    )
    elapsed = time.perf_counter() - start
    print(result.text)
    print(
        f"\n[{len(result.token_ids)} tokens in {elapsed:.2f}s = "
        f"{len(result.token_ids) / elapsed:.1f} tok/s; steps {len(result.steps)}, "
        f"drafted {result.drafted}, accepted {result.accepted}, tau {result.tau:.2f}, "
        f"finish {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    from drafters.dflash import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    chat = not getattr(args, "no_chat_template", False)  # data and eval only
    if args.step == "data":
        return train.run_data(args.target, args.prompts, args.out, args.max_tokens, chat)
    if args.step == "eval":
        return train.run_eval(args.target, args.drafter, args.prompts, args.max_tokens, chat)
    config = train.TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        num_anchors=args.num_anchors,
        max_len=args.max_len,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        feature_cache_mb=args.feature_cache_mb,
        out_dir=args.out,
        resume=args.resume,
    )
    train.run_fit(
        args.target,
        args.data,
        config,
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
    )
    return 0


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _sources(value: str) -> list[str] | None:
    from scheduler.sources import parse_sources

    try:
        return parse_sources(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env(name: str, default: Any = None, kind: type = str) -> Any:
    value = os.environ.get(f"FLASHBATCH_{name}")
    return default if value in (None, "") else kind(value)


def _serve(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.models.gguf_header import GGUFError
    from engine.models.pull import PullError
    from engine.models.resolve import resolve_target
    from engine.server import ServerSettings, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    target, drafter = _pair_paths(args.target, args.drafter)
    try:
        resolve_target(target)  # pull or convert now: a failure is a message, not a traceback
    except (PullError, GGUFError, FileNotFoundError) as exc:
        return _model_error(exc)
    config = EngineConfig(
        target=target,
        drafter=drafter,
        model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        num_speculative_tokens=args.num_speculative_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        draft_sources=args.draft_sources,
        prefix_cache_bytes=args.prefix_cache_bytes,
        drafting_guard=args.drafting_guard == "on",
    )
    settings = ServerSettings(
        api_key=args.api_key,
        protect_metrics=args.protect_metrics,
        max_body_bytes=args.max_body_bytes,
        max_tokens_cap=args.max_tokens_cap,
        drain_timeout=args.drain_timeout,
        read_timeout=args.request_read_timeout,
        max_connections=args.max_connections,
        tool_call_parser=args.tool_call_parser,
    )
    return serve(AsyncEngine(config), settings, args.host, args.port, args.log_level)


class _Parser(argparse.ArgumentParser):
    """Every command's --help shows the defaults (the environment's, where one is set)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        # argparse shows a default only beside a help text: give bare options one.
        shown = action.default is not None and action.default is not False
        if not action.help and action.option_strings and shown:
            action.help = "default: %(default)s"
        return action


TARGET_HELP = (
    "mlx-lm model directory, .gguf file, or model name (`flashbatch pull --list`; "
    "'bundled' = the bundled offline pair)"
)
DEFAULT_TARGET_HELP = f"{TARGET_HELP[:-1]}; default {DEFAULT_MODEL})"
DRAFTER_HELP = "DFlash drafter directory (default: the named model's own, if any; 'none': off)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser(
        "serve",
        help=f"OpenAI-compatible HTTP server ({DEFAULT_MODEL} unless --target says otherwise)",
        description="Every flag also reads FLASHBATCH_<NAME> from the environment.",
    )
    srv.add_argument("--target", default=_env("TARGET", DEFAULT_MODEL), help=DEFAULT_TARGET_HELP)
    srv.add_argument("--drafter", default=_env("DRAFTER"), help=DRAFTER_HELP)
    srv.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"))
    srv.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    srv.add_argument("--port", type=int, default=_env("PORT", 8000, int))
    srv.add_argument("--api-key", default=_env("API_KEY"), help="require Bearer auth on /v1/*")
    srv.add_argument(
        "--protect-metrics",
        action="store_true",
        default=_env("PROTECT_METRICS", False, _flag),
        help="auth on /metrics too",
    )
    srv.add_argument("--max-num-seqs", type=int, default=_env("MAX_NUM_SEQS", 32, int))
    srv.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN", None, int))
    srv.add_argument(
        "--max-waiting-requests", type=int, default=_env("MAX_WAITING_REQUESTS", 256, int)
    )
    srv.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=_env("NUM_SPECULATIVE_TOKENS", None, int),
        help="unset: adaptive depth; a number: that fixed depth; 0: drafting off",
    )
    srv.add_argument(
        "--draft-sources",
        type=_sources,
        default=_env("DRAFT_SOURCES", None, _sources),
        help="dflash,lookup | dflash | lookup | none (default: both with a drafter, else lookup)",
    )
    srv.add_argument(
        "--drafting-guard",
        choices=("on", "off"),
        default=_env("DRAFTING_GUARD", "on"),
        help="adaptive depth only: hold drafting off at batch sizes where whole steps measured "
        "slower with it (default on; off: the depth controller alone)",
    )
    srv.add_argument(
        "--prefill-chunk-tokens", type=int, default=_env("PREFILL_CHUNK_TOKENS", 1024, int)
    )
    srv.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=_env("PREFIX_CACHE_BYTES", 512 << 20, int),
        help="prefix cache budget in bytes (finished requests' KV, reused by later prompts "
        "that start the same way); 0 = off",
    )
    srv.add_argument("--max-body-bytes", type=int, default=_env("MAX_BODY_BYTES", 1 << 20, int))
    srv.add_argument("--max-tokens-cap", type=int, default=_env("MAX_TOKENS_CAP", 4096, int))
    srv.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=_env("TOOL_CALL_PARSER", None, str),
        help="the tool-call format asked for and parsed (default: chosen by the chat template)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=_env("DRAIN_TIMEOUT", 30.0, float),
        help="seconds in-flight requests may finish after SIGTERM (a second signal aborts them)",
    )
    srv.add_argument(
        "--request-read-timeout",
        type=float,
        default=_env("REQUEST_READ_TIMEOUT", 30.0, float),
        help="seconds a request's headers, then its body, may take to arrive (else closed / 408)",
    )
    srv.add_argument(
        "--max-connections",
        type=int,
        default=_env("MAX_CONNECTIONS", 512, int),
        help="open HTTP connections at most; one more is closed when accepted",
    )
    srv.add_argument("--log-level", default=_env("LOG_LEVEL", "info"))
    srv.set_defaults(func=_serve)

    pull = sub.add_parser("pull", help="fetch and convert a named model (cached; offline after)")
    pull.add_argument("name", nargs="?", help=f"model name, e.g. {DEFAULT_MODEL}")
    pull.add_argument("--list", action="store_true", help="list the named models")
    pull.set_defaults(func=_pull)

    info = sub.add_parser("info", help="show the MLX device and which BLAS is active")
    info.set_defaults(func=_info)

    gen = sub.add_parser("generate", help="generate one completion (speculative with --drafter)")
    gen.add_argument("--target", default=_env("TARGET", DEFAULT_MODEL), help=DEFAULT_TARGET_HELP)
    gen.add_argument("--drafter", default=_env("DRAFTER"), help=DRAFTER_HELP)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--num-speculative-tokens", type=int, help="draft cap (0 = off)")
    gen.set_defaults(func=_generate)

    td = sub.add_parser("train-drafter", help="train a DFlash drafter: data, fit, eval")
    td_steps = td.add_subparsers(dest="step", required=True)
    td_data = td_steps.add_parser("data", help="write the target's greedy continuations (JSONL)")
    td_data.add_argument("--target", required=True, help=TARGET_HELP)
    td_data.add_argument("--prompts", required=True, help="one prompt per line, or .jsonl")
    td_data.add_argument("--out", required=True, help="output JSONL (resumes if it exists)")
    td_data.add_argument("--max-tokens", type=int, default=256)
    td_fit = td_steps.add_parser("fit", help="train a drafter on a data JSONL")
    td_fit.add_argument("--target", required=True, help=TARGET_HELP)
    td_fit.add_argument("--data", required=True, help="JSONL written by `data`")
    td_fit.add_argument("--out", required=True, help="drafter directory (z-lab layout)")
    td_fit.add_argument("--layers", type=int, default=1, help="drafter layers")
    td_fit.add_argument("--block-size", type=int, default=16)
    td_fit.add_argument(
        "--target-layer-ids", type=lambda s: [int(i) for i in s.split(",")],
        help="tapped target layers, comma-separated (default: the reference rule)",
    )  # fmt: skip
    td_fit.add_argument("--mask-token-id", type=int, help="default: the last embedding row")
    td_fit.add_argument("--steps", type=int, default=1000)
    td_fit.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    td_fit.add_argument("--lr", type=float, default=6e-4)
    td_fit.add_argument("--num-anchors", type=int, default=64)
    td_fit.add_argument("--max-len", type=int, default=2048)
    td_fit.add_argument("--seed", type=int, default=0)
    td_fit.add_argument("--checkpoint-every", type=int, default=100)
    td_fit.add_argument(
        "--feature-cache-mb", type=int, default=4096,
        help="keep the frozen target's features between epochs up to this many MiB (0: off)",
    )  # fmt: skip
    td_fit.add_argument(
        "--resume", action="store_true", help="continue from --out's checkpoint (sizes from it)"
    )
    td_eval = td_steps.add_parser("eval", help="tau of a drafter on held-out prompts")
    td_eval.add_argument("--target", required=True, help=TARGET_HELP)
    td_eval.add_argument("--drafter", required=True, help="drafter directory")
    td_eval.add_argument("--prompts", required=True, help="one prompt per line, or .jsonl")
    td_eval.add_argument("--max-tokens", type=int, default=128)
    for step_parser in (td_data, td_eval):
        step_parser.add_argument("--no-chat-template", action="store_true")
    td.set_defaults(func=_train_drafter)

    try:
        from bench.cli import add_bench_parser  # `bench run` / `bench serve` (bench/)
    except ImportError:  # an install without the bench package (the server image)
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
