"""`--tokenizer` reaches the workers: the decode worker detokenizes and matches stop strings, and
both workers build grammars, with the tokenizer the router was given, not the checkpoint's."""

import json

from cluster.cli import _router_config, _worker_options
from cluster.cli_parser import build_parser
from decode_worker.actor import DecodeWorker
from model.checkpoint import read_config
from model.tokenizer import HFTokenizer
from model.tokenizer_tiny import write_tiny_tokenizer
from prefill_worker.actor import PrefillWorker
from worker_runtime.in_process import InProcess
from worker_runtime.options import WorkerOptions


def test_workers_use_the_tokenizer_the_cluster_was_given(tiny_official_ckpt, tmp_path, registry_url):
    cfg = read_config(tiny_official_ckpt)
    assert not (tiny_official_ckpt / "tokenizer.json").exists()  # the checkpoint's own: bytes
    write_tiny_tokenizer(tmp_path, cfg.vocab_size)
    given = json.loads((tmp_path / "tokenizer.json").read_text())
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, tokenizer_dir=str(tmp_path), max_tokens=64,
                            max_seqs=2)
    local = InProcess()
    decode = DecodeWorker("decode-t", options, local)
    prefill = PrefillWorker("prefill-t", options, local)
    assert isinstance(decode.engine.tokenizer, HFTokenizer) and json.loads(decode.engine.tokenizer.to_json()) == given
    # the prefill engine holds its tokenizer only in the grammar compiler (its first token's mask)
    assert json.loads(prefill.engine.grammars._tokenizer.to_json()) == given
    plain = DecodeWorker("decode-p", WorkerOptions(str(tiny_official_ckpt), registry_url, max_tokens=64, max_seqs=2),
                         local)
    assert not isinstance(plain.engine.tokenizer, HFTokenizer)


def test_up_passes_the_routers_tokenizer_to_the_workers(tiny_official_ckpt, tmp_path):
    write_tiny_tokenizer(tmp_path, 320)
    args = build_parser().parse_args(["up", "--model", str(tiny_official_ckpt), "--tokenizer", str(tmp_path)])
    router = _router_config(args, tiny_official_ckpt)
    assert _worker_options(args, tiny_official_ckpt, router).tokenizer_dir == str(tmp_path) == router.tokenizer_dir
    args = build_parser().parse_args(["up", "--model", str(tiny_official_ckpt)])
    assert _worker_options(args, tiny_official_ckpt, _router_config(args, tiny_official_ckpt)).tokenizer_dir \
        == str(tiny_official_ckpt)
