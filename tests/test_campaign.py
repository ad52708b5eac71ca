"""The training campaign: repository checkpoint round trip and resume, the shard cursor, the
cheaper losses against a plain reference computation, and the warm start (tiny real models)."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import shutil
from pathlib import Path

import factories
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from drafters.dflash import campaign, campaign_state, keep_gate
from drafters.dflash.campaign_state import Cursor, Recipe
from drafters.dflash.card import tau_projection, write_card
from drafters.dflash.features import FeatureStore
from drafters.dflash.levers import (
    greedy_chain_labels,
    lever_batch,
    lever_loss,
    sample_negatives,
)
from drafters.dflash.train import (
    TrainSequence,
    init_drafter,
    make_blocks,
    sample_anchors,
    shared_prefix_lengths,
)
from drafters.dflash.vocab import DraftHead
from drafters.dflash.warm_start import warm_start
from engine.bundled.pair import bundled_paths
from engine.models.loading import load_target_model
from engine.step.target import TargetAdapter


# ------------------------------------------------------------------ cursor and shards
def test_cursor_advances_through_passes_and_shards_then_wraps():
    cursor = Cursor()
    changed = [cursor.advance(4, shard_size=8, num_shards=2, passes=2) for _ in range(8)]
    # 2 steps a pass, 2 passes a shard: shard changes after steps 4 and 8 (the second wraps)
    assert changed == [False, False, False, True, False, False, False, True]
    assert (cursor.shard, cursor.pass_, cursor.position, cursor.wraps) == (0, 0, 0, 1)
    cursor = Cursor()
    cursor.advance(4, 8, 2, 2)
    assert (cursor.shard, cursor.pass_, cursor.position) == (0, 0, 4)
    cursor.advance(4, 8, 2, 2)
    assert (cursor.shard, cursor.pass_, cursor.position) == (0, 1, 0)
    cursor.advance(3, 3, 2, 1)  # a short last batch still finishes the pass
    assert (cursor.shard, cursor.pass_, cursor.position, cursor.wraps) == (1, 0, 0, 0)


def test_a_detour_over_fresh_shards_runs_to_the_corpus_end_then_goes_back():
    cursor = Cursor(shard=1, pass_=1, position=2, wraps=2)  # half through shard 1
    cursor.visit_fresh(3)
    assert (cursor.shard, cursor.pass_, cursor.position, cursor.return_to) == (3, 0, 0, 1)
    assert cursor.advance(4, 4, 5, 1) and (cursor.shard, cursor.return_to) == (4, 1)
    assert cursor.advance(4, 4, 5, 1)
    # back to the start of the shard it left, in the same wrap
    assert (cursor.shard, cursor.pass_, cursor.position) == (1, 0, 0)
    assert (cursor.return_to, cursor.wraps) == (-1, 2)
    cursor.visit_fresh(2)  # the fresh records are in the next shard: no detour
    assert (cursor.shard, cursor.return_to) == (1, -1)
    cursor.visit_fresh(2, now=True)  # unless the shard it is on must not be finished first
    assert (cursor.shard, cursor.return_to) == (2, 1)


def test_a_fresh_detour_skips_a_shard_of_mostly_trained_records_unless_it_is_the_last():
    shards = campaign.shard_slices(40, 8)  # 0-8, ..., 32-40
    assert campaign.fresh_shard(shards, 16) == 2  # shard 2 wholly new
    assert campaign.fresh_shard(shards, 20) == 2  # half new: trained now
    assert campaign.fresh_shard(shards, 21) == 3  # 3 of 8 new: they wait for the normal order
    assert campaign.fresh_shard(shards, 37) == 4  # the last shard: its new records go now


def test_shards_cover_the_corpus_once_and_absorb_a_small_tail():
    shards = campaign.shard_slices(1100, 512)
    assert [len(s) for s in shards] == [512, 588]  # a 76-record tail joins the last shard
    assert [i for s in shards for i in s] == list(range(1100))
    assert [len(s) for s in campaign.shard_slices(1300, 512)] == [512, 512, 276]


def test_learning_rate_rewarms_after_a_resume_and_decays_by_global_step():
    r = Recipe(lr=1e-3, warmup_steps=100, rewarm_steps=10, horizon_steps=1000)
    assert campaign.learning_rate(r, 0, 0) == pytest.approx(1e-5)
    assert campaign.learning_rate(r, 500, 0, resumed=True) < campaign.learning_rate(r, 500, 9, True)
    assert campaign.learning_rate(r, 5000, 50, True) == pytest.approx(1e-4)  # the floor


# ------------------------------------------------------------------ tiny real pair
@pytest.fixture(scope="module")
def tiny(qwen3_target_dir: Path):
    model, _ = load_target_model(qwen3_target_dir)
    target = TargetAdapter(model, [1, 4])
    return target, qwen3_target_dir


def _records(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "key": f"r{i}",
            "prompt_tokens": 6,
            "tokens": rng.integers(3, vocab, size=int(rng.integers(20, 40))).tolist(),
        }
        for i in range(n)
    ]


def _tiny_recipe(**overrides) -> Recipe:
    fields = dict(
        layers=2,
        block_size=4,
        mask_token_id=2,
        draft_vocab=128,
        num_anchors=6,
        batch_size=2,
        shard_records=4,
        passes_per_shard=1,
        top_k=4,
        warmup_steps=2,
        rewarm_steps=1,
        candidates=True,
        negatives=16,
        distill=0.5,
    )
    fields.update(overrides)
    return Recipe(**fields)


def _sitting_args(target_dir: Path, drafter_dir: Path, tmp_path: Path, corpus, **overrides):
    """`run_sitting` keywords for a tiny test campaign: no timed checkpoints or held-out
    measures mid-sitting, a per-test feature cache, the given corpus."""
    fields = dict(
        target_name=str(target_dir),
        drafter_dir=drafter_dir,
        minutes=None,
        checkpoint_minutes=1e9,
        heldout_every=0,
        command="test",
        cache_root=tmp_path / "cache",
        corpus=corpus,
    )
    fields.update(overrides)
    return fields


def _weights(directory: Path) -> dict[str, np.ndarray]:
    tensors = mx.load(str(directory / campaign_state.WEIGHTS_FILE))
    return {k: np.array(v.astype(mx.float32)) for k, v in tensors.items()}


def test_sitting_checkpoints_into_the_directory_and_the_next_one_resumes(tiny, tmp_path):
    target, target_dir = tiny
    vocab = target.vocab_size
    corpus = (_records(10, vocab), _records(2, vocab, seed=1))
    drafter_dir = tmp_path / "drafter"
    kwargs = _sitting_args(target_dir, drafter_dir, tmp_path, corpus)
    first = campaign.run_sitting(recipe=_tiny_recipe(), max_steps=3, **kwargs)
    assert first["steps"] == 3 and first["labels"] > 0
    assert (first["corpus_records"], first["heldout_records"]) == (10, 2)
    state = campaign_state.read_state(drafter_dir)
    # 10 train records in shards of 4, 4 and 2, one pass each; 2 records a step
    assert state.step == 3 and state.sequences_seen == 6
    assert (state.cursor.shard, state.cursor.position) == (1, 2)
    saved = _weights(drafter_dir)
    assert all(v.dtype == np.float32 for v in saved.values())
    raw = mx.load(str(drafter_dir / campaign_state.WEIGHTS_FILE))
    assert {v.dtype for v in raw.values()} == {mx.bfloat16}
    assert "d2t" in mx.load(str(drafter_dir / campaign_state.VOCAB_FILE))

    model, loaded, draft_vocab = campaign_state.load_checkpoint(drafter_dir)
    assert loaded.to_dict() == state.to_dict()
    assert len(draft_vocab) == 128
    for name, value in tree_flatten(model.parameters()):
        np.testing.assert_array_equal(np.array(value), saved[name])
    assert not list(drafter_dir.rglob("*.tmp")), "temporary files are renamed or removed"

    second = campaign.run_sitting(recipe=None, max_steps=4, **kwargs)
    state = campaign_state.read_state(drafter_dir)
    assert second["resumed"] and second["step_start"] == 3 and state.step == 7
    # shard 1 ends at step 4, shard 2 at step 5 (wrap), shard 0 at step 7
    assert (state.cursor.shard, state.cursor.position, state.cursor.wraps) == (1, 0, 1)
    sittings = json.loads((drafter_dir / campaign_state.SITTINGS_FILE).read_text())
    assert [s["steps"] for s in sittings] == [3, 4]
    assert state.recipe == _tiny_recipe()

    # a later sitting may retune how it optimises (recorded), never the model or the data cut
    third = campaign.run_sitting(recipe=None, max_steps=1, retune={"lr": 5e-4, "gamma": 1.5},
                                 **kwargs)  # fmt: skip
    assert third["retuned"] == {"lr": [1e-3, 5e-4], "gamma": [0.0, 1.5]}
    state = campaign_state.read_state(drafter_dir)
    assert (state.recipe.lr, state.recipe.gamma, state.step) == (5e-4, 1.5, 8)
    with pytest.raises(ValueError, match="keeps block_size"):
        campaign.run_sitting(recipe=None, max_steps=1, retune={"block_size": 8}, **kwargs)
    assert campaign_state.read_state(drafter_dir).step == 8


def _ten_record_campaign(tiny, tmp_path, steps: int):
    """A tiny campaign on 10 train records (shards of 4, 4 and 2, one pass, 2 records a step)
    after `steps` steps: (its old records, held-out records, drafter dir, sitting keywords)."""
    target, target_dir = tiny
    old, held_out = _records(10, target.vocab_size), _records(2, target.vocab_size, seed=1)
    drafter_dir = tmp_path / "drafter"
    kwargs = _sitting_args(target_dir, drafter_dir, tmp_path, (old, held_out))
    campaign.run_sitting(recipe=_tiny_recipe(), max_steps=steps, **kwargs)
    return old, held_out, drafter_dir, kwargs


def test_a_grown_corpus_trains_its_fresh_shards_first_then_goes_back(tiny, tmp_path):
    old, held_out, drafter_dir, kwargs = _ten_record_campaign(tiny, tmp_path, steps=6)
    vocab = tiny[0].vocab_size
    state = campaign_state.read_state(drafter_dir)
    # wrapped once, half through shard 0
    assert (state.cursor.shard, state.cursor.position, state.cursor.wraps) == (0, 2, 1)
    assert state.records_reached == 10

    # 8 new records: shards 0-4, 4-8, 8-12, 12-16, 16-18; record 10, the first new, is in shard 2
    kwargs["corpus"] = (old + _records(8, vocab, seed=2), held_out)
    campaign.run_sitting(recipe=None, max_steps=3, **kwargs)  # shard 2, half of shard 3
    state = campaign_state.read_state(drafter_dir)
    assert (state.cursor.shard, state.cursor.position, state.cursor.return_to) == (3, 2, 0)
    assert state.records_reached == 16
    card = write_card(drafter_dir, "tiny").read_text()
    assert "on a detour over the fresh shards before going back to shard 0" in card
    # a sitting that resumes mid-detour finishes shard 3, then shard 4, then goes back to the
    # start of shard 0
    campaign.run_sitting(recipe=None, max_steps=3, **kwargs)
    state = campaign_state.read_state(drafter_dir)
    assert (state.cursor.shard, state.cursor.position, state.cursor.wraps) == (0, 2, 1)
    assert (state.cursor.return_to, state.records_reached) == (-1, 18)


def test_fresh_only_trains_the_new_records_and_stops(tiny, tmp_path):
    old, held_out, drafter_dir, kwargs = _ten_record_campaign(tiny, tmp_path, steps=4)
    vocab = tiny[0].vocab_size
    state = campaign_state.read_state(drafter_dir)
    assert (state.cursor.shard, state.cursor.wraps, state.records_reached) == (2, 0, 8)
    # shards 0-4, 4-8, 8-12, 12-16, 16-18: record 8 starts shard 2, the cursor's own
    kwargs["corpus"] = (old + _records(8, vocab, seed=2), held_out)
    record = campaign.run_sitting(recipe=None, max_steps=None, fresh_only=True, **kwargs)
    state = campaign_state.read_state(drafter_dir)
    assert record["steps"] == 5 and record["saved"].startswith("no fresh records left")
    assert (state.cursor.shard, state.cursor.wraps, state.records_reached) == (0, 1, 18)
    # half through an old shard, new records in the next one: it goes now, and comes back
    campaign.run_sitting(recipe=None, max_steps=7, **kwargs)
    cursor = campaign_state.read_state(drafter_dir).cursor
    assert (cursor.shard, cursor.position) == (3, 2)
    kwargs["corpus"] = (kwargs["corpus"][0] + _records(4, vocab, seed=3), held_out)
    record = campaign.run_sitting(recipe=None, max_steps=None, fresh_only=True, **kwargs)
    state = campaign_state.read_state(drafter_dir)
    # shards 0-4, ..., 12-16, 16-20, 20-22: records 18-21 are new, in shards 4 and 5 (3 steps)
    assert record["steps"] == 3 and (state.cursor.shard, state.cursor.position) == (3, 0)
    assert state.records_reached == 22
    assert (
        campaign.run_sitting(recipe=None, max_steps=None, fresh_only=True, **kwargs)["steps"] == 0
    )


def test_a_campaign_from_before_the_fresh_first_rule_counts_what_it_reached():
    shards = campaign.shard_slices(20, 4)
    early = campaign_state.State(cursor=Cursor(shard=3, position=2))
    assert campaign.records_reached_before(early, [], shards) == 12
    wrapped = campaign_state.State(cursor=Cursor(shard=1, wraps=1))
    assert campaign.records_reached_before(wrapped, [{"corpus_records": 16}], shards) == 16


def test_weight_average_is_what_is_measured_and_shipped_while_training_goes_on(tiny, tmp_path):
    """With `ema`, the held-out measure and the checkpoint use avg <- ema*avg + (1-ema)*w after
    every step, starting from the loaded weights; training itself continues on the raw ones."""
    target, target_dir = tiny
    recipe = _tiny_recipe(ema=0.5, draft_vocab=0)
    config = campaign.drafter_config_for_target(
        json.loads((target_dir / "config.json").read_text()),
        num_layers=recipe.layers,
        block_size=recipe.block_size,
        mask_token_id=recipe.mask_token_id,
        target_layer_ids=target.layer_ids,
    )
    model = init_drafter(config, 0)
    trainer = campaign.Trainer(target, "tiny", model, campaign_state.State(recipe=recipe), None,
                               tmp_path)  # fmt: skip
    sequences = campaign.to_sequences(_records(4, target.vocab_size), recipe.max_len)
    store = trainer.store(sequences)
    expected = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for _ in range(3):
        trainer.step(store, [0, 1], sequences, 1e-2)
        for name, value in tree_flatten(model.parameters()):
            expected[name] = 0.5 * expected[name] + 0.5 * np.array(value)
    shipped = {k: np.array(v) for k, v in trainer.shipped().items()}
    raw = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for name in expected:
        np.testing.assert_allclose(shipped[name], expected[name], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(shipped[k], raw[k]) for k in raw)
    averaged = trainer.heldout(store, sequences, 0)
    for name, value in tree_flatten(model.parameters()):  # the raw weights are back
        np.testing.assert_array_equal(np.array(value), raw[name])
    trainer.average = None  # now the raw weights: a different score
    assert trainer.heldout(store, sequences, 0)["loss"] != averaged["loss"]


# ------------------------------------------------------------------ levers
def _reference(logits: np.ndarray, batch, *, candidates: bool, distill: float) -> float:
    """The loss written out row by row from full logits [N, B-1, V], in float64."""
    n, rows, vocab = logits.shape
    total = weight_sum = 0.0
    for a in range(n):
        for j in range(rows):
            w = float(batch.weights[a, j])
            if w == 0:  # a label outside the draft vocabulary: nothing to learn
                continue
            z = logits[a, j].astype(np.float64)
            if candidates:
                cols = [int(c) for c in batch.cand[a, j] if c >= 0]
                scores = {c: z[c] for c in cols}
                correction = np.log(vocab / len(batch.negatives))
                for neg in batch.negatives:
                    if int(neg) not in scores:
                        scores[("neg", int(neg))] = z[neg] + correction
                lse = np.log(np.sum(np.exp(list(scores.values()))))
                logq = {c: scores[c] - lse for c in cols}
            else:
                lse = np.log(np.exp(z).sum())
                logq = {c: z[c] - lse for c in range(vocab)}
            label = int(batch.labels[a, j])
            ce = -logq[label]
            kl = 0.0
            for c, p in zip(batch.cand[a, j], batch.teacher[a, j]):
                if c >= 0 and p > 0:
                    kl += p * (np.log(p) - logq[int(c)])
            total += w * ((1 - distill) * ce + distill * kl)
            weight_sum += w
    return total / weight_sum


@pytest.mark.parametrize("candidates", [False, True])
@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_each_loss_is_finite_and_matches_a_plain_reference(tiny, tmp_path, candidates, distill):
    target, _ = tiny
    vocab = target.vocab_size
    tokens = np.random.default_rng(3).integers(3, vocab, size=40).astype(np.int32)
    store = FeatureStore.build(target, [tokens], tmp_path, "tiny", top_k=5)
    top_ids, top_logp = store.top(0)
    logits, _ = target(mx.array(tokens)[None])
    want = np.argsort(-np.array(logits[0]), axis=-1)[:, :5]
    np.testing.assert_array_equal(top_ids, want)  # the store's top-k is the target's
    head = DraftHead(target, np.arange(0, vocab, 2, dtype=np.int32))  # half: some labels outside
    anchors = sample_anchors(len(tokens), 8, np.random.default_rng(0), first=5)
    blocks = make_blocks(tokens, anchors, 4, 2, gamma=2.0)
    negatives = sample_negatives(head.size, 24, np.random.default_rng(1))
    batch = lever_batch(blocks, top_ids, top_logp, head.index_of, negatives)
    assert (batch.weights == 0).any() and (batch.weights > 0).any()
    assert np.allclose(batch.teacher.sum(-1), 1.0, atol=1e-5)
    hidden = mx.random.normal((len(anchors), 3, 64), key=mx.random.key(4))
    loss, acc = lever_loss(hidden, head.weight, batch, candidates=candidates, distill=distill)
    assert np.isfinite(loss.item()) and 0.0 <= acc.item() <= 1.0
    full = np.array(hidden @ head.weight.T)
    expected = _reference(full, batch, candidates=candidates, distill=distill)
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_full_head_loss_without_distillation_is_the_trainers_cross_entropy(tiny, tmp_path):
    from drafters.dflash.train import block_loss, restrict_labels

    target, _ = tiny
    vocab = target.vocab_size
    tokens = np.random.default_rng(5).integers(3, vocab, size=30).astype(np.int32)
    store = FeatureStore.build(target, [tokens], tmp_path, "tiny", top_k=3)
    config = factories.drafter_config(vocab, block_size=4)
    model = init_drafter(config, seed=0)
    head = DraftHead(target, np.arange(0, vocab, 3, dtype=np.int32))
    blocks = make_blocks(tokens, np.arange(5, 20), 4, 2, gamma=2.0)
    batch = lever_batch(blocks, *store.top(0), head.index_of)
    hidden = campaign.block_states(model, target, store.get(0), blocks)
    ours, _ = lever_loss(hidden, head.weight, batch, candidates=False, distill=0.0)
    theirs, _ = block_loss(model, target, store.get(0), restrict_labels(blocks, head), head)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


# ------------------------------------------------------------------ prompt anchors
def test_greedy_chain_labels_follow_the_targets_argmax_until_the_text_leaves_it():
    #            0  1  2  3  4  5  6  7
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 12], np.int32)
    top1 = np.array([6, 7, 40, 9, 10, 11, 12, 0], np.int32)  # the text leaves it at token 3
    blocks = make_blocks(tokens, np.array([0, 3, 5]), 4, 2, gamma=2.0)
    chain = greedy_chain_labels(blocks, tokens, top1)
    # anchor 0: rows 1, 2 follow (6, 7); row 3's label is the argmax 40, and counts, since
    # tokens 1 and 2 were the chain; anchor 3: all greedy; anchor 5: row 3 is past the end
    np.testing.assert_array_equal(chain.labels, [[6, 7, 40], [9, 10, 11], [11, 12, 0]])
    np.testing.assert_array_equal(chain.weights > 0, [[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    blocks = make_blocks(tokens, np.array([1]), 4, 2, gamma=2.0)
    chain = greedy_chain_labels(blocks, tokens, top1)  # row 2 comes after token 3 != 40
    np.testing.assert_array_equal(chain.labels, [[7, 40, 0]])
    np.testing.assert_array_equal(chain.weights > 0, [[1, 1, 0]])
    np.testing.assert_array_equal(chain.weights[0, :2], blocks.weights[0, :2])


def test_shared_prefix_is_what_a_sequence_shares_with_its_group():
    seqs = [
        TrainSequence(np.array(t, np.int32), 2)
        for t in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4], [7, 2, 3], [8, 8])
    ]
    # the three starting with 1 share [1, 2, 3]; 7 and 8 are alone in their groups
    np.testing.assert_array_equal(shared_prefix_lengths(seqs), [3, 3, 3, 0, 0])
    assert len(shared_prefix_lengths([])) == 0


def _greedy_continuation(target: TargetAdapter, prompt: list[int], steps: int) -> np.ndarray:
    tokens = list(prompt)
    for _ in range(steps):
        logits, _ = target(mx.array(tokens)[None])
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return np.array(tokens, np.int32)


def test_chain_labels_equal_the_text_on_a_real_greedy_continuation(tiny, tmp_path):
    """On the target's own greedy continuation the feature store's top-1 is the next token, so
    chain labels change nothing there; in the prompt they are the target's argmax."""
    target, _ = tiny
    prompt = np.random.default_rng(11).integers(3, target.vocab_size, size=12).tolist()
    tokens = _greedy_continuation(target, prompt, 12)
    store = FeatureStore.build(target, [tokens], tmp_path, "tiny", top_k=4)
    top1 = store.top(0)[0][:, 0]
    response = np.arange(len(prompt) - 1, len(tokens) - 1)
    blocks = make_blocks(tokens, response, 4, 2, gamma=2.0)
    chain = greedy_chain_labels(blocks, tokens, top1)
    np.testing.assert_array_equal(chain.labels, blocks.labels)
    np.testing.assert_array_equal(chain.weights, blocks.weights)
    in_prompt = make_blocks(tokens, np.arange(0, len(prompt) - 1), 4, 2, gamma=2.0)
    chain = greedy_chain_labels(in_prompt, tokens, top1)
    logits, _ = target(mx.array(tokens)[None])
    argmax = np.array(mx.argmax(logits[0], axis=-1))
    np.testing.assert_array_equal(chain.labels[:, 0], argmax[: len(prompt) - 1])
    assert (chain.weights[:, 0] > 0).all()


