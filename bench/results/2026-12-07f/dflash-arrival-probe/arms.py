"""The hybrid with a new request resetting DFlash's probe backoff too (arm "arrival"), beside
the shipped rule (lookup's only) and lookup alone, in one `bench run`:

    PYTHONPATH=. python bench/results/2026-12-07f/dflash-arrival-probe/arms.py \\
        --target smollm2-135m-instruct --workloads chat,completion --concurrency 1 \\
        --requests 16 --rounds 3 --out DIR
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio

from bench.cli import add_run_arguments
from bench.engines import FlashbatchEngine
from bench.suite import build_engines, config_from_args, run_suite
from scheduler.sources import DFLASH, LOOKUP


class ArrivalProbe(FlashbatchEngine):
    """The hybrid whose policy resets DFlash's backoff when a request arrives."""

    async def start(self) -> None:
        await super().start()
        self.engine._policy.probe_on_arrival = (LOOKUP, DFLASH)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args()
    args.engines, args.policies = ["flashbatch"], ["adaptive@lookup", "adaptive"]
    cfg = config_from_args(args)
    _, engines = build_engines(cfg)
    hybrid = next(e for e in engines if e.name == "flashbatch adaptive")
    arm = ArrivalProbe("flashbatch adaptive arrival", hybrid.config)
    asyncio.run(run_suite(cfg, extra_engines=[arm], progress=False))


if __name__ == "__main__":
    main()
