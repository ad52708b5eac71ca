"""Drafter data for chat targets: the prompt mix and batched generation through the engine."""

from __future__ import annotations

import asyncio
import json
import random

from drafters.dflash import datagen
from drafters.dflash.prompt_mix import (
    _THIRD_TOPICS,
    KINDS,
    Prompt,
    build_prompts,
    chat_prompts,
    editing_prompts,
    held_out,
    more_chat_prompts,
)
from engine.bundled.pair import bundled_paths

SOURCE = '''
def scale(values, factor):
    """Multiply every value by factor."""
    out = []
    for v in values:
        if v == 0:
            out.append(0)
        out.append(v * factor)
    return out
'''


def test_held_out_prompts_cover_every_kind_and_are_deterministic():
    first = build_prompts("held_out", per_kind=6, seed=3)
    again = build_prompts("held_out", per_kind=6, seed=3)
    assert first == again
    assert {p.kind for p in first} == set(KINDS)
    # A larger count extends the same lists, so a data run can grow without redoing work.
    longer = build_prompts("held_out", per_kind=9, seed=3)
    for kind in KINDS:
        short = [p for p in first if p.kind == kind]
        assert [p for p in longer if p.kind == kind][: len(short)] == short


def test_chat_prompts_split_by_text_hash():
    prompts = chat_prompts()
    held = [p for p in prompts if held_out(p.text)]
    assert 0 < len(held) < len(prompts) // 5
    train_texts = {p.text for p in build_prompts("train", per_kind=0)} | {
        p.text for p in prompts if not held_out(p.text)
    }
    assert not train_texts & {p.text for p in held}


def test_later_chat_tiers_come_after_the_earlier_so_earlier_lists_keep_their_prefix():
    tiers = [
        {p.text for p in chat_prompts()},
        {p.text for p in more_chat_prompts()},
        {p.text for p in more_chat_prompts(_THIRD_TOPICS)},
    ]
    assert not tiers[0] & tiers[1] and not tiers[0] & tiers[2] and not tiers[1] & tiers[2]
    chat = [p for p in build_prompts("held_out", per_kind=10_000) if p.kind == "chat"]
    tier_of = [next(i for i, tier in enumerate(tiers) if p.text in tier) for p in chat]
    assert tier_of == sorted(tier_of) and set(tier_of) == {0, 1, 2}


def test_editing_prompts_carry_the_function_and_plant_real_bugs():
    prompts = editing_prompts(SOURCE, random.Random(0), per_function=8)
    assert all(p.chat and "def scale" in p.text for p in prompts)
    bug = [p for p in prompts if "has a bug" in p.text]
    assert bug and " != 0" in bug[0].text  # the flipped comparison is in the code shown


def test_generate_mix_equals_greedy_decoding_and_resumes(tmp_path):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    target_dir, _ = bundled_paths()
    prompts = [
        Prompt("completion", "def add(a, b):\n", chat=False),
        Prompt("chat", "Write a loop.", chat=True),
        Prompt("prose", "Continue this text:\n\nThe module", chat=True),
    ]
    out = tmp_path / "data.jsonl"
    written = asyncio.run(datagen.generate_mix(str(target_dir), prompts, out, max_tokens=6,
                                               concurrency=2))  # fmt: skip
    assert written == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["key"] for r in records} == {p.key for p in prompts}

    model, tokenizer = load(str(target_dir))
    model.set_dtype(mx.float32)
    for record in records:
        prompt_ids = record["tokens"][: record["prompt_tokens"]]
        expected = [
            int(tok) for (tok, _), _ in zip(generate_step(mx.array(prompt_ids), model), range(6))
        ]
        continuation = record["tokens"][record["prompt_tokens"] :]
        assert continuation == expected[: len(continuation)]

    # A second run finds every prompt done and writes nothing.
    again = asyncio.run(datagen.generate_mix(str(target_dir), prompts, out, max_tokens=6))
    assert again == 0
    assert len(out.read_text().splitlines()) == 3