def test_a_prompt_anchor_sitting_trains_on_prompt_positions(tiny, tmp_path, monkeypatch):
    target, target_dir = tiny
    vocab = target.vocab_size
    records = _records(8, vocab)
    for r in records:  # a fixed "system prompt" of 3 tokens in front of every record
        r["tokens"] = [1, 8, 9] + r["tokens"]
        r["prompt_tokens"] += 3
    firsts: list[int] = []
    real_sample = campaign.sample_anchors

    def spy(seq_len, num_anchors, rng, first=0):
        firsts.append(first)
        return real_sample(seq_len, num_anchors, rng, first)

    monkeypatch.setattr(campaign, "sample_anchors", spy)
    drafter_dir = tmp_path / "drafter"
    kwargs = _sitting_args(target_dir, drafter_dir, tmp_path, (records, records[:2]))
    result = campaign.run_sitting(recipe=_tiny_recipe(prompt_anchors=True), max_steps=2, **kwargs)
    assert result["steps"] == 2 and result["labels"] > 0
    assert set(firsts) == {3}  # after the shared prefix, not after each prompt (8)
    assert campaign_state.read_state(drafter_dir).recipe.prompt_anchors
    assert "prompt anchors" in write_card(drafter_dir, "tiny").read_text()


def test_short_training_blocks_train_and_the_measure_keeps_the_models_block(
    tiny, tmp_path, monkeypatch
):
    target, target_dir = tiny
    corpus = (_records(6, target.vocab_size), _records(2, target.vocab_size, seed=1))
    widths: list[int] = []
    real_make_blocks = campaign.make_blocks

    def spy(tokens, anchors, block_size, mask_token_id, gamma):
        widths.append(block_size)
        return real_make_blocks(tokens, anchors, block_size, mask_token_id, gamma)

    monkeypatch.setattr(campaign, "make_blocks", spy)
    kwargs = _sitting_args(target_dir, tmp_path / "d", tmp_path, corpus)
    result = campaign.run_sitting(recipe=_tiny_recipe(train_block=2), max_steps=2, **kwargs)
    assert result["steps"] == 2 and result["labels"] > 0
    assert 2 in widths and 4 in widths  # training blocks of 2; held-out measure at the model's 4
    assert len(result["heldout_end"]["acc_by_position"]) == 3
    assert "training blocks of 2 rows" in write_card(tmp_path / "d", "tiny").read_text()
    with pytest.raises(ValueError, match="train_block"):
        campaign.run_sitting(
            recipe=_tiny_recipe(train_block=5),
            max_steps=1,
            **kwargs | {"drafter_dir": tmp_path / "d2"},
        )


