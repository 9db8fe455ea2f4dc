"""Third-party clients against the real `v4serve up --model tiny` (Ray, Valkey, the router in its
own process), as a user runs them: they name the served model and load the tokenizer from the
model directory (its `tokenizer.json`).

- guidellm: a short synthetic benchmark over /v1/chat/completions (streamed, with vLLM's
  `continuous_usage_stats`): every request completes, none errors.
- lm-eval `local-completions`: a generation task of a few examples written here, in batches
  (one /v1/completions request holds several token-id prompts): every example answered, no error.
- lm-eval `local-completions` on a small multiple-choice task (`loglikelihood/`: its YAML and
  jsonl): every choice scored through echo with prompt logprobs, each loglikelihood equal to the
  model's own (the same checkpoint run here, log-softmax over its logits) to 1e-4.

The clients come from the `clients` extra (`scripts/setup_env.sh test,clients`); without them
this module is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # starts Ray; the module takes about a minute

pytest.importorskip("guidellm")
pytest.importorskip("lm_eval")
pytest.importorskip("nixl")

BIN = Path(sys.executable).parent


class Up:
    """`v4serve up --model tiny` as a subprocess; parses its ready line."""

    def __init__(self, cache: Path):
        env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
        self.model_dir = cache / "v4serve" / "tiny-model"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "up", "--model", "tiny", "--http-port", "0", "--grpc-port", "0",
             "--cluster", f"clients-{os.getpid()}", "--max-model-len", "1024"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        deadline = time.time() + 180
        for line in self.proc.stdout:
            if line.startswith("v4serve ready"):
                self.http = dict(f.split("=", 1) for f in line.split() if "=" in f)["http"]
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep the pipe drained
                break
            assert time.time() < deadline, "v4serve up did not become ready"
        else:
            raise AssertionError(f"v4serve up exited with {self.proc.wait()}")
        self.model = httpx.get(self.http + "/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        psutil.wait_procs(children, timeout=20)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    server = Up(tmp_path_factory.mktemp("cache"))
    yield server
    server.stop()


def test_guidellm_benchmark_has_no_errors(up, tmp_path):
    assert up.model == "tiny-model" and (up.model_dir / "tokenizer.json").is_file()
    requests, out = 8, tmp_path / "guidellm.json"
    run = subprocess.run(
        [str(BIN / "guidellm"), "run", "--disable-console-interactive",
         "--backend", f"kind=openai_http,target={up.http},model={up.model}",
         "--tokenizer", f"kind=huggingface_auto,model={up.model_dir}",
         "--profile", "kind=concurrent,streams=4",
         "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
         "--constraint", f"kind=max_requests,count={requests}", "--output", f"kind=json,path={out}"],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    done = bench["requests"]
    errors = [r.get("error") for r in done["errored"] + done["incomplete"]]
    assert not errors, errors[:3]
    assert len(done["successful"]) == requests
    # ignore_eos: every request streamed exactly the output tokens asked for, counted by the usage
    assert {r["output_metrics"]["text_tokens"] for r in done["successful"]} == {16}, done["successful"][0]


TASK = """task: v4serve_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_local_completions_generation_task(up, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1)]]
    (tasks / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "sums.yaml").write_text(TASK.format(data=tasks / "sums.jsonl"))
    args = (f"model={up.model},base_url={up.http}/v1/completions,tokenizer={up.model_dir},"
            "tokenizer_backend=huggingface,max_retries=1")
    run = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "local-completions", "--model_args", args, "--batch_size", "3",
         "--tasks", "v4serve_sums", "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
         "--log_samples"],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples,) = (tmp_path / "out").glob("*/samples_v4serve_sums_*.jsonl")
    got = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(s["target"] for s in got) == sorted(r["answer"] for r in rows)
    # a random-weight model's answers are noise, but each is the server's generation, not an error
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in got), [s["resps"] for s in got]


LOGLIKELIHOOD_TASK = Path(__file__).parent / "loglikelihood"  # v4serve_choices.yaml + choices.jsonl


def own_loglikelihoods(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """Each continuation's log-probability after its context, from the model itself: tokenized as
    lm-eval does (trailing spaces of the context moved to the continuation, the whole encoded and
    split after the context's tokens) and scored by the log-softmax of the logits at every position."""
    from tokenizers import Tokenizer

    from model.batch import ForwardBatch
    from model.checkpoint import load_checkpoint
    from model.kv_pool import KVPools, SeqKV

    cfg, model = load_checkpoint(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tok.encode(context + continuation, add_special_tokens=False).ids
        n = len(tok.encode(context, add_special_tokens=False).ids)
        pools, seq = KVPools(cfg, "fp32", max_tokens=len(whole), max_seqs=1), SeqKV()
        pools.reserve(seq, len(whole))
        logits = model(ForwardBatch.build([(seq, whole)]), pools, all_logits=True)
        lp = torch.log_softmax(logits.double(), -1)
        out.append(sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole))))
    return out


def test_lm_eval_local_completions_loglikelihood_task(up, tmp_path):
    args = (f"model={up.model},base_url={up.http}/v1/completions,tokenizer={up.model_dir},"
            "tokenizer_backend=huggingface,max_retries=1")
    run = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "local-completions", "--model_args", args, "--batch_size", "4",
         "--tasks", "v4serve_choices", "--include_path", str(LOGLIKELIHOOD_TASK), "--output_path",
         str(tmp_path / "out"), "--log_samples"],
        check=False, capture_output=True, text=True, timeout=300, cwd=LOGLIKELIHOOD_TASK,  # the YAML's data path
        env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples,) = (tmp_path / "out").glob("*/samples_v4serve_choices_*.jsonl")
    pairs, got = [], []
    for s in (json.loads(line) for line in samples.read_text().splitlines()):
        arguments = s["arguments"]
        if isinstance(arguments, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
            arguments = [(a["arg_0"], a["arg_1"]) for a in arguments.values()]
        pairs += [tuple(a) for a in arguments]
        got += [float(r[0][0]) for r in s["resps"]]  # (loglikelihood, is_greedy), written as strings
    assert len(pairs) == 12, pairs
    assert got == pytest.approx(own_loglikelihoods(up.model_dir, pairs), abs=1e-4)
