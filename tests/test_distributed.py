"""Distributed mode on this machine: two ranks started by `mlx.launch -n 2 --backend ring` on
loopback, compared with the single-process engine token for token.

- the bundled pair, tensor parallel (its 6 query / 2 KV heads split over 2 ranks), DFlash and
  lookup drafting apart, at concurrency 1 and 8, greedy and seeded sampling;
- the bundled pair, pipeline parallel, both sources, with aborts and a drain;
- SmolLM2 (9 / 3 heads: tensor parallel cannot split it over 2 ranks), pipeline parallel, with
  its shipped DFlash drafter and lookup;
- over HTTP with the official `openai` client; and killing rank 1 mid-stream gives 503s and a
  non-zero exit of rank 0 well within 30 s.

Each scenario is `tests/distributed_scenario.py`, run once under mlx.launch and once alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from factories import wait_until_ready

from engine.bundled.pair import bundled_paths
from engine.bundled.workloads import load_workloads

SCENARIO = Path(__file__).with_name("distributed_scenario.py")
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which(
    "mlx.launch"
)
TARGET, DRAFTER = bundled_paths()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A free port p with p + 1 free too, neither in `avoid`: the ring backend listens on one
    port a rank from p up, so a free p alone may leave rank 1 a port that is taken."""
    while True:
        first = _free_port()
        if first in avoid or first + 1 in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", first + 1))
            except OSError:
                continue
        return first


def _launch_command(*command: str, avoid: tuple[int, ...] = ()) -> list[str]:
    """`mlx.launch -n 2 --backend ring` on loopback, on ports no other test holds (nor
    `avoid`: a server's port, chosen but not yet bound)."""
    return [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port",
            str(_free_port_pair(avoid)), "--", *command]  # fmt: skip


def _scenario(spec: dict, tmp_path: Path, distributed: bool) -> tuple[dict, str]:
    name = f"{spec.get('parallel') or 'single'}-{'dist' if distributed else 'alone'}"
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec if distributed else {**spec, "parallel": None}))
    command = [sys.executable, str(SCENARIO), str(spec_path), str(out_path)]
    if distributed:
        command = _launch_command(*command)
    run = subprocess.run(command, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0 and out_path.exists(), log[-4000:]
    return json.loads(out_path.read_text()), log


def _tokens(round_: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in round_]


def _drafted(result: dict, source: str) -> int:
    return sum(r["drafted"].get(source, 0) for key in ("c1", "c8") for r in result[key])


def _bundled_prompts(count: int = 8) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    workloads = load_workloads()
    texts = [t for pair in zip(workloads["editing"], workloads["completion"]) for t in pair]
    return [list(tokenizer.encode(t[-300:])) for t in texts[:count]]


def _compare(spec: dict, tmp_path: Path, sources: list[str]) -> tuple[dict, str]:
    alone, _ = _scenario(spec, tmp_path, distributed=False)
    sharded, log = _scenario(spec, tmp_path, distributed=True)
    for key in ("c1", "c8", "seeded"):
        if key in alone:
            assert _tokens(sharded[key]) == _tokens(alone[key]), key
    for source in sources:  # the sharded run did draft from it (else the test proves little)
        assert _drafted(sharded, source) > 0, (source, sharded)
    assert "rank 1: stopped by rank 0" in log, log[-3000:]
    assert re.search(r"rank 1: stopped by rank 0 after \d+ calls; rows left 0, kv bytes 0", log)
    assert sharded["rows_left"] == 0 and sharded["kv_bytes_left"] == 0
    return sharded, log


@pytest.mark.parametrize("source", ["dflash", "lookup"])
def test_bundled_tensor_parallel_equals_one_process(tmp_path, source):
    spec = {"target": str(TARGET), "drafter": str(DRAFTER), "parallel": "tensor",
            "draft_sources": [source], "num_speculative_tokens": 4,
            "prompts": _bundled_prompts(), "max_tokens": 20,
            "seeded": source == "dflash"}  # fmt: skip
    _, log = _compare(spec, tmp_path, [source])
    assert "tensor parallel" in log


def test_bundled_pipeline_parallel_with_aborts_and_drain(tmp_path):
    spec = {"target": str(TARGET), "drafter": str(DRAFTER), "parallel": "pipeline",
            "draft_sources": ["dflash", "lookup"], "num_speculative_tokens": 4,
            "prompts": _bundled_prompts(), "max_tokens": 16, "abort": True}  # fmt: skip
    sharded, _ = _compare(spec, tmp_path, ["dflash"])
    reasons = sharded["aborted"]
    assert sorted(reasons) == [str(i) for i in range(8)]
    assert {reasons[str(i)] for i in range(1, 8, 2)} == {"abort"}
    assert {reasons[str(i)] for i in range(0, 8, 2)} == {"length"}


def test_smollm2_pipeline_parallel_equals_one_process(tmp_path):
    from engine.models.pull import pull
    from engine.models.registry import DEFAULT_MODEL
    from engine.models.resolve import default_drafter

    converted = pull(DEFAULT_MODEL)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a list."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    texts = ["def fibonacci(n):", "The three primary colors are",
             "import json\n\ndef load_config(path):\n    with open(path) as f:\n"]  # fmt: skip
    prompts = [list(chat)] + [list(tokenizer.encode(t)) for t in texts]
    prompts = prompts + prompts  # 8 at once
    spec = {"target": str(converted), "drafter": str(default_drafter(DEFAULT_MODEL)),
            "parallel": "pipeline", "draft_sources": ["dflash", "lookup"],
            "num_speculative_tokens": 4, "prompts": prompts, "max_tokens": 16,
            "seeded": True}  # fmt: skip
    _compare(spec, tmp_path, ["dflash"])