# ------------------------------------------------------------------ warm start
def _heldout_ce(model, target, tokens, block_size, mask_token_id) -> float:
    from drafters.dflash.train import block_loss, target_features

    blocks = make_blocks(tokens, np.arange(0, len(tokens) - 1), block_size, mask_token_id, 4.0)
    loss, _ = block_loss(model, target, target_features(target, tokens), blocks)
    return loss.item()


@pytest.mark.skipif(not bundled_paths()[0].is_dir(), reason="the bundled pair is not built")
def test_warm_start_step0_predicts_better_than_random_init_on_the_bundled_target():
    import inspect

    from drafters.dflash.train import drafter_config_for_target
    from engine.bundled.pretrain import build_bpe_tokenizer  # a held-out-ish text source

    target_dir, _ = bundled_paths()
    model, tokenizer = load_target_model(target_dir)
    raw = json.loads((target_dir / "config.json").read_text())
    config = drafter_config_for_target(
        raw, num_layers=2, block_size=8, target_layer_ids=[1, 5], mask_token_id=3
    )
    target = TargetAdapter(model, [1, 5])
    tokens = np.array(tokenizer.encode(inspect.getsource(build_bpe_tokenizer))[:160], np.int32)
    random_loss = _heldout_ce(init_drafter(config, 0), target, tokens, 8, 3)
    warm = init_drafter(config, 0)
    assert warm_start(warm, target) == {}  # Qwen3 has its own q/k norms: copied, no scales
    warm_loss = _heldout_ce(warm, target, tokens, 8, 3)
    assert np.isfinite(warm_loss)
    assert warm_loss < random_loss - 0.5, (warm_loss, random_loss)


