"""DFlash drafter configuration: parsing of z-lab `config.json` files and pairing validation.

One place for every fact about the checkpoint format: which keys exist, where they may live
(top level or inside `dflash_config`), the default tapped-layer rule, and the checks that a
drafter fits the target it is paired with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from drafters.base import TargetShape


class DrafterConfigError(ValueError):
    """The drafter's config.json is missing a field or holds an impossible value."""


class DrafterPairingError(ValueError):
    """The drafter does not fit the target it was paired with."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: spread ids evenly from layer 1 to layer L_t - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The fields of a DFlash drafter's `config.json` that the model and loader use."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    model_type: str = "qwen3"
    # Per drafter layer, "full_attention" or "sliding_attention" (z-lab's Qwen3.6 drafters):
    # a sliding layer's block query at position p sees only keys at positions > p - window,
    # as z-lab's PyTorch model (`DFlashAttention.sliding_window`) trains it. None: all full.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, written back on save

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Parse a z-lab style config, accepting the documented layout variants."""
        raw = dict(raw)
        nested = raw.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            if name in nested and nested[name] is not None:
                return nested[name]
            if name in raw and raw[name] is not None:
                return raw[name]
            return default

        def need(name: str) -> Any:
            value = pick(name)
            if value is None:
                raise DrafterConfigError(f"drafter config.json lacks required field {name!r}")
            return value

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        rope_parameters = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta") or rope_parameters.get("rope_theta") or 1_000_000.0
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        num_target_layers = pick("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DrafterConfigError(
                    "drafter config.json gives neither dflash_config.target_layer_ids "
                    "nor num_target_layers, so the tapped target layers are unknown"
                )
            layer_ids = default_target_layer_ids(int(num_target_layers), layers)
        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "block_size", "mask_token_id",
            "target_layer_ids", "num_target_layers", "rms_norm_eps", "rope_theta",
            "rope_scaling", "rope_parameters", "max_position_embeddings", "attention_bias",
            "model_type", "dflash_config", "layer_types", "sliding_window",
        }  # fmt: skip
        layer_types = pick("layer_types")
        sliding_window = pick("sliding_window")
        config = cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(pick("num_key_value_heads", heads)),
            head_dim=int(pick("head_dim", hidden // heads)),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            block_size=int(need("block_size")),
            mask_token_id=int(need("mask_token_id")),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rms_norm_eps=float(pick("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(pick("max_position_embeddings", 40960)),
            attention_bias=bool(pick("attention_bias", False)),
            model_type=str(raw.get("model_type", "qwen3")),
            # All-full layer types say nothing (our own saves write them for every drafter).
            layer_types=(
                None
                if layer_types is None or "sliding_attention" not in layer_types
                else [str(t) for t in layer_types]
            ),
            sliding_window=None if sliding_window is None else int(sliding_window),
            extra={k: v for k, v in raw.items() if k not in known},
        )
        config.check()
        return config

    def check(self) -> None:
        """Self-consistency checks that need no target."""
        if self.block_size < 2:
            raise DrafterConfigError(
                f"block_size must be at least 2 (anchor + one draft row); config says "
                f"{self.block_size}"
            )
        if not self.target_layer_ids:
            raise DrafterConfigError("dflash_config.target_layer_ids is empty")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise DrafterConfigError(
                    f"layer_types names {len(self.layer_types)} layers, the drafter has "
                    f"{self.num_hidden_layers}"
                )
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise DrafterConfigError(
                    f"layer_types holds {unknown}: only full_attention and sliding_attention"
                )
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise DrafterConfigError(
                    "layer_types has sliding_attention layers but sliding_window is "
                    f"{self.sliding_window!r} (a positive number of positions is needed)"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab layout: `block_size` at top level, ids and mask inside `dflash_config`."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=["DFlashDraftModel"],
            model_type=self.model_type,
            block_size=self.block_size,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            num_target_layers=self.num_target_layers,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            hidden_act="silu",
            attention_bias=self.attention_bias,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=list(self.layer_types or ["full_attention"] * self.num_hidden_layers),
            tie_word_embeddings=False,
        )
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        return out

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window


def validate_pairing(config: DFlashConfig, target: TargetShape, fc_in_features: int) -> None:
    """Raise DrafterPairingError with a message that says exactly what does not fit."""
    problems: list[str] = []
    if config.block_size < 2:
        problems.append(f"block_size must be at least 2, drafter has {config.block_size}")
    if config.hidden_size != target.hidden_size:
        problems.append(
            f"drafter hidden_size {config.hidden_size} != target hidden_size {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        problems.append(
            f"drafter vocab_size {config.vocab_size} != target vocab size {target.vocab_size}"
        )
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_ids:
        problems.append(
            f"target_layer_ids {bad_ids} out of range: the target ({target.model_type}) has "
            f"{target.num_layers} decoder layers (valid ids 0..{target.num_layers - 1})"
        )
    if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
        problems.append(
            f"drafter was trained for a {config.num_target_layers}-layer target, "
            f"this target has {target.num_layers} layers"
        )
    if not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(
            f"mask_token_id {config.mask_token_id} lies outside the target vocabulary "
            f"(0..{target.vocab_size - 1})"
        )
    expected_fc = len(config.target_layer_ids) * target.hidden_size
    if fc_in_features != expected_fc:
        problems.append(
            f"fc takes {fc_in_features} features but {len(config.target_layer_ids)} tapped "
            f"layers x hidden {target.hidden_size} = {expected_fc}"
        )
    if problems:
        raise DrafterPairingError("drafter does not fit the target: " + "; ".join(problems))
