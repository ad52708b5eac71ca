"""Backend and process tuning: the one place for choices that depend on the MLX backend
(CPU, Metal, CUDA) or on the process, so none of them can make another backend worse.

- `platform`: preloads an optimized BLAS before `mlx` is imported (Linux), backend facts;
- `blas_threads`: OpenBLAS thread control per forward;
- `cpu_kernels`, `cpu_layers`: attention and SwiGLU on a vectorised exp for the CPU backend,
  and their installation in llama/qwen2/qwen3 layers;
- `tuning`: which of those an engine turns on;
- `process_tuning`: malloc, GIL switch interval, garbage-collector freeze.

This package's `__init__` must stay free of imports: `engine/__init__.py` imports
`engine.backend.platform` before anything imports `mlx`.
"""