def test_warm_start_on_a_target_without_qk_norms_matches_their_scale(llama_target_dir):
    from drafters.dflash.train import drafter_config_for_target

    model, _ = load_target_model(llama_target_dir)
    raw = json.loads((llama_target_dir / "config.json").read_text())
    config = drafter_config_for_target(
        raw, num_layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=2
    )
    target = TargetAdapter(model, [1, 3])
    drafter = init_drafter(config, 0)
    tokens = np.random.default_rng(0).integers(3, target.vocab_size, size=64)
    with pytest.raises(ValueError, match="sample tokens"):
        warm_start(drafter, target)
    scales = warm_start(drafter, target, tokens)
    assert set(scales) == {f"layers.{i}.{n}_norm" for i in (0, 1) for n in ("q", "k")}
    # layer 0 is the target's layer 4 (of 6), fed by the deepest tap (layer 3): its context
    # keys before the norm are exactly that layer's own key projections
    _, features = target(mx.array(tokens)[None])
    context = drafter.project_context(features)
    source = target.layers[4]
    expected = source.self_attn.k_proj(source.input_layernorm(features[..., 64:]))
    np.testing.assert_allclose(
        np.array(drafter.layers[0].self_attn.k_proj(context)),
        np.array(expected),
        rtol=1e-4,
        atol=1e-4,
    )
    attn = drafter.layers[0].self_attn
    q = attn.q_norm(attn.split_heads(attn.q_proj(context), attn.n_heads))
    rms = float(mx.sqrt((q * q).mean(-1)).mean().item())
    assert rms == pytest.approx(scales["layers.0.q_norm"], rel=1e-3)