# ----------------------------------------------------------------------------- HTTP
class LaunchedServer:
    """`mlx.launch -n 2 --backend ring -- flashbatch serve --parallel ...` on loopback."""

    # Two ranks load the model and run the warm-up profile on 2 shared cores: 300 s leaves room
    # for a loaded host (a CI run once gave up at 120 s; its cause went unseen, since text()
    # then failed on the closed log, and the error now shows the log).
    def __init__(self, *extra: str, ready_timeout: float = 300.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        serve = [sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port),
                 "--log-level", "info", *extra]  # fmt: skip
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"launched-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.process = subprocess.Popen(
            _launch_command(*serve, avoid=(self.port,)), stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )  # fmt: skip
        if wait_until_ready(self.url, self.process, ready_timeout):
            return
        self.stop()
        raise RuntimeError("distributed server did not become ready:\n" + self.text())

    def text(self) -> str:
        if not self.log.closed:  # after stop() the file is closed, and its text is all there
            self.log.flush()
        return self.log_path.read_text()

    def follower_pid(self) -> int:
        match = re.search(r"rank 1 pid (\d+)", self.text())
        assert match, self.text()[-3000:]
        return int(match.group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def _single_server_answers(prompt: str, chat: list[dict]) -> tuple:
    port = _free_port()
    command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port),
               "--log-level", "warning", "--target", str(TARGET), "--drafter", str(DRAFTER),
               "--num-speculative-tokens", "4"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until_ready(url, process, 180), "the single-process server did not start"
        return _answers(url, prompt, chat)
    finally:
        process.kill()
        process.wait()


