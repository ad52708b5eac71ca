"""A campaign training step with the drafter's softmax and SwiGLU on MLX's own ops or on the
CPU kernels (`FLASHBATCH_CPU_KERNELS=0` turns them off, the default since sitting 11 is on).

    FLASHBATCH_CPU_KERNELS=1 PYTHONPATH=<repo> python train_step.py
    FLASHBATCH_CPU_KERNELS=0 PYTHONPATH=<repo> python train_step.py

The shipped checkpoint (in memory: nothing is written) trained 12 steps of 4 held-out records
at lr 1e-4; prints the median step seconds after 2 and the first losses (equal either way).
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import time
from pathlib import Path

from drafters.dflash import campaign

TARGET = "smollm2-135m-instruct"

if __name__ == "__main__":
    trainer = campaign.trainer_for(TARGET, Path("engine/models/smollm2_drafter"))
    on = trainer.model.layers[0].mlp.cpu_kernels and trainer.target.cpu_kernels
    _, val = campaign.corpus_split(TARGET)
    sequences = campaign.to_sequences(val, trainer.recipe.max_len)
    store = trainer.store(sequences)
    seconds, losses = [], []
    for i in range(12):
        members = [(4 * i + j) % len(sequences) for j in range(4)]
        start = time.perf_counter()
        loss, _, _ = trainer.step(store, members, sequences, 1e-4)
        seconds.append(time.perf_counter() - start)
        losses.append(round(loss, 5))
    print(f"CPU kernels {'on' if on else 'off'}: step {statistics.median(seconds[2:]):.3f} s")
    print(f"  first losses {losses[:4]}")
