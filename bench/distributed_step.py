"""Where a distributed step's time goes: the call broadcast and the collectives, against the
single-process step, on the same machine.

    python bench/distributed_step.py --out DIR                       # the single-process run
    mlx.launch -n 2 --backend ring -- python bench/distributed_step.py --parallel tensor --out DIR
    python bench/distributed_step.py --report DIR                    # table + projection

Each run serves the same greedy load through `AsyncEngine` (the bundled pair unless
`--target/--drafter` say otherwise): 8 prompts at concurrency 1 and at 8, drafting off and at
a fixed DFlash depth of 4, after a warm-up. It records every step's wall time (from the engine's
step hooks) and, distributed, the time rank 0 spent sending each call to the other ranks; and
it times `all_sum` of one step's hidden states alone ([T, hidden] in the compute dtype, T =
the step's positions), which is what each collective inside the forward costs here. Writes
DIR/<mode>.json. `--report` reads them all and adds the projection (`--project-*`): bytes per
token per rank for a model of that shape over a link of that speed.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from engine.bundled.workloads import load_workloads

    texts = load_workloads()["completion"][:count]
    return [list(tokenizer.encode(t[-400:])) for t in texts]


async def _serve(args: argparse.Namespace, depth: int, concurrency: int, steps: list,
                 broadcast: list, sums: dict) -> float:  # fmt: skip
    from engine import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(target=args.target, drafter=args.drafter, parallel=args.parallel,
                          num_speculative_tokens=depth, prefix_cache_bytes=0,
                          draft_sources=["dflash"] if depth else [],
                          max_num_seqs=concurrency)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    async with AsyncEngine(config) as eng:
        prompts = _prompts(eng.tokenizer, 8)

        async def one(p):
            async for _ in eng.generate(p, params):
                pass

        await asyncio.gather(*(one(p) for p in prompts[:2]))  # warm-up
        if hasattr(eng._runner, "watch_broadcasts"):
            eng._runner.watch_broadcasts(broadcast.append)
        eng.step_hooks.append(lambda r: steps.append(
            {"seconds": r.step_seconds, "verify": r.verify_tokens, "batch": r.batch_size,
             "prefill": r.prefill_tokens}))  # fmt: skip
        started, counted = time.perf_counter(), _SUMS[0]
        for i in range(0, len(prompts), concurrency):
            await asyncio.gather(*(one(p) for p in prompts[i : i + concurrency]))
        sums["n"] = _SUMS[0] - counted  # built on rank 0 while serving (the forwards' too)
        return time.perf_counter() - started


def _collective_seconds(hidden: int, dtype, positions: list[int], repeats: int = 50) -> dict:
    """Median seconds of one all_sum of [T, hidden] per T (distributed runs only)."""
    import mlx.core as mx

    from engine.distributed.group import Group

    group = Group.init()
    out = {}
    for t in positions:
        x = mx.ones((1, t, hidden), dtype=dtype)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(group.all_sum(x))
            times.append(time.perf_counter() - started)
        out[str(t)] = statistics.median(times)
    return out


_SUMS = [0]  # every all_sum this process built (mlx-lm's sharded layers' included)


def _count_sums() -> None:
    """Count `mx.distributed.all_sum` calls (looked up at call time by mlx-lm's layers too)."""
    import mlx.core as mx

    inner = mx.distributed.all_sum

    def counted(*a, **k):
        _SUMS[0] += 1
        return inner(*a, **k)

    mx.distributed.all_sum = counted


def run(args: argparse.Namespace) -> int:
    _count_sums()
    if args.parallel:
        from engine.distributed.group import Group
        from engine.distributed.rank import serve_follower

        group = Group.init()
        if not group.leader:
            code = serve_follower(group)  # one engine per cell: follow each in turn
            for _ in range(3):
                code = code or serve_follower(group)
            _collective_seconds(args.hidden, _dtype(args), [1, 8, 40])
            return code
    cells = {}
    for depth in (0, 4):
        for concurrency in (1, 8):
            steps: list = []
            broadcast: list[float] = []  # every call's (execute, advance, ...) send time
            sums = {}
            wall = asyncio.run(_serve(args, depth, concurrency, steps, broadcast, sums))
            cells[f"depth{depth}-c{concurrency}"] = {"wall": wall, "steps": steps,
                                                     "broadcast": broadcast,
                                                     "all_sums": sums.get("n", 0)}  # fmt: skip
    result = {"mode": args.parallel or "single", "target": args.target, "cells": cells}
    if args.parallel:
        result["all_sum"] = _collective_seconds(args.hidden, _dtype(args), [1, 8, 40])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['mode']}.json").write_text(json.dumps(result))
    return 0