def test_drafter_build_stages_end_to_end_on_the_bundled_target(tmp_path):
    """data -> fit -> eval -> export -> card, each recorded as a sitting; a second fit resumes."""
    from drafters.dflash import build
    from drafters.dflash.checkpoint import read_config
    from drafters.dflash.vocab import read_draft_vocab

    work, dest = tmp_path / "work", tmp_path / "drafter"
    common = ["--target", "bundled", "--work-dir", str(work), "--per-kind", "1",
              "--concurrency", "4", "--layers", "1", "--block-size", "4", "--batch-size", "1",
              "--num-anchors", "4", "--max-len", "256", "--feature-cache-mb", "64",
              "--draft-vocab", "512"]  # fmt: skip
    build.main([*common, "--stages", "data,fit", "--steps", "2"])
    facts = build.data_facts(work)
    assert facts["records"] == 4 and set(facts["by_kind"]) == set(KINDS)
    build.main([*common, "--stages", "fit,eval,export,card", "--steps", "3",
                "--eval-prompts", "1", "--eval-max-tokens", "8", "--eval-depth", "3",
                "--export-dir", str(dest)])  # fmt: skip
    sittings = json.loads((work / "sittings.json").read_text())
    assert [s["stage"] for s in sittings] == ["data", "fit", "fit", "eval", "export"]
    assert sittings[2]["steps"] == 3  # resumed from step 2, not restarted
    assert read_config(dest).block_size == 4
    card = (dest / "MODEL_CARD.md").read_text()
    assert "python -m drafters.dflash.build --target bundled" in card
    assert "512 of the target's 4096 LM-head rows" in card
    assert len(read_draft_vocab(dest)) == 512  # exported beside the weights
    evaluated = json.loads((work / "eval.json").read_text())["results"]
    assert set(evaluated) == set(KINDS) and all(r["tau"] >= 1.0 for r in evaluated.values())
    assert all(0.0 < r["vocab_coverage"] <= 1.0 for r in evaluated.values())


def test_build_data_with_keep_features_keeps_one_sidecar_a_record(tmp_path, monkeypatch):
    """`build --stages data --keep-features DRAFTER`: every record's features are kept in the
    campaign's sidecar folder, at DRAFTER's taps."""
    from drafters.dflash import build

    _, drafter_dir = bundled_paths()
    monkeypatch.setattr(build, "sidecar_dir", lambda target: tmp_path / "side")
    build.main(["--target", "bundled", "--work-dir", str(tmp_path / "work"), "--per-kind", "1",
                "--concurrency", "4", "--stages", "data",
                "--keep-features", str(drafter_dir)])  # fmt: skip
    assert build.data_facts(tmp_path / "work")["records"] == 4
    assert len(list((tmp_path / "side").glob("*.npz"))) == 4


def test_a_fit_stopped_by_hand_is_recorded_as_a_sitting(tmp_path, monkeypatch):
    """Ctrl-C during `fit` keeps the last checkpoint and still records the sitting (with the
    step it reached), so the card lists every sitting's command."""
    from drafters.dflash import build, train

    work = tmp_path / "work"
    work.mkdir()
    record = {"key": "k", "kind": "prose", "prompt": "p", "chat": False, "prompt_tokens": 4,
              "tokens": list(range(10, 60))}  # fmt: skip
    (work / "data.jsonl").write_text(json.dumps(record) + "\n")
    real_save = train.save_checkpoint

    def save_then_stop(model, optimizer, step, config, draft_vocab=None):
        real_save(model, optimizer, step, config, draft_vocab)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_checkpoint", save_then_stop)
    build.main(["--target", "bundled", "--work-dir", str(work), "--stages", "fit", "--steps", "5",
                "--layers", "1", "--block-size", "4", "--batch-size", "1", "--num-anchors", "4",
                "--max-len", "64"])  # fmt: skip
    (sitting,) = json.loads((work / "sittings.json").read_text())
    assert sitting["stage"] == "fit" and sitting["steps"] == 5 and "interrupted" in sitting["note"]