# ------------------------------------------------------------------ eval keeps or restores
class _CheckpointRepo:
    """A git repository whose drafter directory holds a one-step sitting's checkpoint."""

    def __init__(self, tiny, tmp_path) -> None:
        target, target_dir = tiny
        self.root = tmp_path / "repo"
        self.drafter_dir = self.root / "engine" / "models" / "x_drafter"
        self.rejected = tmp_path / "rejected"
        corpus = (_records(6, target.vocab_size), _records(2, target.vocab_size, seed=1))
        self.sitting_args = _sitting_args(target_dir, self.drafter_dir, tmp_path, corpus)
        campaign.run_sitting(recipe=_tiny_recipe(), max_steps=1, **self.sitting_args)
        self.git("init", "-q")

    def git(self, *args: str) -> None:
        import subprocess

        subprocess.run(["git", "-C", str(self.root), *args], check=True, capture_output=True)

    def commit(self) -> None:
        self.git("add", "-A")
        self.git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "checkpoint")

    def sitting(self, steps: int) -> None:
        campaign.run_sitting(recipe=None, max_steps=steps, **self.sitting_args)

    def evaluate(self) -> dict:
        return keep_gate.run_eval(
            "t", self.drafter_dir, 1, 8, "eval", repo_root=self.root, rejected_root=self.rejected
        )


def test_eval_keeps_a_better_checkpoint_and_restores_the_committed_one_otherwise(
    tiny, tmp_path, monkeypatch
):
    repo = _CheckpointRepo(tiny, tmp_path)
    drafter_dir = repo.drafter_dir
    taus = iter([2.0, 1.5, 2.5])
    monkeypatch.setattr(keep_gate, "tau_eval", lambda *a: {"tau_mean": next(taus), "tau": {}})
    # nothing committed: the first checkpoint always lands; then it is committed
    first = repo.evaluate()
    assert first["kept"] and first["committed_tau_mean"] is None
    repo.commit()
    committed_weights = _weights(drafter_dir)

    repo.sitting(2)  # a worse sitting (tau 1.5)
    assert campaign_state.read_state(drafter_dir).step == 3
    worse = repo.evaluate()
    assert not worse["kept"] and worse["committed_tau_mean"] == 2.0
    assert campaign_state.read_state(drafter_dir).step == 1  # the committed state is back
    for name, value in _weights(drafter_dir).items():
        np.testing.assert_array_equal(value, committed_weights[name])
    assert len(list(repo.rejected.iterdir())) == 1
    stages = [s["stage"] for s in campaign_state.read_sittings(drafter_dir)]
    assert stages == ["sitting", "eval", "sitting", "eval"]  # the log keeps the rejected one

    repo.sitting(1)  # a better one (tau 2.5)
    better = repo.evaluate()
    assert better["kept"] and campaign_state.read_state(drafter_dir).eval["tau_mean"] == 2.5


def test_eval_judges_on_the_eval_set_where_the_committed_checkpoint_was_measured_on_it(
    tiny, tmp_path, monkeypatch
):
    """Where the target has an eval set, the keep-or-restore decision follows its tau, not the
    real loop's on a few prompts (which moved by about a sitting's gain), where the sittings
    logs hold it for both checkpoints; before the committed one was measured, the loop's
    tau decides."""
    repo = _CheckpointRepo(tiny, tmp_path)
    drafter_dir = repo.drafter_dir
    loop_taus = iter([2.0, 1.5, 2.5])  # the real loop's: worse, then better
    gate_taus = iter([1.60, 1.70, 1.65])  # the eval set's: better, then worse
    monkeypatch.setattr(keep_gate, "tau_eval", lambda *a: {"tau_mean": next(loop_taus), "tau": {}})

    def evaluate() -> dict:  # after `python -m drafters.dflash.evalset measure --log`
        state = campaign_state.read_state(drafter_dir)
        entry = {**campaign_state.log_entry("evalset", "measure", state),
                 "tau_loop_mean": next(gate_taus)}  # fmt: skip
        campaign_state.write_json(
            drafter_dir / campaign_state.SITTINGS_FILE,
            campaign_state.read_sittings(drafter_dir) + [entry],
        )
        return repo.evaluate()

    first = evaluate()
    assert first["kept"] and first["judged_on"] == "eval"  # nothing committed to compare
    repo.commit()
    assert keep_gate.committed_gate(drafter_dir, repo.root) == 1.60

    repo.sitting(1)
    better = evaluate()  # the loop says 1.5 < 2.0, the eval set 1.70 >= 1.60: kept
    assert better["kept"] and better["judged_on"] == "evalset"
    assert better["committed_evalset_tau_loop_mean"] == 1.60
    assert campaign_state.read_state(drafter_dir).step == 2
    repo.commit()

    repo.sitting(1)
    worse = evaluate()  # the loop says 2.5 >= 1.5, the eval set 1.65 < 1.70: restored
    assert not worse["kept"] and worse["judged_on"] == "evalset"
    assert campaign_state.read_state(drafter_dir).step == 2
    stages = [s["stage"] for s in campaign_state.read_sittings(drafter_dir)]
    assert stages[-3:] == ["sitting", "evalset", "eval"]  # the log keeps the rejected one's


