"""DFlash block-diffusion drafter: model, per-request sessions, z-lab checkpoint I/O."""

from drafters.dflash.checkpoint import (
    load_dflash_model,
    load_drafter,
    read_config,
    save_dflash_model,
)
from drafters.dflash.config import (
    DFlashConfig,
    DrafterConfigError,
    DrafterPairingError,
    default_target_layer_ids,
    validate_pairing,
)
from drafters.dflash.drafter import DFlashDrafter, DFlashSession
from drafters.dflash.model import DFlashDraftModel

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "DFlashSession",
    "DrafterConfigError",
    "DrafterPairingError",
    "default_target_layer_ids",
    "load_dflash_model",
    "load_drafter",
    "read_config",
    "save_dflash_model",
    "validate_pairing",
]