def _answers(url: str, prompt: str, chat: list[dict]) -> tuple:
    """A completion, a streamed chat answer, then 8 completions at once (threads)."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="target", messages=chat, max_tokens=24,
                                            temperature=0, stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def one(text: str) -> str:
        answer = client.completions.create(model="target", prompt=text, max_tokens=16,
                                           temperature=0)  # fmt: skip
        return answer.choices[0].text

    texts = [t[-200:] for t in load_workloads()["completion"][:8]]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, texts))
    return done.choices[0].text, streamed, together


def test_openai_client_over_a_tensor_parallel_server_then_rank_1_dies():
    chat = [{"role": "user", "content": "def add(a, b):"}]
    prompt = "import numpy as np\n\ndef mean(values):"
    expected = _single_server_answers(prompt, chat)
    # Adaptive depth here (the default): the warm-up profile and the controller run sharded,
    # and greedy output is the same at any depth.
    server = LaunchedServer("--target", str(TARGET), "--drafter", str(DRAFTER),
                            "--parallel", "tensor")  # fmt: skip
    try:
        assert _answers(server.url, prompt, chat) == expected
        metrics = httpx.get(server.url + "/metrics").text
        assert "flashbatch_distributed_ranks" in metrics

        # A long stream, then rank 1 dies under it.
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="target", prompt=prompt, max_tokens=4000,
                                           temperature=0, stream=True)  # fmt: skip
        pieces = []
        killed_at = None
        with pytest.raises(openai.APIError):
            for chunk in stream:
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                if len(pieces) == 5:
                    os.kill(server.follower_pid(), signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None
        # New requests: 503 (or the server already gone), never a 200.
        try:
            body = {"model": "target", "prompt": "hi", "max_tokens": 4}
            late = httpx.post(server.url + "/v1/completions", json=body, timeout=5)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "service_unavailable"
        except httpx.TransportError:
            pass
        server.process.wait(timeout=30)
        assert time.monotonic() - killed_at < 30
        assert re.search(r"rank 0 exited with code 1", server.text()), server.text()[-3000:]
    finally:
        server.stop()


def test_sigterm_drains_rank_0_then_stops_every_rank():
    server = LaunchedServer("--target", str(TARGET), "--drafter", str(DRAFTER),
                            "--parallel", "pipeline", "--num-speculative-tokens", "4")  # fmt: skip
    try:
        leader = int(re.search(r"rank 0 pid (\d+)", server.text()).group(1))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="target", prompt="def add(a, b):",
                                           max_tokens=64, temperature=0, stream=True)  # fmt: skip
        reasons, pieces = [], 0
        for chunk in stream:
            pieces += 1
            if pieces == 3:  # mid-stream, as a supervisor would
                os.kill(leader, signal.SIGTERM)
                os.kill(server.follower_pid(), signal.SIGTERM)
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert reasons == ["length"]  # drained: the answer completed
        server.process.wait(timeout=60)
        text = server.text()
        assert re.search(r"rank 1: stopped by rank 0 after \d+ calls; rows left 0, kv bytes 0",
                         text), text[-3000:]  # fmt: skip
        assert "exited with code" not in text and "was killed" not in text, text[-3000:]
    finally:
        server.stop()


# ----------------------------------------------------------------------------- refusals
def test_refusals_say_why_and_what_works():
    import mlx.core as mx  # noqa: F401
    from mlx_lm.models import llama

    from engine.distributed.group import DistributedError, Group, ShardingError
    from engine.distributed.pipeline import blocks, shard_pipeline
    from engine.distributed.sharding import tensor_reason

    smollm2_shaped = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=72, num_hidden_layers=3, intermediate_size=96,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=64,
    ))  # fmt: skip
    from mlx_lm.models import qwen3_moe

    moe = qwen3_moe.Model(qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=128, norm_topk_prob=True,
    ))  # fmt: skip
    assert "covers llama, qwen2 and qwen3" in tensor_reason(moe, 2)
    reason = tensor_reason(smollm2_shaped, 2)
    assert "9 query / 3 KV heads" in reason and "[1, 3]" in reason and "pipeline" in reason
    assert tensor_reason(smollm2_shaped, 3) is None
    assert [list(b) for b in blocks(30, 2)] == [list(range(15)), list(range(15, 30))]
    assert [len(b) for b in blocks(7, 3)] == [3, 2, 2]
    with pytest.raises(ShardingError, match="cannot be split"):
        blocks(1, 2)

    class NotPacked:  # a family outside the packed forward's
        __module__ = "mlx_lm.models.gemma3_text"

    with pytest.raises(ShardingError, match="llama, qwen2 and qwen3"):
        shard_pipeline(NotPacked(), Group(group=None))
    if not any(v in os.environ for v in ("MLX_RANK", "MLX_HOSTFILE")):
        with pytest.raises(DistributedError, match="mlx.launch"):
            Group.init()


def test_serve_parallel_without_mlx_launch_is_a_clear_error():
    run = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--target", str(TARGET), "--parallel",
         "tensor"], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLX_")},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "mlx.launch -n 2" in run.stderr


def test_broadcast_object_small_and_past_the_first_collective(tmp_path):
    """A plan fits the first collective; admissions with long prompts take a second one."""
    script = tmp_path / "broadcast.py"
    script.write_text(
        "import sys\n"
        "from engine.distributed.group import FIRST_BYTES, Group\n"
        "g = Group.init()\n"
        "objects = [None, ('call', 'execute', ({'a': 1},), {}), list(range(20000)),\n"
        "           b'x' * (FIRST_BYTES - 40), 'y' * (3 * FIRST_BYTES)]\n"
        "for obj in objects:\n"
        "    got = g.broadcast_object(obj if g.leader else None)\n"
        "    assert got == obj, (g.rank, type(obj))\n"
        "print(f'rank {g.rank} ok', flush=True)\n"
    )
    run = subprocess.run(_launch_command(sys.executable, str(script)), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    log = run.stdout + run.stderr
    assert "rank 0 ok" in log and "rank 1 ok" in log, log[-3000:]


def _stop_follower_mid_stream(*, sigterm_leader: bool) -> str:
    """A tensor-parallel server with a 4 s rank timeout streams; 5 chunks in, rank 1 is
    stopped (alive, but silent), with rank 0 sent SIGTERM at once if asked. Rank 0 must exit
    with code 1 within 30 s; returns the launcher's log."""
    server = LaunchedServer("--target", str(TARGET), "--parallel", "tensor",
                            "--num-speculative-tokens", "0", "--rank-timeout", "4")  # fmt: skip
    leader = int(re.search(r"rank 0 pid (\d+)", server.text()).group(1))
    follower = server.follower_pid()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="target", prompt="def add(a, b):",
                                           max_tokens=4000, temperature=0, stream=True)  # fmt: skip
        stopped_at = None
        with pytest.raises(openai.APIError):
            for count, _ in enumerate(stream):
                if count == 5:
                    os.kill(follower, signal.SIGSTOP)
                    if sigterm_leader:
                        os.kill(leader, signal.SIGTERM)
                    stopped_at = time.monotonic()
        assert stopped_at is not None
        deadline = stopped_at + 30
        while time.monotonic() < deadline and "rank 0 exited with code 1" not in server.text():
            time.sleep(0.2)
        log = server.text()
        assert "rank 0 exited with code 1" in log, log[-3000:]
        assert time.monotonic() - stopped_at < 30
        return log
    finally:
        try:
            os.kill(follower, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


def test_a_rank_that_stops_answering_trips_the_rank_timeout():
    log = _stop_follower_mid_stream(sigterm_leader=False)
    assert "did not answer within 4 s" in log


def test_a_rank_lost_during_a_drain_still_ends_rank_0_non_zero():
    """mlx.launch sends SIGTERM to rank 0 as soon as another rank dies, so rank 0 is often
    draining when its step fails. The drain then ends at once and uvicorn returns before the
    delayed exit runs, while the MLX thread is still inside a collective no rank will finish:
    an ordinary interpreter exit would join that thread forever (it hung here before)."""
    _stop_follower_mid_stream(sigterm_leader=True)


def test_a_target_the_ranks_cannot_shard_fails_every_rank_with_the_reason():
    from engine.models.pull import pull
    from engine.models.registry import DEFAULT_MODEL

    port = _free_port()
    serve = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--target",
             str(pull(DEFAULT_MODEL)), "--parallel", "tensor"]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(_launch_command(*serve), capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert "9 query / 3 KV heads" in log and "use --parallel pipeline" in log, log[-3000:]
    assert re.search(r"rank [01] exited with code [12]", log), log[-3000:]
    assert time.monotonic() - started < 120
