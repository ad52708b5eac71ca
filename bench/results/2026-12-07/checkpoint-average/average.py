"""Drafter directories whose weights average committed checkpoints (LAWA-style), to measure.

    PYTHONPATH=<repo> python average.py OUT REV [REV ...]

Writes OUT: the drafter directory as committed at the first REV, its `model.safetensors`
replaced by the element-wise mean (float32, saved bf16) of `model.safetensors` at every REV.
Then: `python -m drafters.dflash.evalset measure --drafter-dir OUT`.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import mlx.core as mx

DRAFTER = "engine/models/smollm2_drafter"


def main() -> None:
    out, revs = Path(sys.argv[1]), sys.argv[2:]
    archive = subprocess.run(["git", "archive", revs[0], DRAFTER], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    directory = out / DRAFTER
    weights = []
    for rev in revs:
        blob = subprocess.run(["git", "show", f"{rev}:{DRAFTER}/model.safetensors"],
                              capture_output=True, check=True).stdout  # fmt: skip
        staged = out / f"{rev}.safetensors"
        staged.write_bytes(blob)
        weights.append(mx.load(str(staged)))
    mean = {
        k: (sum(w[k].astype(mx.float32) for w in weights) / len(weights)).astype(mx.bfloat16)
        for k in weights[0]
    }
    mx.save_safetensors(str(directory / "model.safetensors"), mean, metadata={"format": "mlx"})
    print(directory)


if __name__ == "__main__":
    main()
