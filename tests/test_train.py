"""DFlash drafter training: mask, blocks and labels, training/inference agreement, the training
loop (loss goes down, checkpoints load, resume continues exactly), data generation and CLI."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import shutil
from pathlib import Path

import factories
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from drafters.dflash import train
from drafters.dflash.checkpoint import load_dflash_model, save_dflash_model
from drafters.dflash.drafter import DFlashDrafter
from drafters.dflash.model import DFlashDraftModel
from engine.models.loading import load_target_model
from engine.step.target import TargetAdapter

PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Config:\n"]
LAYER_IDS = [1, 4]


# ------------------------------------------------------------------ pure pieces
def test_mask_two_blocks_by_hand():
    # S=6, anchors [1, 3], B=3: block 0 sees context key 0 only (strictly before anchor 1),
    # block 1 sees keys 0..2; each sees all of its own block and none of the other.
    expected = np.array(
        [
            # context 0..5     block 0   block 1
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(train.training_attention_mask(6, [1, 3], 3), expected)


def test_mask_anchor_zero_and_padding_block():
    # Anchor 0 sees no context; an invalid block sees only itself (so softmax stays finite).
    expected = np.array(
        [
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    got = train.training_attention_mask(4, [0, 2], 2, valid=[True, False])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("valid", [None, [True, False, True]])
def test_block_row_mask_is_the_full_mask_without_other_blocks(valid):
    seq_len, anchors, b = 9, [0, 4, 7], 4
    full = train.training_attention_mask(seq_len, anchors, b, valid)
    rows = train.block_row_mask(seq_len, anchors, b, valid)
    assert rows.shape == (3, 1, b, seq_len + b)
    for n in range(3):
        block_rows = full[n * b : (n + 1) * b]
        own = slice(seq_len + n * b, seq_len + (n + 1) * b)
        np.testing.assert_array_equal(rows[n, 0, :, :seq_len], block_rows[:, :seq_len])
        np.testing.assert_array_equal(rows[n, 0, :, seq_len:], block_rows[:, own])
        assert block_rows[:, seq_len:].sum() == b * b  # nothing outside its own block


def test_blocks_labels_and_weights():
    tokens = np.array([10, 11, 12, 13, 14, 15], dtype=np.int32)
    blocks = train.make_blocks(tokens, np.array([1, 4]), block_size=3, mask_token_id=99, gamma=2.0)
    np.testing.assert_array_equal(blocks.block_ids, [[11, 99, 99], [14, 99, 99]])
    # Row j predicts x_{a+j}; anchor 4's second row (position 6) lies past the end.
    np.testing.assert_array_equal(blocks.labels, [[12, 13], [15, 0]])
    np.testing.assert_allclose(blocks.weights, [[1.0, np.exp(-0.5)], [1.0, 0.0]], rtol=1e-6)


def test_sample_anchors():
    rng = np.random.default_rng(0)
    anchors = train.sample_anchors(20, 5, rng, first=3)
    assert len(anchors) == 5 and len(set(anchors.tolist())) == 5
    assert list(anchors) == sorted(anchors) and 3 <= anchors.min() and anchors.max() <= 18
    assert train.sample_anchors(5, 64, rng).tolist() == [0, 1, 2, 3]  # all candidates
    assert [train.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert train.default_gamma(23) == pytest.approx(10.0)


def test_drafter_config_for_target(qwen3_target_dir: Path):
    raw = json.loads((qwen3_target_dir / "config.json").read_text())
    config = train.drafter_config_for_target(raw, num_layers=2, block_size=8)
    assert config.target_layer_ids == [1, 3]  # default_target_layer_ids(6, 2)
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (64, 16, 2)
    assert config.mask_token_id == raw["vocab_size"] - 1 and config.num_target_layers == 6


# ------------------------------------------------------------------ training == inference
def test_training_forward_matches_inference(qwen3_target_dir: Path, vocab_size: int, tmp_path):
    model, _ = load_target_model(qwen3_target_dir)
    target = TargetAdapter(model, LAYER_IDS)
    config = factories.drafter_config(vocab_size, block_size=6, target_layer_ids=LAYER_IDS)
    mx.random.seed(5)
    draft = DFlashDraftModel(config)  # default init: larger weights than training's N(0, 0.02)
    save_dflash_model(draft, tmp_path)
    tokens = np.random.default_rng(1).integers(3, vocab_size, size=24).astype(np.int32)
    anchors = np.array([0, 5, 11, 23])  # 23: the block runs past the sequence end
    features = train.target_features(target, tokens)
    blocks = train.make_blocks(tokens, anchors, 6, config.mask_token_id, gamma=4.0)
    embeddings = target.embed(mx.array(blocks.block_ids))
    mask = mx.array(train.block_row_mask(len(tokens), anchors, 6))
    trained = train.block_hidden_states(
        draft, features, embeddings, mx.array(anchors, dtype=mx.int32), mask
    )
    trained_tokens = mx.argmax(target.unembed(trained[:, 1:]), axis=-1)

    drafter = DFlashDrafter(load_dflash_model(tmp_path), target)  # fused inference path
    for n, a in enumerate(anchors.tolist()):
        context = features[:, :a] if a else None
        hidden = drafter.model(embeddings[n : n + 1], drafter.model.make_cache(1), context)
        np.testing.assert_allclose(np.array(hidden[0]), np.array(trained[n]), atol=1e-4)
        session = drafter.open()
        drafter.commit(session, features[0, :a])
        proposal = drafter.propose([session], [int(tokens[a])], [5])
        drafter.close(session)
        assert proposal.tokens[0].tolist() == trained_tokens[n].tolist()


def test_a_training_step_on_cpu_kernels_equals_the_stock_step(
    qwen3_target_dir: Path, vocab_size: int, monkeypatch
):
    """On the CPU backend training runs attention softmax and SwiGLU on a vectorised exp
    (`train.use_cpu_kernels`): the same target features, loss and gradients as MLX's own."""
    monkeypatch.setattr("engine.backend.cpu_kernels.wanted", lambda: True)
    config = factories.drafter_config(vocab_size, block_size=6, target_layer_ids=LAYER_IDS)
    tokens = np.random.default_rng(2).integers(3, vocab_size, size=40).astype(np.int32)
    anchors = np.array([0, 7, 19, 30])
    results = []
    for kernels in (False, True):
        target = TargetAdapter(load_target_model(qwen3_target_dir)[0], LAYER_IDS)
        mx.random.seed(5)
        draft = DFlashDraftModel(config)
        if kernels:
            train.use_cpu_kernels(target, draft)
            assert target.cpu_kernels and draft.layers[0].mlp.cpu_kernels
        features = train.target_features(target, tokens)
        blocks = train.make_blocks(tokens, anchors, 6, config.mask_token_id, gamma=4.0)
        loss_and_grad = nn.value_and_grad(
            draft, lambda f, b, d=draft, t=target: train.block_loss(d, t, f, b)
        )
        (loss, _), grads = loss_and_grad(features, blocks)
        results.append((features, loss.item(), dict(tree_flatten(grads))))
    (stock_features, stock_loss, stock_grads), (features, loss, grads) = results
    assert mx.allclose(features, stock_features, rtol=1e-4, atol=1e-4).item()
    assert abs(loss - stock_loss) < 1e-4 * abs(stock_loss)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert mx.allclose(grad, stock_grads[name], rtol=1e-3, atol=1e-6).item(), name


