"""Starting a distributed engine: the group, each rank's part of the target, its runner.

Rank 0 (`load_leader`, called from `AsyncEngine` on its MLX thread) sends its configuration to
the followers, then every rank loads its shard at the same time; a barrier then says that every
rank has loaded, which is when rank 0's engine becomes ready. A follower (`serve_follower`,
what `flashbatch serve --parallel ...` runs on a rank other than 0) builds the same runner from
rank 0's configuration and replays rank 0's calls until told to stop.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config import EngineConfig
from engine.distributed.follower import StandInDrafter, follow
from engine.distributed.group import DistributedError, Group, SharedDecisions
from engine.distributed.mirror import MirroredRunner
from engine.distributed.sharding import sharder

log = logging.getLogger("flashbatch.distributed")


def _runner_options(config: EngineConfig, sources: tuple[str, ...]) -> dict[str, Any]:
    from drafters.lookup import LookupDrafter
    from scheduler.sources import LOOKUP

    lookup = None
    if LOOKUP in sources:
        lookup = LookupDrafter(config.lookup_min_ngram, config.lookup_max_ngram,
                               config.lookup_max_depth,
                               config.lookup_depth_per_match or None)  # fmt: skip
    return {"profile_phases": config.profile_phases, "lookup": lookup,
            "packed_verify": config.packed_verify}  # fmt: skip


def _tapped(drafter_path: str | None) -> list[int]:
    """The target layers the DFlash drafter reads (none without one)."""
    if drafter_path is None:
        return []
    from drafters.dflash.checkpoint import read_config

    return list(read_config(drafter_path).target_layer_ids)


def _untuned() -> None:
    """The CPU kernels and row padding replace the layers' projections' calls, which would
    drop a sharded projection's sum over the group: both stay off in distributed mode."""
    log.info("distributed mode: CPU kernels and row padding off (they bypass sharded layers)")


def is_leader() -> bool:
    """Whether this process is rank 0 of the group `mlx.launch` started (joining it)."""
    return Group.init().leader


def load_leader(config: EngineConfig, drafter_path: str | None, sources: tuple[str, ...],
                group: Group | None = None) -> tuple[Any, Any]:  # fmt: skip
    """Rank 0's runner (mirrored to the followers) and tokenizer."""
    from engine.models.loading import load_pair
    from engine.step.runner import ModelRunner

    group = group or Group.init()
    group.broadcast_object((config, drafter_path, sources))  # the followers load meanwhile
    shard = sharder(config.parallel, group, _tapped(drafter_path))
    pair = load_pair(config.target, drafter_path, shard=shard)
    _untuned()
    runner = ModelRunner(pair.target, pair.drafter, **_runner_options(config, sources))
    runner.decisions = SharedDecisions(group)
    group.barrier()  # every rank has loaded
    log.info("distributed engine ready: %d ranks, %s parallel", group.size, config.parallel)
    return MirroredRunner(runner, group), pair.tokenizer


def serve_follower(group: Group | None = None, stop_grace: float = 45.0) -> int:
    """A follower rank's whole life: load its shard, then replay rank 0's calls. Returns the
    process exit code (0: rank 0 stopped it; 1: a rank was lost).

    SIGTERM and SIGINT do not stop a follower at once: rank 0 drains its requests first and
    then stops every follower. A signal only arms a deadline (`stop_grace` seconds), in case
    rank 0 never does."""
    import signal

    def deadline(signum: int, frame: Any) -> None:
        log.info("rank %d: signal %d; leaving when rank 0 says so (at most %.0f s)",
                 group.rank, signum, stop_grace)  # fmt: skip
        signal.alarm(max(1, int(stop_grace)))  # SIGALRM's default action ends the process

    signal.signal(signal.SIGTERM, deadline)
    signal.signal(signal.SIGINT, deadline)
    from drafters.dflash.checkpoint import read_config
    from engine.models.loading import load_target_model
    from engine.step.runner import ModelRunner
    from engine.step.stopping import eos_ids_of
    from engine.step.structured import GrammarCompiler
    from engine.step.target import TargetAdapter

    group = group or Group.init()
    try:
        config, drafter_path, sources = group.broadcast_object()
    except DistributedError as exc:
        log.error("rank %d: no configuration from rank 0: %s", group.rank, exc)
        return 1
    layer_ids = _tapped(drafter_path)
    try:
        model, tokenizer = load_target_model(
            config.target, sharder(config.parallel, group, layer_ids)
        )
    except DistributedError as exc:  # ShardingError: rank 0 says the same and exits too
        log.error("rank %d: %s", group.rank, exc)
        return 2
    drafter = None
    if drafter_path is not None:
        block_size = read_config(drafter_path).block_size
        drafter = StandInDrafter(block_size, block_size - 1)  # DFlashDrafter's max_depth
    target = TargetAdapter(model, layer_ids)
    _untuned()
    runner = ModelRunner(target, drafter, **_runner_options(config, sources))
    runner.decisions = SharedDecisions(group)
    try:  # the same compiler rank 0 has: grammar masks are host work on committed tokens
        runner.grammars = GrammarCompiler(tokenizer, target.vocab_size, eos_ids_of(tokenizer))
    except Exception:  # noqa: BLE001 (rank 0 then refuses structured requests too)
        runner.grammars = None
    try:
        group.barrier()
    except DistributedError as exc:
        log.error("rank %d: rank 0 lost while loading: %s", group.rank, exc)
        return 1
    log.info("rank %d of %d loaded (%s parallel); following rank 0", group.rank, group.size,
             config.parallel)  # fmt: skip
    return follow(group, runner)
