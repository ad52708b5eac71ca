"""Where targets come from: GGUF files converted to mlx-lm directories, the named-model registry
and `pull`, and the resolution of a `--target` value (a directory, a `.gguf` file or a name) to
the mlx-lm directory the engine loads; `loading` loads a target (tapped for its drafter), a
drafter and a tokenizer from there. Drafters trained for registry models ship in `*_drafter/`."""
