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
from engine.loading import load_target_model

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
