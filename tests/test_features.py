"""The disk store of a training corpus's target features: equal to the features of each
sequence alone, resumable after a stop, and a fit on it equals a fit on in-memory features."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
from pathlib import Path

import numpy as np
import pytest

from drafters.dflash import features as feature_store
from drafters.dflash import train
from drafters.dflash.features import FeatureSidecar, FeatureStore, length_batches
from engine.models.loading import load_target_model
from engine.step.target import TargetAdapter

LAYER_IDS = [1, 4]


def _target(target_dir: Path) -> TargetAdapter:
    model, _ = load_target_model(target_dir)
    return TargetAdapter(model, LAYER_IDS)


def _corpus(vocab: int, lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).astype(np.int32) for n in lengths]


LENGTHS = [5, 40, 17, 3, 33, 40, 9, 26, 1, 12]


def test_length_batches_cover_every_sequence_once_within_the_budget():
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.integers(1, 300, size=200)] + [900]
    groups = length_batches(lengths, batch_tokens=512, max_rows=8)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) <= 8
        assert len(group) == 1 or len(group) * longest <= 512


def test_stored_features_equal_each_sequence_alone(qwen3_target_dir: Path, tmp_path: Path):
    target = _target(qwen3_target_dir)
    tokens = _corpus(target.vocab_size, LENGTHS)
    store = FeatureStore.build(target, tokens, tmp_path, "qwen3", batch_tokens=160, max_rows=4)
    assert len(store) == len(tokens)
    for i, seq in enumerate(tokens):
        alone = np.array(train.target_features(target, seq))
        np.testing.assert_allclose(np.array(store.get(i)), alone, rtol=1e-4, atol=1e-4)


def test_a_stopped_build_resumes_where_it_stopped(
    qwen3_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = _target(qwen3_target_dir)
    tokens = _corpus(target.vocab_size, LENGTHS * 4, seed=2)  # 40 sequences, 1 a batch
    written: list[list[int]] = []
    real_write = feature_store._write_batch

    def stop_after_20(target, tokens, members, offsets, data):
        if len(written) == 20:
            raise KeyboardInterrupt
        written.append(members)
        real_write(target, tokens, members, offsets, data)

    monkeypatch.setattr(feature_store, "_write_batch", stop_after_20)
    with pytest.raises(KeyboardInterrupt):
        FeatureStore.build(target, tokens, tmp_path, "qwen3", max_rows=1)
    directory = next(tmp_path.glob("features-*"))
    assert json.loads((directory / feature_store.PROGRESS_FILE).read_text())["batches"] == 16

    monkeypatch.setattr(feature_store, "_write_batch", real_write)
    computed: list[list[int]] = []

    def counting(target, tokens, members, offsets, data):
        computed.append(members)
        real_write(target, tokens, members, offsets, data)

    monkeypatch.setattr(feature_store, "_write_batch", counting)
    store = FeatureStore.build(target, tokens, tmp_path, "qwen3", max_rows=1)
    assert len(computed) == 40 - 16  # only what the stopped run had not counted
    for i, seq in enumerate(tokens):
        alone = np.array(train.target_features(target, seq))
        np.testing.assert_allclose(np.array(store.get(i)), alone, rtol=1e-4, atol=1e-4)
    computed.clear()
    FeatureStore.build(target, tokens, tmp_path, "qwen3", max_rows=1)
    assert computed == []  # a finished store is read, never recomputed


def test_a_store_whose_index_does_not_match_is_computed_again(
    qwen3_target_dir: Path, tmp_path: Path
):
    """The index is checked on reopening: a store that says it holds other shapes (written by
    other code under the same key) is computed again, never read as if it fit."""
    target = _target(qwen3_target_dir)
    tokens = _corpus(target.vocab_size, LENGTHS, seed=4)
    FeatureStore.build(target, tokens, tmp_path, "qwen3", max_rows=1)
    directory = next(tmp_path.glob("features-*"))
    index_path = directory / feature_store.INDEX_FILE
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "width": index["width"] // 2}))
    (directory / feature_store.DATA_FILE).write_bytes(b"\0" * 8)  # not this store's data
    store = FeatureStore.build(target, tokens, tmp_path, "qwen3", max_rows=1)
    assert json.loads(index_path.read_text()) == index
    for i, seq in enumerate(tokens):
        alone = np.array(train.target_features(target, seq))
        np.testing.assert_allclose(np.array(store.get(i)), alone, rtol=1e-4, atol=1e-4)


def test_a_store_copies_what_its_sidecar_holds_and_computes_only_the_rest(
    qwen3_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Sequences whose rows data generation kept (`FeatureSidecar`) are copied into a new store,
    not computed; the others are, in batches of their own; the sidecar's files go once the
    store is whole. A sidecar keyed by other taps is never read."""
    target = _target(qwen3_target_dir)
    tokens = _corpus(target.vocab_size, LENGTHS, seed=6)
    reference = FeatureStore.build(target, tokens, tmp_path / "ref", "qwen3", max_rows=1, top_k=4)
    # The target's folder or its registry name: the same sidecar files.
    kept = FeatureSidecar(tmp_path / "side", "models/qwen3", LAYER_IDS, 4)
    marked = {1, 4, 7}
    for i in marked:  # shifted, so a copied row is told from a computed one
        ids, logp = reference.top(i)
        kept.write(tokens[i], np.array(reference.get(i))[0] + 1000.0, ids, logp)
    other_taps = FeatureSidecar(tmp_path / "side", "qwen3", [0, 2], 4)
    other_taps.write(tokens[2], np.zeros((len(tokens[2]), reference.width)), *reference.top(2))
    computed: list[int] = []
    real_write = feature_store._write_batch

    def counting(target, tokens, members, *rest):
        computed.extend(members)
        real_write(target, tokens, members, *rest)

    monkeypatch.setattr(feature_store, "_write_batch", counting)
    sidecar = FeatureSidecar(tmp_path / "side", "qwen3", LAYER_IDS, 4)
    store = FeatureStore.build(target, tokens, tmp_path / "new", "qwen3", max_rows=1, top_k=4,
                               sidecar=sidecar)  # fmt: skip
    assert sorted(computed) == sorted(set(range(len(tokens))) - marked)
    for i in range(len(tokens)):
        shift = 1000.0 if i in marked else 0.0
        np.testing.assert_allclose(np.array(store.get(i)), np.array(reference.get(i)) + shift,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        np.testing.assert_array_equal(store.top(i)[0], reference.top(i)[0])
        np.testing.assert_allclose(store.top(i)[1], reference.top(i)[1], atol=1e-3)
    assert not any(sidecar.path_of(tokens[i]).exists() for i in marked)
    assert other_taps.path_of(tokens[2]).exists()  # not this store's: left alone
    progress = json.loads(next((tmp_path / "new").glob("features-*/progress.json")).read_text())
    assert sorted(progress["seeded"]) == sorted(marked)
    computed.clear()
    FeatureStore.build(target, tokens, tmp_path / "new", "qwen3", max_rows=1, top_k=4,
                       sidecar=sidecar)  # fmt: skip
    assert computed == []  # a whole store is read, seeded or not


def test_a_sidecar_refuses_rows_that_do_not_fit_its_tokens(tmp_path: Path):
    sidecar = FeatureSidecar(tmp_path, "qwen3", LAYER_IDS, 4)
    tokens = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match="sidecar rows"):
        sidecar.write(tokens, np.zeros((4, 8)), np.zeros((5, 4)), np.zeros((5, 4)))
    sidecar.write(tokens, np.zeros((5, 8)), np.zeros((5, 4)), np.zeros((5, 4)))
    assert sidecar.read(tokens, 8) is not None
    assert sidecar.read(tokens, 16) is None  # another store's width: not used


