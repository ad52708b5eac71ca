"""The model pair that ships with flashbatch, and the reproducible script that builds it.

`python -m engine.bundled.build` runs the stages (corpus split, tokenizer, target pretraining,
drafter data, drafter training, evaluation), each resumable. The exported weights live in
`engine/bundled/target/` and `engine/bundled/drafter/` once built.
"""