def test_sigterm_finishes_the_step_saves_and_stops(tiny, tmp_path, monkeypatch):
    import os
    import signal

    target, target_dir = tiny
    corpus = (_records(8, target.vocab_size), _records(2, target.vocab_size, seed=1))
    real_step = campaign.Trainer.step
    calls = []

    def step_then_term(self, *args):
        out = real_step(self, *args)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` from the lead's shell
        return out

    monkeypatch.setattr(campaign.Trainer, "step", step_then_term)
    previous = signal.getsignal(signal.SIGTERM)
    record = campaign.run_sitting(
        recipe=_tiny_recipe(),
        **_sitting_args(target_dir, tmp_path / "d", tmp_path, corpus, max_steps=None),
    )
    assert record["saved"].startswith("SIGTERM") and record["steps"] == 2
    assert campaign_state.read_state(tmp_path / "d").step == 2
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is put back


def test_card_lists_every_sitting_and_eval(tiny, tmp_path, monkeypatch):
    target, target_dir = tiny
    corpus = (_records(6, target.vocab_size), _records(2, target.vocab_size, seed=1))
    drafter_dir = tmp_path / "d"
    for recipe, command in ((_tiny_recipe(), "first sitting"), (None, "second sitting")):
        campaign.run_sitting(
            recipe=recipe,
            **_sitting_args(
                target_dir, drafter_dir, tmp_path, corpus, max_steps=1, command=command
            ),
        )
    monkeypatch.setattr(keep_gate, "tau_eval", lambda *a: {"tau_mean": 1.5, "tau": {"chat": 1.5}})
    keep_gate.run_eval("t", drafter_dir, 1, 8, "eval", repo_root=tmp_path / "no-repo")
    from drafters.dflash.card import main as card_main

    assert card_main(["--target", "tiny", "--drafter-dir", str(drafter_dir)]) == 0
    card = (drafter_dir / "MODEL_CARD.md").read_text()
    assert "`first sitting`" in card and "`second sitting`" in card
    assert "| 2 | 1.500 | chat 1.50 | kept |" in card
    assert "candidate-set loss" in card and "warm start" not in card
    assert "prompt anchors" not in card


def test_tau_projection_fits_tau_against_log_labels():
    """Two evals a doubling of labels apart, tau +0.5 each kind: the line says +0.5 per
    doubling, and the sittings each aim needs follow from the sittings' median labels."""
    sittings = [
        {"stage": "sitting", "step_start": 0, "step_end": 100, "labels_start": 0,
         "labels": 1000},
        {"stage": "eval", "step": 100, "tau": {"editing": 1.5, "completion": 1.5, "chat": 1.5}},
        {"stage": "sitting", "step_start": 100, "step_end": 200, "labels_start": 1000,
         "labels": 1000},
        {"stage": "eval", "step": 200, "tau": {"editing": 2.0, "completion": 2.0, "chat": 1.0}},
    ]  # fmt: skip
    state = campaign_state.State(step=200, labels_seen=2000)
    text = "\n".join(tau_projection(sittings, state))
    assert "| 1,000 | 1.500 | 1.500 | 1.500 |" in text and "| 2,000 |" in text
    # completion: 2.0 at 2000 labels, +0.5 a doubling: 3.0 at 8000, i.e. 6 sittings more
    assert "| completion | 3.0 | +0.500 | 8e+03 | 6 |" in text
    assert "| chat | 2.5 | -0.500 | not rising | - |" in text
    one_eval = tau_projection(sittings[:2], campaign_state.State(step=100, labels_seen=1000))
    assert "Two evals" in one_eval[-1]
    # A rejected eval (the gate restored the committed checkpoint) is no point of the curve.
    rejected = {"stage": "eval", "step": 200, "kept": False,
                "tau": {"editing": 1.9, "completion": 1.9, "chat": 1.0}}  # fmt: skip
    again = "\n".join(tau_projection(sittings[:3] + [rejected] + sittings[3:], state))
    assert again.count("| 2,000 |") == 1 and again == text


# ------------------------------------------------------------------ offline tau
def test_offline_accepted_runs_equal_the_speculative_loops_on_the_bundled_pair(tmp_path):
    """The held-out tau needs no speculative loop: on the target's own greedy continuation a
    block's run of leading argmax hits is what greedy verification accepts. Checked step by step
    against the real loop on the bundled pair (a trained drafter: the runs are not all 0)."""
    from drafters.dflash.checkpoint import read_config
    from engine.bundled.workloads import load_workloads
    from engine.models.loading import load_pair
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    target_dir, drafter_dir = bundled_paths()
    if not (drafter_dir / "config.json").is_file():
        pytest.skip("the bundled pair is not built in this checkout")
    pair = load_pair(target_dir, drafter_dir)
    config = read_config(drafter_dir)
    depth = config.block_size - 1
    recipe = Recipe(block_size=config.block_size, mask_token_id=config.mask_token_id, top_k=4)
    trainer = campaign.Trainer(
        pair.target,
        str(target_dir),
        pair.drafter.model,
        campaign_state.State(recipe=recipe),
        None if pair.drafter.head is None else np.array(pair.drafter.head.token_ids),
        tmp_path / "cache",
    )
    compared = accepted_total = 0
    for text in load_workloads()["completion"][:2]:
        prompt = list(pair.tokenizer.encode(text))
        params = SamplingParams(max_tokens=40, ignore_eos=True, num_speculative_tokens=depth)
        out = generate(pair.target, prompt, params, drafter=pair.drafter)
        sequence = campaign.TrainSequence(np.array(prompt + out.token_ids, np.int32), len(prompt))
        store = trainer.store([sequence])
        # step k starts from the last committed token: the first sampled one, then each bonus
        anchors = len(prompt) + np.cumsum([0] + [s.committed for s in out.steps[:-1]])
        full = [k for k, s in enumerate(out.steps) if s.drafted == depth]
        runs = trainer.accepted_runs(store, 0, sequence, anchors[full])
        assert runs.tolist() == [out.steps[k].accepted for k in full]
        # replaying the loop over every anchor's run takes the loop's own number of steps
        every = trainer.accepted_runs(
            store, 0, sequence, np.arange(len(prompt), len(sequence.tokens) - 1)
        )
        assert campaign.loop_steps_over(every) == len(out.steps)
        compared += len(full)
        accepted_total += int(runs.sum())
    assert compared >= 10 and accepted_total > 0


def test_the_replayed_loop_counts_steps_and_sits_below_the_mean_over_anchors():
    """Each step commits its anchor's run plus one token and jumps past them; clustered runs
    make the loop's tokens a step smaller than the mean of 1 + run over all anchors."""
    assert campaign.loop_steps_over(np.array([0, 0, 0])) == 3
    assert campaign.loop_steps_over(np.array([2, 5, 5, 0, 1, 0])) == 3  # 0 -> 3 -> 4 -> 6
    clustered = np.array([3, 2, 1, 0] + [0] * 4)  # one easy stretch, then a hard one
    loop_tau = len(clustered) / campaign.loop_steps_over(clustered)
    assert loop_tau == pytest.approx(8 / 5) and loop_tau < 1 + clustered.mean()


# ------------------------------------------------------------------ growing by layers
def test_grow_keeps_the_predictions_and_the_next_sitting_trains_the_new_layer(tiny, tmp_path):
    """`campaign grow` appends a layer whose output projections are zero: the held-out measure
    is unchanged, the grow is logged and carded, and a resumed sitting moves the new layer."""
    target, target_dir = tiny
    vocab = target.vocab_size
    corpus = (_records(6, vocab), _records(2, vocab, seed=1))
    drafter_dir = tmp_path / "d"
    kwargs = _sitting_args(
        target_dir, drafter_dir, tmp_path, corpus, max_steps=2, command="sitting"
    )
    campaign.run_sitting(recipe=_tiny_recipe(), **kwargs)
    sequences = campaign.to_sequences(corpus[1], 768)

    def measure(anchors: int = 0) -> dict:
        model, state, draft_vocab = campaign_state.load_checkpoint(drafter_dir)
        trainer = campaign.Trainer(target, "tiny", model, state, draft_vocab, tmp_path / "m")
        return trainer.heldout(trainer.store(sequences), sequences, anchors)

    before = measure()
    assert measure(anchors=2)["tau_loop"] is None  # sampled anchors cannot replay the loop
    with pytest.raises(ValueError, match="more layers"):
        campaign.grow_checkpoint(drafter_dir, 2, "grow")
    record = campaign.grow_checkpoint(drafter_dir, 3, "grow --layers 3")
    assert record["layers"] == [2, 3] and record["step"] == 2
    assert campaign.read_config(drafter_dir).num_hidden_layers == 3
    assert campaign_state.read_state(drafter_dir).recipe.layers == 3
    after = measure()
    assert after["tau"] == before["tau"] and after["acc"] == before["acc"]
    assert before["tau_loop"] >= 1.0 and after["tau_loop"] == before["tau_loop"]  # all anchors
    assert after["loss"] == pytest.approx(before["loss"], rel=1e-6)
    new_out = _weights(drafter_dir)["layers.2.self_attn.o_proj.weight"]
    assert not new_out.any()

    campaign.run_sitting(recipe=None, **kwargs)
    assert campaign_state.read_state(drafter_dir).step == 4
    assert _weights(drafter_dir)["layers.2.self_attn.o_proj.weight"].any()
    card = write_card(drafter_dir, "tiny").read_text()
    assert "`grow --layers 3`: 2 -> 3 layers" in card and "grown to 3 layers" in card


def test_grow_by_a_tap_keeps_the_predictions_and_the_next_sitting_reads_the_new_layer(
    tiny, tmp_path
):
    """`campaign grow --taps` reads one more target layer through zero `fc` columns: the
    held-out measure (over features recomputed with the new tap) is unchanged, the card says
    so, and a resumed sitting trains those columns off zero."""
    target, target_dir = tiny
    vocab = target.vocab_size
    corpus = (_records(6, vocab), _records(2, vocab, seed=1))
    drafter_dir = tmp_path / "d"
    kwargs = _sitting_args(target_dir, drafter_dir, tmp_path, corpus, max_steps=2)
    campaign.run_sitting(recipe=_tiny_recipe(), **kwargs)
    sequences = campaign.to_sequences(corpus[1], 768)

    def measure() -> dict:
        trainer = campaign.trainer_for(str(target_dir), drafter_dir, tmp_path / "m")
        return trainer.heldout(trainer.store(sequences), sequences, 0)

    taps = campaign.read_config(drafter_dir).target_layer_ids
    assert taps == [1, 3]
    before = measure()
    fc_before = _weights(drafter_dir)["fc.weight"]
    with pytest.raises(ValueError, match="more taps"):
        campaign.grow_checkpoint(drafter_dir, None, "grow", taps=[1])
    record = campaign.grow_checkpoint(drafter_dir, None, "grow --taps 1,2,3", taps=[3, 2, 1])
    assert record["taps"] == [[1, 3], [1, 2, 3]] and "layers" not in record
    assert campaign.read_config(drafter_dir).target_layer_ids == [1, 2, 3]
    fc = _weights(drafter_dir)["fc.weight"]
    width = fc_before.shape[1] // 2
    assert fc.shape[1] == 3 * width and not fc[:, width : 2 * width].any()
    assert np.array_equal(fc[:, :width], fc_before[:, :width])
    assert np.array_equal(fc[:, 2 * width :], fc_before[:, width:])
    after = measure()
    assert after["tau"] == before["tau"] and after["tau_loop"] == before["tau_loop"]
    assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)

    campaign.run_sitting(recipe=None, **kwargs)
    assert campaign_state.read_state(drafter_dir).step == 4
    assert _weights(drafter_dir)["fc.weight"][:, width : 2 * width].any()
    card = write_card(drafter_dir, "tiny").read_text()
    assert "taps [1, 3] -> [1, 2, 3]" in card


# ------------------------------------------------------------------ the eval set
def test_the_eval_set_measures_each_kind_logs_it_and_shows_on_the_card(tiny, tmp_path):
    """`evalset measure` replays the loop per kind over every anchor; `--log` puts it in the
    sittings log (not as a sitting) and the card's eval-set table shows it. The file is written
    sorted and byte-stable, so a rebuilt set of the same records commits no change."""
    from drafters.dflash import evalset

    target, target_dir = tiny
    vocab = target.vocab_size
    drafter_dir = tmp_path / "d"
    corpus = (_records(6, vocab), _records(2, vocab, seed=1))
    campaign.run_sitting(
        recipe=_tiny_recipe(),
        max_steps=2,
        **_sitting_args(target_dir, drafter_dir, tmp_path, corpus),
    )
    records = [{**r, "kind": kind} for kind in ("chat", "editing") for r in _records(3, vocab, 2)]
    for i, r in enumerate(records):
        r["key"] = f"k{i}"
    path = evalset.write_evalset(records, tmp_path / "set" / "tiny.jsonl.gz")
    first_bytes = path.read_bytes()
    assert evalset.write_evalset(records[::-1], path).read_bytes() == first_bytes
    assert evalset.read_evalset(path) == sorted(records, key=lambda r: (r["kind"], r["key"]))

    result = evalset.measure(str(target_dir), drafter_dir, records, tmp_path / "cache")
    assert set(result["tau_loop"]) == {"chat", "editing"}
    assert all(1.0 <= t <= 4.0 for t in result["tau_loop"].values())  # depth 3 + the bonus
    assert result["by_kind"]["chat"]["records"] == 3 and result["depth"] == 3
    assert result["tau_loop_mean"] == pytest.approx(
        np.mean(list(result["tau_loop"].values())), abs=1e-4
    )

    low, high = result["tau_loop_mean_90"]
    assert low <= result["tau_loop_mean"] <= high
    assert [r[0] for r in result["by_kind"]["chat"]["loop_records"]] == [0, 1, 2]

    evalset.log_measure(drafter_dir, result, "evalset measure --log")
    logged = campaign_state.read_sittings(drafter_dir)[-1]
    assert logged["stage"] == "evalset" and logged["tau_loop_mean_90"] == [low, high]
    assert "loop_records" not in logged["by_kind"]["chat"]  # intervals only: kept out of the log
    card = write_card(drafter_dir, "tiny").read_text()
    section = card.split("## Held-out tau on the eval set")[1]
    assert f"| {result['step']} | {result['tau_loop_mean']:.3f} |" in section
    assert f"| {low:.3f}-{high:.3f} |" in section
    assert card.count("evalset measure --log") == 1  # in its own table, not a sittings row
    projected = card.split("On the eval set")[1]
    assert "Two evals at different label counts" in projected
    later = {**result, "labels_seen": 4 * result["labels_seen"], "step": result["step"] + 1}
    later["tau_loop"] = {k: v + 0.2 for k, v in result["tau_loop"].items()}
    evalset.log_measure(drafter_dir, later, "evalset measure --log")
    projected = write_card(drafter_dir, "tiny").read_text().split("On the eval set")[1]
    assert "| chat | 2.5 | +0.100 |" in projected  # +0.2 over two doublings of labels


def _loops(tokens_steps: dict[str, list[tuple[int, int]]]) -> dict[str, dict]:
    return {k: {"loop_records": [[i, t, s] for i, (t, s) in enumerate(v)]}
            for k, v in tokens_steps.items()}  # fmt: skip


def test_eval_set_intervals_draw_records_and_pair_two_checkpoints_on_the_same_ones():
    from drafters.dflash.evalset import loop_interval

    rng = np.random.default_rng(0)
    kinds = ("chat", "editing")
    tokens = {k: rng.integers(100, 250, size=24) for k in kinds}
    steps = {k: np.round(tokens[k] / rng.uniform(1.3, 1.9, size=24)) for k in kinds}
    before = _loops({k: list(zip(tokens[k], steps[k])) for k in kinds})
    # every record of the later checkpoint takes 2% fewer steps for its tokens
    after = _loops({k: list(zip(tokens[k], np.round(0.98 * steps[k]))) for k in kinds})
    point = np.mean([tokens[k].sum() / steps[k].sum() for k in kinds])
    low, high = loop_interval(before)
    assert low < point < high
    assert loop_interval(before, before) == [0.0, 0.0]
    gain_low, gain_high = loop_interval(after, before)
    assert 0.0 < gain_low < gain_high < 0.1  # paired: a small, even gain is told from noise
    # unpaired, the same gain sits inside either measure's own spread over records
    assert loop_interval(after)[0] < high
    shuffled = {k: {"loop_records": v["loop_records"][::-1]} for k, v in after.items()}
    with pytest.raises(ValueError, match="not over the same records"):
        loop_interval(shuffled, before)


def test_evalset_compare_pairs_two_checkpoints_on_the_command_line(
    tiny, tmp_path, monkeypatch, capsys
):
    """`evalset compare`: a checkpoint against itself gains exactly nothing, interval included;
    against one trained further the gain is the difference of the two measures."""
    from drafters.dflash import evalset

    target, target_dir = tiny
    vocab = target.vocab_size
    monkeypatch.setattr(campaign, "CACHE_ROOT", tmp_path / "cache")
    first, later = tmp_path / "first", tmp_path / "later"
    corpus = (_records(6, vocab), _records(2, vocab, seed=1))
    kwargs = _sitting_args(target_dir, first, tmp_path, corpus)
    campaign.run_sitting(recipe=_tiny_recipe(), max_steps=2, **kwargs)
    shutil.copytree(first, later)
    campaign.run_sitting(recipe=None, max_steps=3, **{**kwargs, "drafter_dir": later})
    records = [{**r, "kind": kind} for kind in ("chat", "editing") for r in _records(3, vocab, 2)]
    path = evalset.write_evalset(records, tmp_path / "set.jsonl.gz")
    common = ["--target", str(target_dir), "--evalset", str(path)]

    evalset.main(["compare", "--drafter-dir", str(first), "--before", str(first), *common])
    same = json.loads(capsys.readouterr().out)
    assert same["gain"] == 0.0 and same["gain_90"] == [0.0, 0.0]
    evalset.main(["compare", "--drafter-dir", str(later), "--before", str(first), *common])
    out = json.loads(capsys.readouterr().out)
    assert (out["after"]["step"], out["before"]["step"]) == (5, 2)
    assert out["gain"] == pytest.approx(
        out["after"]["tau_loop_mean"] - out["before"]["tau_loop_mean"], abs=1e-4
    )
    low, high = out["gain_90"]
    assert low <= high and set(out["gain_by_kind"]) == {"chat", "editing"}
    with pytest.raises(SystemExit):
        evalset.main(["compare", "--drafter-dir", str(later), *common])