def test_another_corpus_gets_a_store_of_its_own(qwen3_target_dir: Path, tmp_path: Path):
    target = _target(qwen3_target_dir)
    first = FeatureStore.build(target, _corpus(target.vocab_size, LENGTHS), tmp_path, "qwen3")
    second = FeatureStore.build(
        target, _corpus(target.vocab_size, LENGTHS, seed=5), tmp_path, "qwen3"
    )
    assert first.directory != second.directory


def test_a_fit_on_the_store_equals_a_fit_on_features_in_memory(
    qwen3_target_dir: Path, tmp_path: Path
):
    target = _target(qwen3_target_dir)
    tokens = _corpus(target.vocab_size, [24, 30, 18, 27], seed=3)
    sequences = [train.TrainSequence(t, 6) for t in tokens]
    raw = json.loads((qwen3_target_dir / "config.json").read_text())
    drafter_config = train.drafter_config_for_target(
        raw, num_layers=1, block_size=4, target_layer_ids=LAYER_IDS
    )
    common = dict(steps=8, lr=1e-2, num_anchors=8, checkpoint_every=0, progress=False,
                  log_every=0, seed=3)  # fmt: skip
    in_memory = train.train(
        target, sequences, train.TrainConfig(out_dir=str(tmp_path / "a"), **common),
        drafter_config,
    )  # fmt: skip
    on_disk = train.train(
        target, sequences,
        train.TrainConfig(out_dir=str(tmp_path / "b"), feature_store_dir=str(tmp_path), **common),
        drafter_config,
    )  # fmt: skip
    assert list(tmp_path.glob("features-*"))
    np.testing.assert_allclose(
        [loss for _, loss, _ in on_disk.history],
        [loss for _, loss, _ in in_memory.history],
        rtol=1e-3,
    )


@pytest.mark.parametrize("vocab", [49152, 1000, 300])  # whole blocks, a padded last one, few
def test_top_k_ids_are_the_k_largest_and_log_probs_are_normalised_over_the_vocabulary(vocab):
    """The block-wise top-k (`top_k_ids`) against a full sort, with ties (rounded logits) and
    the largest entries crowded into one block; log-probs against numpy's log-softmax."""
    import mlx.core as mx

    rng = np.random.default_rng(vocab)
    logits = np.round(rng.normal(size=(3, 5, vocab)) * 3, 1).astype(np.float32)
    logits[0, 0, 128:136] = 50.0 + np.arange(8)  # the top 8 in one block of 64
    k = 8
    ids = np.array(feature_store.top_k_ids(mx.array(logits), k))
    kth = -np.sort(-logits, axis=-1)[..., k - 1 : k]
    chosen = np.take_along_axis(logits, ids, axis=-1)
    assert (
        ids.shape == (3, 5, k) and (np.sort(ids, -1)[..., 1:] != np.sort(ids, -1)[..., :-1]).all()
    )
    assert (chosen >= kth).all()  # k distinct entries, none below the k-th largest
    assert sorted(ids[0, 0].tolist()) == list(range(128, 136))

    top_ids, top_logp = feature_store.top_k_logprobs(mx.array(logits), k)
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(top_logp, np.take_along_axis(logp, top_ids, -1), atol=1e-4)
    np.testing.assert_allclose(top_logp, -np.sort(-logp, axis=-1)[..., :k], atol=1e-4)
    assert (np.diff(top_logp, axis=-1) <= 0).all()  # descending
