"""Drafters: the `Drafter` protocol (`drafters.base`) and implementations (`drafters.dflash`)."""

import engine.platform  # noqa: F401  (preloads a fast BLAS before anything imports mlx)
