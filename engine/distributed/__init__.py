"""Distributed mode: one target sharded over MLX's own distributed backend.

All ranks are started by `mlx.launch` (ring, jaccl, MPI or NCCL). Rank 0 runs the HTTP server,
the scheduler, the drafters and the metrics; every other rank is a follower that runs the same
model runner on its shard of the target, driven by rank 0's calls (`mirror`), with rank 0's
decisions (drafts, sampled tokens) shared inside the step's graph (`group.Decisions`).

- `group`: the process group, byte broadcast and the in-graph decision sharing.
- `sharding`: tensor parallel (mlx-lm's `shard()`) and pipeline parallel (layers split).
- `mirror`: rank 0's runner proxy, which sends every call that runs a forward to the followers.
- `follower`: what a rank other than 0 runs: the stand-in drafter and the call loop.
"""
