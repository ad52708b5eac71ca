"""The draft vocabulary (`drafters/dflash/vocab.py`): chosen by frequency, stored as EAGLE-3's
`d2t`, the head's rows taken exactly, proposals restricted to it, training over it, and decoding
with it lossless (on the toy pair and on the bundled pair)."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from drafters.dflash import train
from drafters.dflash.checkpoint import load_dflash_model, load_drafter, save_dflash_model
from drafters.dflash.vocab import DraftHead, choose_draft_vocab, read_draft_vocab, to_d2t
from engine.models.loading import load_pair, load_target_model
from engine.step.sampling import SamplingParams
from engine.step.speculative import generate
from engine.step.target import TargetAdapter

LAYER_IDS = [1, 4]


def test_choose_takes_the_most_frequent_ids_then_the_lowest():
    data = [[7, 7, 7, 9, 9, 3], [9, 7, 11]]
    assert choose_draft_vocab(data, 2, 20).tolist() == [7, 9]
    # 7, 9 by count, then 3 and 11 (counted once each); filler only past what the data holds.
    assert choose_draft_vocab(data, 4, 20).tolist() == [3, 7, 9, 11]
    assert choose_draft_vocab(data, 6, 20).tolist() == [0, 1, 3, 7, 9, 11]
    with pytest.raises(ValueError):
        choose_draft_vocab(data, 21, 20)


def test_d2t_round_trip_leaves_the_z_lab_weights_loadable(drafter_dir: Path, tmp_path):
    model = load_dflash_model(drafter_dir)
    ids = np.array([0, 5, 6, 40, 41, 200], dtype=np.int32)
    save_dflash_model(model, tmp_path, draft_vocab=ids)
    offsets = mx.load(str(tmp_path / "model.safetensors"))["d2t"]
    assert offsets.tolist() == [0, 4, 4, 37, 37, 195]  # target id = index + d2t[index]
    assert read_draft_vocab(tmp_path).tolist() == ids.tolist()
    load_dflash_model(tmp_path)  # strict: d2t is not a weight
    assert read_draft_vocab(drafter_dir) is None


@pytest.mark.parametrize("quantized", [False, True])
def test_head_rows_are_the_heads_own_columns(qwen3_target_dir: Path, quantized: bool):
    model, _ = load_target_model(qwen3_target_dir)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    target = TargetAdapter(model, [])
    hidden = mx.random.normal((3, 5, target.hidden_size), key=mx.random.key(0))
    ids = mx.array([2, 9, 10, 77, target.vocab_size - 1], dtype=mx.int32)
    full = target.unembed(hidden)[..., ids]
    np.testing.assert_allclose(
        np.array(hidden @ target.head_rows(ids).T), np.array(full), rtol=1e-4, atol=1e-4
    )


def _drafter_with_vocab(drafter_dir: Path, ids: np.ndarray, tmp_path: Path) -> Path:
    out = tmp_path / "with-vocab"
    shutil.copytree(drafter_dir, out)
    mx.save_safetensors(str(out / "draft_vocab.safetensors"), {"d2t": to_d2t(ids)})
    return out


def test_proposals_are_the_best_tokens_of_the_draft_vocabulary(
    qwen3_target_dir: Path, drafter_dir: Path, vocab_size: int, tmp_path
):
    full = load_pair(qwen3_target_dir, drafter_dir)
    target = full.target
    tokens = np.random.default_rng(2).integers(3, vocab_size, size=20).astype(np.int32)
    _, features = target(mx.array(tokens)[None])

    def propose(drafter):
        session = drafter.open()
        drafter.commit(session, features[0, :12])
        out = drafter.propose([session], [int(tokens[12])], [5])
        drafter.close(session)
        return out.tokens[0].tolist()

    free = propose(full.drafter)
    everything = np.arange(vocab_size, dtype=np.int32)
    whole = load_drafter(_drafter_with_vocab(drafter_dir, everything, tmp_path), target)
    assert propose(whole) == free
    # A vocabulary without the full head's choices: each proposal is the best of what it has.
    without = np.setdiff1d(everything, free).astype(np.int32)
    shutil.rmtree(tmp_path / "with-vocab")
    restricted = load_drafter(_drafter_with_vocab(drafter_dir, without, tmp_path), target)
    drafted = propose(restricted)
    assert set(drafted) <= set(without.tolist())
    block = [[int(tokens[12])] + [restricted.mask_token_id] * 5]
    cache = restricted.model.make_cache(1)
    hidden = restricted.model(target.embed(mx.array(block)), cache, features[:, :12])
    logits = np.array(target.unembed(hidden[0, 1:6]))
    assert drafted == [int(without[np.argmax(row[without])]) for row in logits]


def test_decoding_with_a_draft_vocabulary_is_lossless(
    qwen3_target_dir: Path, drafter_dir: Path, vocab_size: int, tmp_path
):
    half = np.arange(0, vocab_size, 2, dtype=np.int32)  # the odd ids can never be drafted
    pair = load_pair(qwen3_target_dir, _drafter_with_vocab(drafter_dir, half, tmp_path))
    plain = load_pair(qwen3_target_dir)
    prompt = [5, 17, 99, 4, 23, 8]
    for temperature, seed in ((0.0, 0), (1.0, 7)):
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=seed,
                                num_speculative_tokens=4)  # fmt: skip
        drafted = generate(pair.target, prompt, params, drafter=pair.drafter)
        if temperature == 0.0:
            off = SamplingParams(max_tokens=24, num_speculative_tokens=0)
            assert drafted.token_ids == generate(plain.target, prompt, off).token_ids
        assert all(t < vocab_size for t in drafted.token_ids)


def test_training_over_a_draft_vocabulary(qwen3_target_dir: Path, tmp_path):
    model, tokenizer = load_target_model(qwen3_target_dir)
    data = tmp_path / "data.jsonl"
    train.generate_data(TargetAdapter(model, []), tokenizer, ["def f(x):", "import os\n"], data, 40)
    sequences = train.load_sequences(data)
    target = TargetAdapter(model, LAYER_IDS)
    raw = json.loads((qwen3_target_dir / "config.json").read_text())
    drafter_config = train.drafter_config_for_target(
        raw, num_layers=1, block_size=4, target_layer_ids=LAYER_IDS
    )
    config = train.TrainConfig(steps=30, lr=1e-2, num_anchors=32, checkpoint_every=15,
                               out_dir=str(tmp_path / "drafter"), progress=False, log_every=0,
                               seed=3, draft_vocab_size=64)  # fmt: skip
    result = train.train(target, sequences, config, drafter_config)
    losses = [loss for _, loss, _ in result.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    ids = read_draft_vocab(tmp_path / "drafter")
    assert ids is not None and len(ids) == 64
    seen = {int(t) for s in sequences for t in s.tokens}
    assert seen <= set(ids.tolist()) or len(seen) > 64  # the data's own tokens come first
    head = DraftHead(target, ids)
    outside = next(t for t in range(target.vocab_size) if t not in set(ids.tolist()))
    labels = np.array([[ids[3], outside]], dtype=np.int32)
    blocks = train.BlockBatch(np.zeros((1, 3), np.int32), np.zeros(1), labels,
                              np.ones((1, 2), np.float32))  # fmt: skip
    restricted = train.restrict_labels(blocks, head)
    assert restricted.labels[0, 0] == 3
    assert restricted.weights[0].tolist() == [1.0, 0.0]  # outside: weighs nothing
    # Resuming keeps the vocabulary the run chose, whatever the config asks now.
    config.steps, config.resume, config.draft_vocab_size = 32, True, 16
    train.train(target, sequences, config)
    assert read_draft_vocab(tmp_path / "drafter").tolist() == ids.tolist()
