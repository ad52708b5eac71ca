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

    from engine.backend.platform import report_blas

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
    from engine.models.gguf_header import GGUFError
    from engine.models.loading import load_pair
    from engine.models.pull import PullError
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

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
    chat = _use_chat(args.chat, pair.tokenizer)
    print(f"[prompt: {'chat template' if chat else 'raw text'}]", file=sys.stderr)
    if chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt_ids = list(pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:
        prompt_ids = pair.tokenizer.encode(args.prompt)
    start = time.perf_counter()
    result = generate(
        pair.target, prompt_ids, params, drafter=pair.drafter, tokenizer=pair.tokenizer
    )
    elapsed = time.perf_counter() - start
    print(result.text)
    print(f"\n[{generate_summary(result, elapsed)}]", file=sys.stderr)
    return 0


def _use_chat(flag: bool | None, tokenizer: Any) -> bool:
    """--chat / --no-chat; unset: the chat template when the model has one (instruct models
    answer raw text poorly: "What is the capital of France?" got an empty answer)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if flag and not has_template:
        raise SystemExit("flashbatch generate: --chat: this model has no chat template")
    return has_template if flag is None else flag


def generate_summary(result: Any, elapsed: float) -> str:
    """One line on what happened. The first token comes from the prompt's forward (prefill);
    every later one from a verify step, so a one-token answer has no steps to report."""
    n = len(result.token_ids)
    rate = f" = {n / elapsed:.1f} tok/s" if elapsed > 0 and n else ""
    head = f"{n} token{'s' if n != 1 else ''} in {elapsed:.2f}s{rate}; "
    tail = f"finish {result.finish_reason}"
    if not result.steps:
        what = "no decode steps (the only token came from the prompt's forward)" if n else (
            "no tokens generated")  # fmt: skip
        return head + what + "; " + tail
    steps = f"{len(result.steps)} decode step{'s' if len(result.steps) != 1 else ''}"
    if not result.drafted:
        return f"{head}{steps}, nothing drafted; {tail}"
    return (f"{head}{steps}, drafted {result.drafted}, accepted {result.accepted}, "
            f"tau {result.tau:.2f}; {tail}")  # fmt: skip


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
    from engine.http.server import ServerSettings, serve
    from engine.models.gguf_header import GGUFError
    from engine.models.pull import PullError
    from engine.models.resolve import resolve_target

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
        prefix_share_in_flight=args.prefix_share_in_flight == "on",
        drafting_guard=args.drafting_guard == "on",
        parallel=args.parallel,
        rank_timeout_s=args.rank_timeout,
    )
    if args.parallel:  # every rank runs this command (mlx.launch); rank 0 alone serves HTTP
        from engine.distributed.group import DistributedError, Group
        from engine.distributed.rank import serve_follower

        try:
            group = Group.init()
        except DistributedError as exc:
            print(f"flashbatch serve: {exc}", file=sys.stderr)
            return 2
        if not group.leader:
            return serve_follower(group, stop_grace=args.drain_timeout + 15.0)
    try:
        api_key = _api_key(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        print(f"flashbatch serve: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        api_key=api_key,
        protect_metrics=args.protect_metrics,
        max_body_bytes=args.max_body_bytes,
        max_tokens_cap=args.max_tokens_cap,
        drain_timeout=args.drain_timeout,
        read_timeout=args.request_read_timeout,
        max_connections=args.max_connections,
        tool_call_parser=args.tool_call_parser,
    )
    return serve(AsyncEngine(config), settings, args.host, args.port, args.log_level)


def _api_key(key: str | None, key_file: str | None) -> str | None:
    """The API key: from --api-key-file (or FLASHBATCH_API_KEY_FILE), the file's first line,
    so the key never shows in `ps`; else --api-key / FLASHBATCH_API_KEY."""
    if key_file:
        if key:
            raise ValueError("give --api-key or --api-key-file, not both")
        with open(key_file) as file:
            key = file.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {key_file}: the file's first line is empty")
    return key or None


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" where it says something, once: not when the help already names
    its default, not for an unset (None) default, and not for on/off flags, whose stored
    value (`--no-warmup`'s True) reads as the opposite of what the flag does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
            or action.nargs == 0
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every command's --help shows the defaults (the environment's, where one is set)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


TARGET_HELP = (
    "mlx-lm model directory, .gguf file, or model name (`flashbatch pull --list`; "
    "'bundled' = the bundled offline pair)"
)
DEFAULT_TARGET_HELP = TARGET_HELP
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
    srv.add_argument(
        "--served-model-name", default=_env("SERVED_MODEL_NAME"),
        help="the model name clients send and see (default: the target's name); requests "
        "naming another model get a 404",
    )  # fmt: skip
    srv.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind")
    srv.add_argument("--port", type=int, default=_env("PORT", 8000, int), help="port to bind")
    srv.add_argument(
        "--api-key-file", default=_env("API_KEY_FILE"),
        help="require `Authorization: Bearer <key>` on /v1/*, the key being this file's first "
        "line (the way to set a key: FLASHBATCH_API_KEY works too, --api-key shows in `ps`)",
    )  # fmt: skip
    srv.add_argument(
        "--api-key", default=_env("API_KEY"),
        help="the key itself (visible to every user in `ps`: prefer --api-key-file or "
        "FLASHBATCH_API_KEY)",
    )  # fmt: skip
    srv.add_argument(
        "--protect-metrics",
        action="store_true",
        default=_env("PROTECT_METRICS", False, _flag),
        help="auth on /metrics too",
    )
    srv.add_argument(
        "--max-num-seqs", type=int, default=_env("MAX_NUM_SEQS", 32, int),
        help="requests decoded together (the batch size at most)",
    )  # fmt: skip
    srv.add_argument(
        "--max-model-len", type=int, default=_env("MAX_MODEL_LEN", None, int),
        help="prompt + output tokens per request at most (default: the model's context)",
    )  # fmt: skip
    srv.add_argument(
        "--max-waiting-requests", type=int, default=_env("MAX_WAITING_REQUESTS", 256, int),
        help="queued requests at most; one more is answered 429 with Retry-After",
    )  # fmt: skip
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
        "slower with it (default: on; off: the depth controller alone)",
    )
    srv.add_argument(
        "--prefill-chunk-tokens", type=int, default=_env("PREFILL_CHUNK_TOKENS", 1024, int),
        help="prompt tokens prefilled per step, across all prefilling requests",
    )  # fmt: skip
    srv.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=_env("PREFIX_CACHE_BYTES", 512 << 20, int),
        help="prefix cache budget in bytes (finished requests' KV, reused by later prompts "
        "that start the same way); 0 = off",
    )
    srv.add_argument(
        "--prefix-share-in-flight", choices=("on", "off"),
        default=_env("PREFIX_SHARE_IN_FLIGHT", "on", str),
        help="share a prompt's prefix as soon as its prefill completes, holding back requests "
        "that start the same way until then (default: on; off: only finished and aborted "
        "requests leave prefixes)",
    )  # fmt: skip
    srv.add_argument(
        "--max-body-bytes", type=int, default=_env("MAX_BODY_BYTES", 1 << 20, int),
        help="request body size limit in bytes, as sent and decompressed; over it: 413",
    )  # fmt: skip
    srv.add_argument(
        "--max-tokens-cap", type=int, default=_env("MAX_TOKENS_CAP", 4096, int),
        help="the most tokens one request may ask for; more is a 400",
    )  # fmt: skip
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
    srv.add_argument(
        "--parallel", choices=("tensor", "pipeline"), default=_env("PARALLEL"),
        help="shard the target over the ranks `mlx.launch` started (rank 0 serves HTTP): "
        "tensor (heads split; mlx-lm's shard()) or pipeline (layers split)",
    )  # fmt: skip
    srv.add_argument(
        "--rank-timeout", type=float, default=_env("RANK_TIMEOUT", 20.0, float),
        help="with --parallel: seconds a step may take before a rank counts as lost (then "
        "every request gets a 503 and the server exits non-zero)",
    )  # fmt: skip
    srv.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "info"),
        help="debug, info (with the access log), warning, error",
    )  # fmt: skip
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
    gen.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    gen.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="send the prompt as a user message through the model's chat template (--chat) "
        "or as raw text (--no-chat); default: the chat template when the model has one",
    )  # fmt: skip
    gen.add_argument("--max-tokens", type=int, default=128, help="output tokens at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top")
    gen.add_argument("--seed", type=int, help="sampling seed (default: random)")
    gen.add_argument("--num-speculative-tokens", type=int, help="draft cap (0 = off)")
    gen.set_defaults(func=_generate)

    td = sub.add_parser("train-drafter", help="train a DFlash drafter: data, fit, eval")
    td_steps = td.add_subparsers(dest="step", required=True)
    td_data = td_steps.add_parser("data", help="write the target's greedy continuations (JSONL)")
    td_data.add_argument("--target", required=True, help=TARGET_HELP)
    td_data.add_argument("--prompts", required=True, help="one prompt per line, or .jsonl")
    td_data.add_argument("--out", required=True, help="output JSONL (resumes if it exists)")
    td_data.add_argument("--max-tokens", type=int, default=256, help="tokens per continuation")
    td_fit = td_steps.add_parser("fit", help="train a drafter on a data JSONL")
    td_fit.add_argument("--target", required=True, help=TARGET_HELP)
    td_fit.add_argument("--data", required=True, help="JSONL written by `data`")
    td_fit.add_argument("--out", required=True, help="drafter directory (z-lab layout)")
    td_fit.add_argument("--layers", type=int, default=1, help="drafter layers")
    td_fit.add_argument("--block-size", type=int, default=16, help="tokens per drafted block")
    td_fit.add_argument(
        "--target-layer-ids", type=lambda s: [int(i) for i in s.split(",")],
        help="tapped target layers, comma-separated (default: the reference rule)",
    )  # fmt: skip
    td_fit.add_argument(
        "--mask-token-id", type=int, help="the mask token's id (default: the last embedding row)"
    )
    td_fit.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    td_fit.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    td_fit.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    td_fit.add_argument(
        "--num-anchors", type=int, default=64, help="blocks (anchors) trained per sequence"
    )
    td_fit.add_argument("--max-len", type=int, default=2048, help="tokens per sequence at most")
    td_fit.add_argument("--seed", type=int, default=0, help="initialization and sampling seed")
    td_fit.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between checkpoints in --out; 0: only at the end",
    )
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
    td_eval.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt")
    for step_parser in (td_data, td_eval):
        step_parser.add_argument(
            "--no-chat-template", action="store_true",
            help="use the prompts as raw text (by default each goes through the chat template)",
        )  # fmt: skip
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
