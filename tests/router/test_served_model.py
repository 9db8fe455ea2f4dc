"""The model's served names, its tokenizer's location, generation_config.json defaults, and the
tiny model's tokenizer.json (loadable by Hugging Face clients, equal to the byte tokenizer)."""

import json
import random

import pytest

from model.tokenizer import ByteTokenizer, HFTokenizer
from model.tokenizer_tiny import write_tiny_tokenizer
from router.generation_defaults import GenerationDefaults
from router.served_model import served_names, tokenizer_dir


def _ckpt(tmp_path, config=None, generation=None):
    d = tmp_path / "DeepSeek-V4-Tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config or {}))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def test_names(tmp_path):
    d = _ckpt(tmp_path, {"_name_or_path": "deepseek-ai/DeepSeek-V4-Flash"})
    assert served_names(d) == ("deepseek-ai/DeepSeek-V4-Flash", "v4serve")
    assert served_names(d, ["a", "b", "a"]) == ("a", "b", "v4serve")
    (tmp_path / "x").mkdir()
    assert served_names(_ckpt(tmp_path / "x")) == ("DeepSeek-V4-Tiny", "v4serve")  # the directory's name
    with pytest.raises(ValueError, match="must not be empty"):
        served_names(d, [" "])


def test_tokenizer_override(tmp_path):
    d = _ckpt(tmp_path)
    assert tokenizer_dir(d, None) == d
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(d, other) == other == tokenizer_dir(d, other / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        tokenizer_dir(d, tmp_path / "nowhere")


def test_generation_defaults(tmp_path):
    assert GenerationDefaults.from_model_dir(_ckpt(tmp_path)) == GenerationDefaults(1.0, 1.0, 0)
    (tmp_path / "g").mkdir()
    g = _ckpt(tmp_path / "g", generation={"temperature": 0.6, "top_p": 0.95, "bos_token_id": 0})
    assert GenerationDefaults.from_model_dir(g) == GenerationDefaults(0.6, 0.95, 0)
    (tmp_path / "h").mkdir()
    greedy = _ckpt(tmp_path / "h", generation={"do_sample": False, "top_k": 20})
    assert GenerationDefaults.from_model_dir(greedy) == GenerationDefaults(0.0, 1.0, 20)
    (tmp_path / "i").mkdir()
    bad = _ckpt(tmp_path / "i", generation={"temperature": 7})
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        GenerationDefaults.from_model_dir(bad)


def test_unset_fields_take_the_generation_defaults():
    from harness import RouterThread

    from router.config import RouterConfig
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, model_aliases=("v4serve",),
                                  generation_defaults=GenerationDefaults(temperature=0.0)))
    try:
        import openai
        c = openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0)
        ids = r.tokenizer.encode("hi")
        greedy = r.expected(ids, 6, temperature=0.0)[1]
        for model in ("stub", "v4serve"):  # the alias is accepted; responses report the served name
            out = c.completions.create(model=model, prompt="hi", max_tokens=6)
            assert out.choices[0].text == greedy and out.model == "stub"
        assert [m.id for m in c.models.list().data] == ["stub", "v4serve"]
        sampled = c.completions.create(model="stub", prompt="hi", max_tokens=6, temperature=1.0, seed=4)
        assert sampled.choices[0].text == r.expected(ids, 6, temperature=1.0, seed=4)[1]
    finally:
        r.close()


def test_tiny_tokenizer_json_is_the_byte_tokenizer(tmp_path):
    write_tiny_tokenizer(tmp_path, 320)
    hf, byte = HFTokenizer(tmp_path / "tokenizer.json", 256, 257), ByteTokenizer(320)
    assert hf.vocab_size == 320
    for text in ["héllo wörld", "<｜User｜>hi<｜Assistant｜><think>x</think>", " a  b\n\tc", "日本語 🤖", "<｜DSML｜x"]:
        assert hf.encode(text) == byte.encode(text)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(262) for _ in range(rng.randrange(12))]  # bytes and special tokens
        assert hf.decode(ids) == byte.decode(ids)
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.encode("hé<｜User｜>", add_special_tokens=False) == byte.encode("hé<｜User｜>")
    assert len(auto) == 320 and auto.eos_token_id == 257 and auto.bos_token_id == 256


def test_cli_flags_reach_the_router_config(tmp_path):
    from cluster.cli import _router_config, build_parser
    d = _ckpt(tmp_path, {"_name_or_path": "org/Model"}, {"temperature": 0.3})
    args = build_parser().parse_args(["up", "--model", str(d)])
    cfg = _router_config(args, d)
    assert (cfg.model_name, cfg.model_aliases) == ("org/Model", ("v4serve",))
    assert cfg.generation_defaults.temperature == 0.3 and cfg.tokenizer_dir == str(d)
    write_tiny_tokenizer(tmp_path, 320)
    args = build_parser().parse_args(["router", "--model", str(d), "--served-model-name", "a", "--served-model-name",
                                      "b", "--tokenizer", str(tmp_path / "tokenizer.json")])
    cfg = _router_config(args, d)
    assert (cfg.model_name, cfg.model_aliases, cfg.tokenizer_dir) == ("a", ("b", "v4serve"), str(tmp_path))


def test_generate_leaves_unset_sampling_fields_to_the_checkpoint():
    from cluster.cli import build_parser
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--max-new-tokens", "1"])
    assert (args.temperature, args.top_p, args.top_k) == (None, None, None)  # cmd_generate fills them
