"""The DFlash draft model and drafter: batching is exact, caches hold context rows only."""

from __future__ import annotations

import mlx.core as mx
import pytest

from drafters.dflash import load_dflash_model
from engine import load_pair

ATOL = 2e-5


@pytest.fixture
def model(drafter_dir):
    return load_dflash_model(drafter_dir)


def _run_steps(model, contexts: list[mx.array], blocks: list[mx.array], fused: bool):
    """Feed rows' contexts (ragged) then blocks as one batch; two steps to exercise appends."""
    if fused:
        model.fuse_context_projections()
    cache = model.make_cache(len(contexts))
    outputs = []
    for step in range(2):
        counts = [c[step].shape[0] for c in contexts]
        width = contexts[0][step].shape[-1]
        longest = max(counts)
        padded = mx.stack(
            [
                mx.concatenate([c[step], mx.zeros((longest - c[step].shape[0], width))])
                for c in contexts
            ]
        )
        block = mx.stack([b[step] for b in blocks])
        outputs.append(model(block, cache, padded, counts))
    return outputs, cache


@pytest.mark.parametrize("fused", [False, True])
def test_batch_of_two_ragged_rows_equals_two_single_rows(model, fused):
    mx.random.seed(0)
    # row 0: 7 then 2 context rows; row 1: 3 then 5 (different lengths at every step)
    contexts = [
        [mx.random.normal((7, 128)), mx.random.normal((2, 128))],
        [mx.random.normal((3, 128)), mx.random.normal((5, 128))],
    ]
    blocks = [[mx.random.normal((8, 64)) for _ in range(2)] for _ in range(2)]
    batched, cache = _run_steps(model, contexts, blocks, fused)
    assert cache[0].lengths == [9, 8]
    for row in range(2):
        single, _ = _run_steps(model, [contexts[row]], [blocks[row]], fused)
        for step in range(2):
            assert mx.allclose(batched[step][row], single[step][0], atol=ATOL), (row, step)


def test_fused_context_projection_equals_per_layer(model):
    mx.random.seed(1)
    feats = mx.random.normal((2, 6, 128))
    plain = model.context_kv(model.project_context(feats), mx.array([0, 4]))
    model.fuse_context_projections()
    fused = model.context_kv(model.project_context(feats), mx.array([0, 4]))
    for (k1, v1), (k2, v2) in zip(plain, fused):
        assert mx.allclose(k1, k2, atol=ATOL) and mx.allclose(v1, v2, atol=ATOL)


def test_proposing_for_a_subset_equals_proposing_alone(qwen3_target_dir, drafter_dir):
    """Sessions drafting in a batch, or a subset of them, get the same drafts as alone."""
    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter, target = pair.drafter, pair.target
    prompts = [[5, 9, 31, 77, 100, 4], [12, 13], [200, 201, 202, 203]]

    def features(ids):
        _, feats = target(mx.array([ids]))
        return feats[0]

    def open_all():
        sessions = [drafter.open() for _ in prompts]
        for s, ids in zip(sessions, prompts):
            drafter.commit(s, features(ids))
        return sessions

    sessions = open_all()
    together = drafter.propose(sessions, [1, 2, 3], [7, 3, 5])
    subset = drafter.propose([sessions[2], sessions[0]], [9, 8], [4, 4])
    mx.eval(together.tokens, subset.tokens)
    assert [s.context_rows for s in sessions] == [6, 2, 4]  # context only, no block rows
    for s in sessions:
        drafter.close(s)
    assert drafter.cache[0].batch_size == 0

    for i in range(len(prompts)):
        (alone,) = open_all()[i : i + 1]
        for s in list(drafter._sessions):
            if s is not alone:
                drafter.close(s)
        one = drafter.propose([alone], [[1, 2, 3][i]], [7])
        assert (
            one.tokens[0, : together.depths[i]].tolist()
            == together.tokens[i, : together.depths[i]].tolist()
        )
        assert mx.allclose(one.probs[0, :3], together.probs[i, :3], atol=1e-4)
        drafter.close(alone)
    assert subset.tokens.shape == (2, 4)


