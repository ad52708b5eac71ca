"""This rank's part of the target: tensor parallel or pipeline parallel.

Tensor parallel splits every layer's heads and MLP columns over the ranks (mlx-lm's own
`shard()`: column-sharded q/k/v and gate/up, row-sharded o and down, whose products are summed
over the group); every rank then holds every layer, with 1/N of its weights, and every rank's
hidden states are whole after each layer. It needs the family to have `shard()` and the query
and KV head counts to divide by the ranks.

Pipeline parallel splits the layers instead (`engine.distributed.pipeline`): any head count
works, for the families the engine's packed forward covers (llama, qwen2, qwen3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.nn as nn

from engine.distributed.group import Group, ShardingError

TENSOR = "tensor"
PIPELINE = "pipeline"
MODES = (TENSOR, PIPELINE)


def _heads(model: nn.Module) -> tuple[int, int]:
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv = getattr(args, "num_key_value_heads", None) or heads
    if heads is None:
        raise ShardingError(f"{type(model).__module__}: no head counts in the model's args")
    return int(heads), int(kv)


# The families whose mlx-lm `shard()` splits only the layers' projections (each summed back
# over the group inside the layer), which the engine's packed and padded forwards, taps and
# head follow unchanged. Others' `shard()` also splits the LM head by vocabulary (qwen3_5) or
# the experts and recurrent mixers, which the engine's verify and rollback do not follow yet.
TENSOR_FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def tensor_reason(model: nn.Module, ranks: int) -> str | None:
    """Why `model` cannot run tensor parallel over `ranks` ranks (None: it can)."""
    family = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm's {family!r} has no tensor-parallel shard(); use --parallel pipeline"
    if type(model).__module__ not in TENSOR_FAMILIES:
        return (
            f"tensor parallel here covers llama, qwen2 and qwen3; mlx-lm's {family!r} shard() "
            "also splits parts (LM head, experts, recurrent mixers) the engine's verify does "
            "not follow yet"
        )
    heads, kv = _heads(model)
    if heads % ranks or kv % ranks:
        divisors = [n for n in range(1, kv + 1) if heads % n == 0 and kv % n == 0]
        return (
            f"{family!r} has {heads} query / {kv} KV heads, which do not divide over {ranks} "
            f"ranks (tensor parallel works on {divisors}); use --parallel pipeline"
        )
    return None


def shard_tensor(model: nn.Module, group: Group) -> None:
    """Replace this rank's layers' projections by their tensor-parallel shards."""
    reason = tensor_reason(model, group.size)
    if reason is not None:
        raise ShardingError(reason)
    model.shard(group.group)


def sharder(mode: str, group: Group, tapped: Sequence[int] = ()) -> Callable[[nn.Module], Any]:
    """The function that cuts a freshly loaded (lazy) model down to this rank's part
    (`tapped`: the layers a DFlash drafter reads, which pipeline parallel shares)."""
    if mode == TENSOR:
        return lambda model: shard_tensor(model, group)
    if mode == PIPELINE:
        from engine.distributed.pipeline import shard_pipeline

        return lambda model: shard_pipeline(model, group, tapped)
    raise ShardingError(f"--parallel {mode!r}: one of {', '.join(MODES)}")