# ------------------------------------------------------------------ data and training loop
@pytest.fixture(scope="module")
def data_file(qwen3_target_dir: Path, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train") / "data.jsonl"
    model, tokenizer = load_target_model(qwen3_target_dir)
    written = train.generate_data(
        TargetAdapter(model, []), tokenizer, PROMPTS[:2], path, max_tokens=40
    )
    assert written == 2
    return path


def test_generate_data_resumes(qwen3_target_dir: Path, data_file: Path, tmp_path):
    path = tmp_path / "data.jsonl"
    shutil.copy(data_file, path)
    with path.open("a") as f:
        f.write('{"prompt": "torn')  # an interrupted write
    model, tokenizer = load_target_model(qwen3_target_dir)
    written = train.generate_data(TargetAdapter(model, []), tokenizer, PROMPTS, path, 40)
    assert written == 1  # only the prompt not yet in the file
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for record in records:
        ids = train.encode_prompt(tokenizer, record["prompt"])
        assert record["tokens"][: record["prompt_tokens"]] == ids
        assert len(record["tokens"]) > len(ids)


def _target(target_dir: Path) -> TargetAdapter:
    model, _ = load_target_model(target_dir)
    return TargetAdapter(model, LAYER_IDS)


def _train_config(out_dir: Path, **overrides) -> train.TrainConfig:
    fields = dict(
        steps=40, lr=1e-2, num_anchors=32, checkpoint_every=20, out_dir=str(out_dir),
        progress=False, log_every=0, seed=3,
    )  # fmt: skip
    fields.update(overrides)
    return train.TrainConfig(**fields)


def _drafter_config(target_dir: Path):
    raw = json.loads((target_dir / "config.json").read_text())
    return train.drafter_config_for_target(
        raw, num_layers=1, block_size=4, target_layer_ids=LAYER_IDS
    )


@pytest.fixture(scope="module")
def trained(qwen3_target_dir: Path, data_file: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    target = _target(qwen3_target_dir)
    sequences = train.load_sequences(data_file)
    config = _train_config(out)
    before = train.evaluate_loss(
        train.init_drafter(_drafter_config(qwen3_target_dir), config.seed), target, sequences
    )
    result = train.train(target, sequences, config, _drafter_config(qwen3_target_dir))
    after = train.evaluate_loss(result.model, target, sequences)
    return result, out, before, after


def test_training_lowers_loss(trained):
    result, _, before, after = trained
    losses = [loss for _, loss, _ in result.history]
    assert result.step == 40 and len(losses) == 40
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert after[0] < before[0] - 0.5 and after[1] > before[1]


def test_checkpoint_loads(trained):
    result, out, _, _ = trained
    loaded = load_dflash_model(out)
    loaded_config = {k: v for k, v in loaded.config.to_dict().items() if k != "torch_dtype"}
    assert loaded_config == result.model.config.to_dict()
    want = dict(tree_flatten(result.model.parameters()))
    for name, value in tree_flatten(loaded.parameters()):
        np.testing.assert_array_equal(np.array(value), np.array(want[name]))
    assert json.loads((out / train.STATE_FILE).read_text())["step"] == 40


def test_resume_continues_at_saved_step(
    trained, qwen3_target_dir: Path, data_file: Path, tmp_path, monkeypatch
):
    uninterrupted, _, _, _ = trained
    sequences = train.load_sequences(data_file)
    config = _train_config(tmp_path)
    real_save = train.save_checkpoint

    def save_then_crash(model, optimizer, step, cfg, draft_vocab=None):
        real_save(model, optimizer, step, cfg, draft_vocab)
        raise KeyboardInterrupt  # the run dies right after its first checkpoint

    monkeypatch.setattr(train, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train.train(_target(qwen3_target_dir), sequences, config, _drafter_config(qwen3_target_dir))
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    assert json.loads((tmp_path / train.STATE_FILE).read_text())["step"] == 20

    config.resume = True
    resumed = train.train(_target(qwen3_target_dir), sequences, config)
    assert resumed.history[0][0] == 21 and resumed.step == 40
    # Same data stream and optimizer state: the same run as the uninterrupted one.
    np.testing.assert_allclose(
        [loss for _, loss, _ in resumed.history],
        [loss for _, loss, _ in uninterrupted.history[20:]],
        rtol=1e-4,
    )


def test_feature_cache_changes_nothing_but_time(
    trained, qwen3_target_dir: Path, data_file: Path, tmp_path
):
    cached, _, _, _ = trained  # the default config keeps every sequence's features
    sequences = train.load_sequences(data_file)
    config = _train_config(tmp_path, feature_cache_mb=0)  # same schedule: all 40 steps
    uncached = train.train(
        _target(qwen3_target_dir), sequences, config, _drafter_config(qwen3_target_dir)
    )
    np.testing.assert_allclose(
        [loss for _, loss, _ in uncached.history],
        [loss for _, loss, _ in cached.history],
        rtol=1e-5,
    )


def test_feature_cache_keeps_within_budget(qwen3_target_dir: Path, data_file: Path):
    sequences = train.load_sequences(data_file)
    target = _target(qwen3_target_dir)
    one = train.target_features(target, sequences[0].tokens).nbytes
    cache = train.FeatureCache(target, budget_bytes=one)
    first = cache.get(0, sequences[0].tokens)
    assert cache.get(0, sequences[0].tokens) is first  # kept: the second call is free
    second = cache.get(1, sequences[1].tokens)
    assert cache.get(1, sequences[1].tokens) is not second  # over budget: recomputed
    np.testing.assert_array_equal(np.array(cache.get(1, sequences[1].tokens)), np.array(second))
    assert cache.used == one


def test_evaluate_tau(trained, qwen3_target_dir: Path):
    _, out, _, _ = trained
    result = train.evaluate_tau(qwen3_target_dir, out, PROMPTS[:2], max_tokens=24)
    assert result.steps > 0 and 1.0 <= result.tau <= 4.0  # block 4: at most 3 drafts + bonus
    assert len(result.per_prompt) == 2


def test_cli_data_fit_eval(qwen3_target_dir: Path, tmp_path):
    from engine.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    data, out = tmp_path / "data.jsonl", tmp_path / "drafter"
    common = ["--target", str(qwen3_target_dir)]
    assert main(["train-drafter", "data", *common, "--prompts", str(prompts),
                 "--out", str(data), "--max-tokens", "16"]) == 0  # fmt: skip
    fit = ["train-drafter", "fit", *common, "--data", str(data), "--out", str(out),
           "--layers", "1", "--block-size", "4", "--target-layer-ids", "1,4",
           "--steps", "4", "--checkpoint-every", "2"]  # fmt: skip
    assert main(fit) == 0
    assert main([*fit, "--steps", "6", "--resume", "--feature-cache-mb", "0"]) == 0
    state = json.loads((out / train.STATE_FILE).read_text())
    assert state["step"] == 6 and state["config"]["feature_cache_mb"] == 0
    assert main(["train-drafter", "eval", *common, "--drafter", str(out),
                 "--prompts", str(prompts), "--max-tokens", "8"]) == 0  # fmt: skip
