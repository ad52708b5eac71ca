"""TTFT of N clients that send one long system prompt at the same moment.

    python bench/shared_prompt_ttft.py [--target DIR --drafter DIR] [--clients 16]
        [--system-tokens 1500] [--rounds 2] [--mlx-lm]

Each round builds a fresh system prompt (code files of the bundled workloads), then N prompts
of system prompt + a client's own question, all added at once. Arms, rounds interleaved:
flashbatch with in-flight prefix sharing on (the default), with it off (the prefix cache
serves only finished and aborted requests) and with the prefix cache off, all through
`AsyncEngine`; with --mlx-lm also `mlx_lm.server` over HTTP (streamed /v1/completions with
the same texts; its TTFT includes HTTP, flashbatch's does not). The table gives the median and
the worst client TTFT (arrival to first token) and flashbatch's prompt tokens prefilled per
round (`flashbatch_prompt_tokens_total`).
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
import time


def system_prompts(tokenizer, tokens: int, rounds: int) -> list[str]:
    """`rounds` distinct texts of about `tokens` tokens (no round hits another's cache)."""
    from engine.bundled.workloads import load_workloads

    files = load_workloads()["completion"]
    out = []
    for r in range(rounds):
        parts, i = [], r
        while len(tokenizer.encode("\n\n".join(parts))) < tokens:
            parts.append(files[i % len(files)])
            i += rounds
        ids = tokenizer.encode("\n\n".join(parts))[:tokens]
        out.append("You are a code reviewer. The project:\n" + tokenizer.decode(ids))
    return out


def questions(n: int) -> list[str]:
    return [f"\n\nQuestion {i}: what does function number {i} return, and why?" for i in range(n)]


async def flashbatch_round(engine_, texts: list[str], max_tokens: int) -> tuple[list[float], int]:
    from engine import SamplingParams

    before = _prefilled(engine_)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    streams = [engine_.add_request(list(engine_.tokenizer.encode(t)), params)[1] for t in texts]

    async def first(stream) -> float:
        ttft = None
        async with stream:
            async for _ in stream:
                if ttft is None:
                    ttft = time.perf_counter() - started
        return ttft

    ttfts = await asyncio.gather(*[first(s) for s in streams])
    while not engine_.idle:
        await asyncio.sleep(0.005)
    return list(ttfts), int(_prefilled(engine_) - before)


def _prefilled(engine_) -> float:
    for line in engine_.metrics.exposition().decode().splitlines():
        if line.startswith("flashbatch_prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def mlx_lm_round(port: int, texts: list[str], max_tokens: int) -> list[float]:
    import httpx

    async def one(client, text: str, started: float) -> float:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        for _ in range(5):  # its http.server listens with a backlog of 5: resets past it
            try:
                async with client.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            return time.perf_counter() - started  # retries included
            except httpx.TransportError:
                await asyncio.sleep(0.05)
        raise RuntimeError("mlx_lm.server streamed nothing")

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        return list(await asyncio.gather(*[one(client, t, started) for t in texts]))


@contextlib.contextmanager
def mlx_lm_server(model: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
    log = open("/tmp/mlx_lm_server.log", "w")  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=log)
    try:
        import httpx

        for _ in range(600):
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("mlx_lm.server did not start")
        yield port
    finally:
        process.terminate()
        process.wait(30)


async def run(args: argparse.Namespace) -> None:
    from engine import AsyncEngine, EngineConfig
    from engine.bundled.pair import bundled_paths

    target, drafter = args.target, args.drafter
    if target is None:
        bundled_target, bundled_drafter = bundled_paths()
        target, drafter = str(bundled_target), drafter or str(bundled_drafter)
    arms = {"sharing on": (256 << 20, True), "sharing off": (256 << 20, False),
            "cache off": (0, False)}  # fmt: skip
    engines = {}
    for name, (budget, share) in arms.items():
        config = EngineConfig(target=target, drafter=drafter, max_num_seqs=args.clients,
                              prefix_cache_bytes=budget, prefix_share_in_flight=share)  # fmt: skip
        engines[name] = AsyncEngine(config)
        await engines[name].start()
    tokenizer = engines["sharing on"].tokenizer
    systems = system_prompts(tokenizer, args.system_tokens, args.rounds + 1)
    ttfts: dict[str, list[list[float]]] = {name: [] for name in arms}
    prefilled: dict[str, list[int]] = {name: [] for name in arms}
    server = mlx_lm_server(target) if args.mlx_lm else contextlib.nullcontext()
    try:
        with server as port:
            if port is not None:
                ttfts["mlx_lm.server"] = []
            for r, system in enumerate(systems):
                texts = [system + q for q in questions(args.clients)]
                for name, engine_ in engines.items():
                    got, tokens = await flashbatch_round(engine_, texts, args.max_tokens)
                    if r:  # round 0 warms everything up
                        ttfts[name].append(got)
                        prefilled[name].append(tokens)
                if port is not None:
                    got = await mlx_lm_round(port, texts, args.max_tokens)
                    if r:
                        ttfts["mlx_lm.server"].append(got)
                for name, rounds in ttfts.items():
                    if r and rounds:
                        print(f"round {r} {name}: median TTFT "
                              f"{statistics.median(rounds[-1]) * 1000:.0f} ms, worst "
                              f"{max(rounds[-1]) * 1000:.0f} ms", flush=True)  # fmt: skip
    finally:
        for engine_ in engines.values():
            await engine_.shutdown()
    prompt = len(tokenizer.encode(systems[0] + questions(1)[0]))
    print()
    print(f"{args.clients} clients, prompts of ~{prompt} tokens, {args.rounds} rounds")
    print("| arm | median TTFT (ms) | worst TTFT (ms) | prompt tokens prefilled / round |")
    print("|---|---:|---:|---:|")
    for name, rounds in ttfts.items():
        every = [t for got in rounds for t in got]
        worst = statistics.median(max(got) for got in rounds)
        tokens = f"{statistics.median(prefilled[name]):.0f}" if prefilled.get(name) else "-"
        print(f"| {name} | {statistics.median(every) * 1000:.0f} | {worst * 1000:.0f} | {tokens} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mlx-lm", action="store_true", help="also time mlx_lm.server (HTTP)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
