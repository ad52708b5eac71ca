"""One model step, on the MLX thread: what a batched forward reads, computes and leaves behind.

- `runner`: `ModelRunner`, the whole step top to bottom (prefill chunks, one drafter forward,
  one verify forward, sampling and acceptance, one host sync, per-row rollback);
- `packed`: the packed verify forward (each row's own positions in one sequence);
- `kv_cache`: `RaggedKVCache`, per-row lengths and O(1) per-row rollback;
- `target`: `TargetAdapter`, an mlx-lm model whose forward also returns tapped features;
- `state_cache`, `recurrent`: hybrid targets' per-row recurrent state and its exact rollback;
- `sampling`, `logprobs`, `stopping`: the sampler, log-probabilities, stop conditions;
- `penalties`, `structured`: penalties and logit bias inside the sampler, grammar matchers;
- `feature_journal`: a step's tapped features, journalled once for every owner;
- `prefix_cache`: finished requests' KV kept under a byte budget for reuse;
- `row_padding`: CPU matmuls computed at a row count the BLAS runs faster;
- `speculative`: the single-request reference loop the engine is tested against.

Drafters and the scheduler may import from here (the lowest layer), never from `engine.http`
or the CLI.
"""