def test_a_data_run_stopped_by_sigterm_is_recorded_as_a_sitting(tmp_path, monkeypatch):
    """SIGTERM (how a background job is stopped) ends the data stage as Ctrl-C does: what was
    written stays, and the sitting is recorded with the records it wrote."""
    import os
    import signal

    from drafters.dflash import build, datagen

    work = tmp_path / "work"

    async def write_one_then_get_stopped(target, prompts, out_path, **kwargs):
        record = {"key": prompts[0].key, "kind": prompts[0].kind, "prompt": prompts[0].text,
                  "chat": prompts[0].chat, "prompt_tokens": 2, "tokens": [5, 6, 7]}  # fmt: skip
        with open(out_path, "a") as out:
            out.write(json.dumps(record) + "\n")
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(5)  # interrupted before this ends
        raise AssertionError("SIGTERM did not stop the stage")

    monkeypatch.setattr(datagen, "generate_mix", write_one_then_get_stopped)
    handler = signal.getsignal(signal.SIGTERM)
    build.main(["--target", "bundled", "--work-dir", str(work), "--stages", "data",
                "--per-kind", "1"])  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) == handler  # the caller's handler is back
    (sitting,) = json.loads((work / "sittings.json").read_text())
    assert sitting["stage"] == "data" and sitting["records_written"] == 1
    assert "stopped by hand" in sitting["note"]
    assert len((work / "data.jsonl").read_text().splitlines()) == 1


def test_a_base_model_without_a_chat_template_gets_chat_prompts_as_text():
    """`bench run --target gemma-3-270m` (a base model, no template) encodes the mix's chat
    prompts as plain text instead of failing in transformers."""
    from drafters.dflash.datagen import encode
    from drafters.dflash.prompt_mix import Prompt

    class BaseTokenizer:
        chat_template = None

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("no template to apply")

    prompt = Prompt(kind="chat", text="Hi", chat=True)
    assert encode(BaseTokenizer(), prompt) == [ord("H"), ord("i")]


def test_prompts_go_window_by_window_shortest_first_and_all_go_once():
    """Rows decoding together get contexts of similar length, while the mix's order holds
    from one window to the next (a run stopped early keeps every kind's share)."""
    prompts = [Prompt("chat", "x" * n, chat=False) for n in (5, 1, 9, 3, 7, 2, 8)]
    made: list[str] = []

    def ids_of(prompt: Prompt) -> list[int]:
        made.append(prompt.text)
        return [0] * len(prompt.text)

    source = datagen.shortest_first_by_window(prompts, ids_of, 3)
    first = [next(source) for _ in range(3)]
    assert [len(ids) for _, ids in first] == [1, 5, 9]  # the first window, shortest first
    assert len(made) == 3  # ids are made a window at a time, as they are reached
    rest = list(source)
    assert [len(ids) for _, ids in rest] == [2, 3, 7, 8]
    assert sorted(p.text for p, _ in first + rest) == sorted(p.text for p in prompts)
    in_order = datagen.shortest_first_by_window(prompts, ids_of, 1)
    assert [p for p, _ in in_order] == prompts


