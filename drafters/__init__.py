"""Drafters: the `Drafter` protocol (`drafters.base`) and implementations: DFlash
(`drafters.dflash`, one batched forward) and n-gram lookup (`drafters.lookup`, no forward)."""

import engine.backend.platform  # noqa: F401  (preloads a fast BLAS before anything imports mlx)
