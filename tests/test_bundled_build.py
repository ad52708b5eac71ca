"""The bundled pair's build stages on a small stand-in corpus: split, tokenizer, pretraining."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

from engine.bundled.pretrain import (
    PretrainConfig,
    TargetSize,
    is_held_out,
    pretrain_target,
    split_corpus,
    stdlib_files,
    train_tokenizer,
)
from engine.models.loading import load_target_model

TINY = TargetSize(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip


def _small_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "stdlib"
    real = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/__init__.py", "json/decoder.py", "abc.py", "bisect.py", "copy.py",
                 "colorsys.py", "keyword.py", "test/test_dummy.py"):  # fmt: skip
        source = real / name if (real / name).exists() else real / "abc.py"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, root / name)
    return root


def test_split_is_stable_and_excludes_tests(tmp_path):
    root = _small_stdlib(tmp_path)
    files = [str(p.relative_to(root)) for p in stdlib_files(root)]
    assert "test/test_dummy.py" not in files and "json/decoder.py" in files
    split = split_corpus(tmp_path / "work", root)
    assert sorted(split["train"] + split["held_out"]) == sorted(files)
    assert all(is_held_out(f) for f in split["held_out"])
    assert split_corpus(tmp_path / "work") == split  # resumes from corpus.json


def test_tokenizer_and_pretraining_resume_and_lower_the_loss(tmp_path):
    work = tmp_path / "work"
    split_corpus(work, _small_stdlib(tmp_path))
    train_tokenizer(work, vocab_size=320)
    logs: list[str] = []
    pretrain_target(work, TINY, PretrainConfig(steps=30, batch_size=4, seq_len=64,
                    learning_rate=3e-3, checkpoint_every=15), log=logs.append)  # fmt: skip
    state = json.loads((work / "pretrain" / "state.json").read_text())
    assert state["step"] == 30
    first, last = state["history"][0]["loss"], state["history"][-1]["loss"]
    assert last < first
    # a longer run resumes at the saved step instead of starting over
    logs.clear()
    pretrain_target(work, TINY, PretrainConfig(steps=32, batch_size=4, seq_len=64,
                    checkpoint_every=15), log=logs.append)  # fmt: skip
    assert any("resuming target pretraining at step 30/32" in line for line in logs)
    # the checkpoint is an mlx-lm model directory once the tokenizer sits beside it
    for file in (work / "tokenizer").iterdir():
        shutil.copy(file, work / "pretrain" / file.name)
    model, tokenizer = load_target_model(work / "pretrain")
    assert tokenizer.encode("def f(x):")


def test_workload_data_prompts_come_from_training_files_and_extend(tmp_path):
    from engine.bundled.pair import workload_data_prompts
    from engine.bundled.pretrain import read_files

    work = tmp_path / "work"
    split = split_corpus(work, _small_stdlib(tmp_path))
    few, more = workload_data_prompts(work, 6), workload_data_prompts(work, 12)
    assert len(more) == 12 and more[:6] == few  # a larger count extends the same list
    train_texts = [" ".join(text.split()) for text in read_files(split, "train")]
    for prompt in more:  # each prompt's opening words occur in a training file
        head = " ".join(prompt.removeprefix('"""').split()[:6])
        assert any(head in text for text in train_texts), head
    assert workload_data_prompts(work, 0) == []


def _card_facts(**overrides) -> dict:
    result = {"tau": 2.0, "spec_tok_s": 80.0, "mlx_lm_tok_s": 100.0, "speedup": 0.8}
    facts = {
        "python": "Python 3.x", "train_files": 10, "held_out_files": 2, "vocab_size": 4096,
        "train_tokens": 1000, "target_params": 1e6, "drafter_params": 1e5,
        "target": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, intermediate_size=64),
        "pretrain": dict(steps=5, batch_size=2, seq_len=8, learning_rate=1e-3, weight_decay=0.1),
        "pretrain_tokens": 80, "pretrain_minutes": 1.0, "train_loss": 3.0, "held_out_loss": 4.0,
        "drafter": dict(num_hidden_layers=1, block_size=16, target_layer_ids=[1],
                        mask_token_id=3),
        "data_prompts": 30, "data_tokens": 900, "drafter_steps": 20, "drafter_loss": 2.0,
        "drafter_acc": 0.5, "drafter_minutes": 2.0, "eval_prompts": 2, "eval_max_tokens": 8,
        "drafter_runs": [{"steps": 10, "data_prompts": 20},
                         {"steps": 20, "data_prompts": 20, "workload_data_prompts": 10}],
        "eval": {"completion": result, "prose": dict(result, tau=3.0)},
    }  # fmt: skip
    facts.update(overrides)
    return facts


def test_model_card_lists_every_sitting_and_the_short_depth_table(tmp_path):
    from engine.bundled.pair import write_model_card

    short = {"short_depth": 3, "short_tau": 1.5, "short_tok_s": 95.0, "short_speedup": 0.95}
    facts = _card_facts()
    facts["eval"] = {name: dict(r, **short) for name, r in facts["eval"].items()}
    write_model_card(tmp_path, facts, tmp_path / "card.md")
    card = (tmp_path / "card.md").read_text()
    assert "--data-prompts 20 --drafter-steps 10\n" in card
    assert "--data-prompts 20 --workload-data-prompts 10 --drafter-steps 20\n" in card
    assert "20 random cuts of the training files and 10 prompts in the workloads' formats" in card
    assert "| completion | 2.00 | 80.0 | 100.0 | 0.80x | 2.5 |" in card
    assert "At depth 3 (the drafter runs 4 block rows" in card
    assert "block 16 pays only where tau clears that (no workload here)" in card
    assert "| prose | 1.50 | 95.0 | 0.95x |" in card

    write_model_card(tmp_path, _card_facts(drafter_runs=[{"steps": 20, "data_prompts": 30}]),
                     tmp_path / "old.md")  # fmt: skip
    old = (tmp_path / "old.md").read_text()  # an eval without the short depth: no such table
    assert "At depth" not in old and "30 prompts cut from the training files" in old