def test_records_keep_the_features_and_top_k_the_feature_pass_would_compute(tmp_path):
    """Data generation with `features_dir` keeps, per record, what the campaign's feature pass
    computes for it: the drafter's tapped features of every position but the last, and the
    target's top-k next-token log-probabilities (from the forwards that generated it), for the
    record cut to `max_len` as the campaign cuts it. A store over the cut records then copies
    them all and runs the target over none."""
    import numpy as np
    import pytest

    from drafters.dflash import features as feature_store
    from drafters.dflash.features import FeatureSidecar, FeatureStore
    from engine.models.loading import load_pair

    target_dir, drafter_dir = bundled_paths()
    prompts = [
        Prompt("completion", "def add(a, b):\n", chat=False),
        Prompt("editing", SOURCE, chat=False),
        Prompt("prose", "The module begins with", chat=False),
        Prompt("completion", "class Stack:\n    def push(self, x):\n", chat=False),
    ]
    side = tmp_path / "sidecar"
    written = asyncio.run(datagen.generate_mix(
        str(target_dir), prompts, tmp_path / "data.jsonl", max_tokens=12, concurrency=3,
        features_dir=side, drafter=drafter_dir, top_k=8, max_len=40,
    ))  # fmt: skip
    assert written == len(prompts)
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    tokens = [np.array(r["tokens"][:40], dtype=np.int32) for r in records]
    cut = [len(r["tokens"]) > 40 for r in records]
    assert any(cut) and not all(cut)
    target = load_pair(target_dir, drafter_dir).target  # tapped as the drafter reads
    sidecar = FeatureSidecar(side, str(target_dir), target.layer_ids, 8)
    reference = FeatureStore.build(target, tokens, tmp_path / "ref", str(target_dir), top_k=8)
    for i, seq in enumerate(tokens):
        features, top_ids, top_logp = sidecar.read(seq, reference.width)
        want_ids, want_logp = reference.top(i)
        # A cut record's last rows are real (its whole record went on); an uncut one's last
        # position never went through the target, and its top-k would predict past the end.
        rows = slice(None) if cut[i] else slice(None, -1)
        np.testing.assert_allclose(features[rows], np.array(reference.get(i))[0, rows],
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        np.testing.assert_array_equal(top_ids[rows, 0], want_ids[rows, 0])
        np.testing.assert_allclose(top_logp[rows], want_logp[rows], atol=2e-3)
        assert cut[i] or not top_ids[-1].any()

    def never(*args):
        raise AssertionError("a batch computed although the sidecar held every sequence")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(feature_store, "_write_batch", never)
        store = FeatureStore.build(target, tokens, tmp_path / "new", str(target_dir), top_k=8,
                                   sidecar=sidecar)  # fmt: skip
    assert len(store) == len(tokens) and not list(side.glob("*.npz"))


def test_sidecar_rows_need_one_feature_row_and_one_log_prob_entry_a_position():
    import numpy as np

    from engine.step.logprobs import TokenLogprob

    entry = TokenLogprob(5, -0.1, [(5, -0.1), (6, -2.5)])
    features = np.ones((2, 4), dtype=np.float32)
    rows = datagen.sidecar_rows([1, 5, 5], features, [None, entry, entry], top_k=2)
    assert rows is not None
    padded, ids, logp = rows
    assert padded.shape == (3, 4) and not padded[2].any() and ids.tolist()[:2] == [[5, 6]] * 2
    assert datagen.sidecar_rows([1, 5, 5], features[:1], [None, entry, entry], 2) is None
    # A draft accepted past the request's end: the cache held more; the record's rows are kept.
    longer = np.arange(16, dtype=np.float32).reshape(4, 4)
    kept, _, _ = datagen.sidecar_rows([1, 5, 5], longer, [None, entry, entry], 2)
    np.testing.assert_array_equal(kept, longer[:3])
    assert datagen.sidecar_rows([1, 5, 5], features, [None, entry], 2) is None
    assert datagen.sidecar_rows([1, 5, 5], features, [None, entry, entry], 3) is None


def test_keep_features_needs_dflash_served():
    import pytest

    from engine.config import EngineConfig

    target_dir, drafter_dir = bundled_paths()
    with pytest.raises(ValueError, match="keep_features"):
        EngineConfig(target=str(target_dir), keep_features=True).validate()
    EngineConfig(target=str(target_dir), drafter=str(drafter_dir), keep_features=True).validate()