def _dtype(args: argparse.Namespace):
    import mlx.core as mx

    from engine.backend.platform import compute_dtype

    return compute_dtype() or mx.float32


def report(args: argparse.Namespace) -> int:
    paths = sorted(Path(args.report).glob("*.json"), key=lambda p: (p.stem != "single", p.stem))
    runs = {p.stem: json.loads(p.read_text()) for p in paths}  # the single-process run first
    single = runs.get("single")
    lines = ["| cell | mode | steps | wall s | wall vs one process | median step ms (runner) "
             "| call sends ms / step | all_sums / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for cell in (single or next(iter(runs.values())))["cells"]:
        base = None
        for mode, run_ in runs.items():
            data = run_["cells"][cell]
            steps, wall = data["steps"], data["wall"]
            median = statistics.median(s["seconds"] for s in steps) * 1e3
            base = wall if mode == "single" else base
            sends = data.get("broadcast") or []
            cast = f"{sum(sends) / len(steps) * 1e3:.2f}" if sends else "-"
            ratio = f"{wall / base:.2f}x" if base and mode != "single" else "1"
            per_step = data.get("all_sums", 0) / len(steps)
            lines.append(f"| {cell} | {mode} | {len(steps)} | {wall:.2f} | {ratio} | "
                         f"{median:.1f} | {cast} | {per_step:.1f} |")  # fmt: skip
    for mode, run_ in runs.items():
        if "all_sum" in run_:
            sums = ", ".join(f"T={t}: {s * 1e3:.3f} ms" for t, s in run_["all_sum"].items())
            lines.append(f"\n{mode}: one all_sum of [T, hidden] here: {sums}")
    lines.append("\n" + projection(args))
    print("\n".join(lines))
    return 0


def projection(args: argparse.Namespace) -> str:
    """Bytes per token per rank, and the link's time for them, for a model of this shape."""
    h, layers, n, width = args.project_hidden, args.project_layers, args.project_ranks, 2
    link = args.project_link_gbps * 1e9 / 8  # bytes per second
    # Tensor parallel: two all-reduces of [hidden] per layer per token (after attention or the
    # linear-attention mixer, after the MLP or MoE); a ring all-reduce sends 2(N-1)/N of it.
    tp = 2 * layers * 2 * (n - 1) / n * h * width
    # Pipeline parallel (this engine: a block's output reaches every rank in one all_sum at
    # each of the N block ends, plus the drafter's K tapped layers).
    pp = (n + args.project_taps) * 2 * (n - 1) / n * h * width
    rows = [f"Projection for a {layers}-layer, hidden-{h} model on {n} ranks over "
            f"{args.project_link_gbps:.0f} Gb/s, bf16 activations (bandwidth only; add "
            f"{2 * layers} (tensor) or {n + args.project_taps} (pipeline) link latencies "
            "per forward):", "", "| parallel | bytes / token / rank | batch | positions | "
            "MB / step | link ms / step |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, per_token in (("tensor", tp), ("pipeline", pp)):
        for batch, depth in ((1, 0), (32, 0), (1, 15), (32, 15)):
            positions = batch * (1 + depth)
            total = per_token * positions
            rows.append(f"| {name} | {per_token:,.0f} | {batch} | {positions} "
                        f"| {total / 1e6:.2f} | {total / link * 1e3:.3f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from engine.bundled.pair import bundled_paths

    target, drafter = bundled_paths()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(target))
    parser.add_argument("--drafter", default=str(drafter))
    parser.add_argument("--parallel", choices=("tensor", "pipeline"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, help="the all_sum width (default: the target's)")
    parser.add_argument("--out", default="bench/results/distributed")
    parser.add_argument("--report", help="a directory of runs: print the table")
    parser.add_argument("--project-hidden", type=int, default=3072)
    parser.add_argument("--project-layers", type=int, default=48)
    parser.add_argument("--project-ranks", type=int, default=2)
    parser.add_argument("--project-taps", type=int, default=5, help="DFlash tapped layers")
    parser.add_argument("--project-link-gbps", type=float, default=80.0)
    args = parser.parse_args(argv)
    if args.hidden is None and not args.report:
        from engine.models.resolve import resolve_target

        config = json.loads((Path(resolve_target(args.target)) / "config.json").read_text())
        args.hidden = config["hidden_size"]
    return report(args) if args.report else run(args)


if __name__ == "__main__":
    sys.exit(main())