def test_flush_cap_writes_pending_rows_while_parked(qwen3_target_dir, drafter_dir):
    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter = pair.drafter
    drafter.flush_cap = 10
    session = drafter.open()
    _, feats = pair.target(mx.array([list(range(3, 30))]))
    for start in range(0, 24, 4):  # 6 commits of 4 rows; flush at 12 and 24
        drafter.commit(session, feats[0, start : start + 4])
    assert (session.context_rows, session.pending_rows) == (24, 0)
    drafter.commit(session, feats[0, 24:27])
    assert (session.context_rows, session.pending_rows) == (24, 3)
    drafter.close(session)


def test_pending_rows_are_compacted_without_a_forward_and_draft_as_if_given_at_once(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """A parked session holds its rows (no drafter forward below the flush cap); every
    COMPACT_PIECES commits the step slices since the last merge become one array, and rows
    merged before (the prompt's, earlier merges) are not copied again; its next proposal
    equals that of a session given the same rows in one commit."""
    from drafters.dflash import drafter as drafter_module

    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter = pair.drafter
    forwards = []
    real_append = drafter.model.append_context
    monkeypatch.setattr(drafter.model, "append_context",
                        lambda *a: forwards.append(1) or real_append(*a))  # fmt: skip
    _, feats = pair.target(mx.array([[3 + i % 40 for i in range(200)]]))
    one_by_one, at_once = drafter.open(), drafter.open()
    pieces, prompt = drafter_module.COMPACT_PIECES, 10
    total = prompt + 2 * pieces + 2
    prompt_rows = feats[0, :prompt]
    drafter.commit(one_by_one, prompt_rows)
    for i in range(prompt, prompt + pieces - 1):  # the 64th commit merges all 64
        drafter.commit(one_by_one, feats[0, i : i + 1])
    first_merge = one_by_one.pending[0]
    assert len(one_by_one.pending) == 1 and first_merge.shape[0] == prompt + pieces - 1
    for i in range(prompt + pieces - 1, total):
        drafter.commit(one_by_one, feats[0, i : i + 1])
    assert forwards == []  # parked: nothing written
    # the first merge is kept as it was (not copied into the second), then 3 steps
    assert one_by_one.pending[0] is first_merge
    assert [p.shape[0] for p in one_by_one.pending] == [prompt + pieces - 1, pieces, 1, 1, 1]
    assert one_by_one.pending_rows == total
    # the merges are left for the caller's next evaluation, handed over once
    merges = drafter.take_unevaluated()
    assert [m.shape[0] for m in merges] == [prompt + pieces - 1, pieces]
    assert merges[1] is one_by_one.pending[1] and drafter.take_unevaluated() == []
    assert one_by_one.context_rows == 0
    drafter.commit(at_once, feats[0, :total])
    anchor = 3 + total % 40
    a = drafter.propose([one_by_one], [anchor], [4])
    b = drafter.propose([at_once], [anchor], [4])
    assert a.tokens.tolist() == b.tokens.tolist()
    assert mx.allclose(a.probs, b.probs, atol=ATOL)
    assert one_by_one.context_rows == total and one_by_one.pending_rows == 0
    # A caller that never takes the merges: the next proposal drops them (a bounded list).
    for i in range(pieces):
        drafter.commit(at_once, feats[0, i : i + 1])
    drafter.propose([one_by_one], [anchor], [2])
    assert drafter.take_unevaluated() == []


def test_a_steps_opens_and_closes_copy_the_cache_once_each(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """Sessions that come and go between two uses of the cache cost one filter and one
    append in all, and every survivor keeps its own context rows."""
    from engine.kv_cache import RaggedKVCache

    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter, target = pair.drafter, pair.target
    _, feats = target(mx.array([list(range(5, 25))]))
    first = [drafter.open() for _ in range(4)]
    for n, s in zip((3, 5, 7, 9), first):
        drafter.commit(s, feats[0, :n])
    drafter.propose(first, [1, 1, 1, 1], [2, 2, 2, 2])  # rows exist now
    calls = []
    for name in ("filter", "extend_many"):
        real = getattr(RaggedKVCache, name)

        def counted(self, *args, _real=real, _name=name):
            calls.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(RaggedKVCache, name, counted)
    drafter.close(first[1])
    drafter.close(first[2])
    later = [drafter.open() for _ in range(3)]
    for s in later:
        drafter.commit(s, feats[0, :4])
    assert calls == []  # nothing copied yet: membership is only marked
    assert [s.context_rows for s in [first[0], first[3], *later]] == [3, 9, 0, 0, 0]
    layers = len(drafter.cache)
    assert sorted(calls) == ["extend_many"] * layers + ["filter"] * layers
    assert drafter.cache[0].batch_size == 5
    assert [s.pending_rows for s in later] == [4, 4, 4]


def test_cpu_kernels_give_the_same_block_outputs(drafter_dir):
    """The drafter on `engine.cpu_kernels` (the engine's choice on the CPU backend) equals
    MLX's attention and SwiGLU for ragged rows over two steps."""
    mx.random.seed(2)
    contexts = [
        [mx.random.normal((7, 128)), mx.random.normal((2, 128))],
        [mx.random.normal((3, 128)), mx.random.normal((5, 128))],
    ]
    blocks = [[mx.random.normal((8, 64)) for _ in range(2)] for _ in range(2)]
    stock, _ = _run_steps(load_dflash_model(drafter_dir), contexts, blocks, True)
    fast_model = load_dflash_model(drafter_dir)
    fast_model.use_cpu_kernels()
    fast, _ = _run_steps(fast_model, contexts, blocks, True)
    for a, b in zip(stock, fast):
        assert mx.allclose(a, b, atol=ATOL).item()
    assert not load_dflash_model(drafter_dir).layers[0].self_attn.cpu_kernels


def test_a_long_backlog_is_written_first_and_drafts_as_if_padded_with_the_rest(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """A proposal pads its rows' pending context to the longest: one request's prompt beside
    rows with a step's backlog is written by a forward of its own first, so the proposal runs
    3 x 2 context positions, not 3 x 200, and drafts the same tokens as one padded forward."""
    from drafters.dflash import drafter as drafter_module

    assert drafter_module.backlogs_to_write_first([2, 200, 1], ["a", "b", "c"]) == ["b"]
    assert drafter_module.backlogs_to_write_first([20, 24, 30], ["a", "b", "c"]) == []
    assert drafter_module.backlogs_to_write_first([], []) == []
    _, feats = load_pair(qwen3_target_dir, drafter_dir).target(
        mx.array([[3 + i % 40 for i in range(200)]])
    )

    def propose(split: bool):
        if not split:
            monkeypatch.setattr(drafter_module, "backlogs_to_write_first", lambda c, s: [])
        pair = load_pair(qwen3_target_dir, drafter_dir)
        drafter = pair.drafter
        sessions = [drafter.open() for _ in range(3)]
        for s, n in zip(sessions, (2, 200, 1)):
            drafter.commit(s, feats[0, :n])
        widths = []
        real_append = drafter.model.append_context

        def counted(features, counts, cache):
            widths.append(features.shape[:2])
            real_append(features, counts, cache)

        monkeypatch.setattr(drafter.model, "append_context", counted)
        out = drafter.propose(sessions, [7, 8, 9], [3, 3, 3])
        monkeypatch.undo()
        assert [s.context_rows for s in sessions] == [2, 200, 1]
        return out, widths

    split, split_widths = propose(True)
    padded, padded_widths = propose(False)
    assert split_widths == [(1, 200), (3, 2)] and padded_widths == [(3, 200)]
    assert split.tokens.tolist() == padded.tokens.tolist()
    assert mx.allclose(split.probs, padded.probs, atol=ATOL)
