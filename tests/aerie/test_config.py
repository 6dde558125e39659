from __future__ import annotations

import json
import os
import socket

import pytest

from aerie.config import AerieConfig, build_arg_parser, config_from_args
from aerie.endpoints import split_host_port
from aerie.resolve import ConfigError, resolve_config
from launch import public_info


def test_every_design_flag_exists():
    flags = {a for action in build_arg_parser()._actions for a in action.option_strings}
    design = (
        "--model-path --tokenizer-path --host --port --zmq-port --device --dtype --load-format "
        "--context-length --page-size --max-running-requests --max-total-tokens "
        "--mem-fraction-static --chunked-prefill-size --attention-backend --disable-cuda-graph "
        "--cuda-graph-max-bs --speculative-algorithm --speculative-draft-model-path "
        "--speculative-num-steps --speculative-eagle-topk --speculative-num-draft-tokens "
        "--random-seed --log-level --tp-size --dp-size --nnodes --node-rank --dist-init-addr"
    ).split()
    assert set(design) <= flags


def test_flags_land_in_their_sections():
    cfg = config_from_args(
        ["--page-size", "4", "--chunked-prefill-size", "16", "--disable-cuda-graph"]
    )
    assert cfg.cache.page_size == 4
    assert cfg.scheduler.chunked_prefill_size == 16
    assert cfg.runner.disable_cuda_graph is True
    assert config_from_args([]) == AerieConfig()


def test_prefill_graph_tokens_resolve_per_device_and_flag():
    from aerie.resolve import DEFAULT_PREFILL_GRAPH_TOKENS, resolve_prefill_graph_tokens

    def resolved(args: list[str], device: str) -> int:
        return resolve_prefill_graph_tokens(config_from_args(args), device)

    assert resolved([], "cuda") == DEFAULT_PREFILL_GRAPH_TOKENS
    assert resolved([], "cpu") == 0  # nothing is captured on CPU
    assert resolved(["--cuda-graph-max-prefill-tokens", "256"], "cuda") == 256
    assert resolved(["--cuda-graph-max-prefill-tokens", "0"], "cuda") == 0
    assert resolved(["--cuda-graph-max-prefill-tokens", "256", "--disable-cuda-graph"], "cuda") == 0
    assert resolved(["--chunked-prefill-size", "512"], "cuda") == 512  # no longer step
    with pytest.raises(ConfigError, match="must be >= 0"):
        resolved(["--cuda-graph-max-prefill-tokens", "-1"], "cuda")


def test_decode_graphs_cover_the_request_limit_up_to_512_rows():
    from aerie.resolve import resolve_cuda_graph_max_bs

    def resolved(args: list[str], device: str = "cuda") -> int:
        return resolve_cuda_graph_max_bs(config_from_args(args), device, 256)

    assert resolved([]) == 256  # the default request limit
    assert resolved(["--max-running-requests", "384"]) == 384
    assert resolved(["--max-running-requests", "1024"]) == 512
    assert resolved(["--max-running-requests", "1024", "--cuda-graph-max-bs", "640"]) == 640
    assert resolved(["--max-running-requests", "64"], "cpu") == 32
    with pytest.raises(ConfigError, match="must be >= 1"):
        resolved(["--cuda-graph-max-bs", "0"])


def test_the_worker_warns_when_decode_batches_can_outgrow_the_graphs():
    from gpu_worker.build import eager_rows_warning

    def warning(args: list[str], device: str = "cuda") -> str | None:
        return eager_rows_warning(config_from_args(args), device)

    assert "above 256 (--cuda-graph-max-bs)" in warning(
        ["--max-running-requests", "512", "--cuda-graph-max-bs", "256"]
    )
    assert warning(["--max-running-requests", "512", "--cuda-graph-max-bs", "512"]) is None
    assert warning(["--max-running-requests", "512", "--disable-cuda-graph"]) is None
    assert warning(["--max-running-requests", "512", "--cuda-graph-max-bs", "8"], "cpu") is None


def test_bad_choice_is_refused(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--device", "tpu"])
    assert "invalid choice" in capsys.readouterr().err


def _model_dir(tmp_path, with_weights=True):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if with_weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


def test_resolve_fills_auto_values(tmp_path):
    path = _model_dir(tmp_path)
    cfg = resolve_config(config_from_args(["--model-path", path, "--device", "cpu", "--port", "9"]))
    assert cfg.model.device == "cpu" and cfg.model.dtype == "float32"
    assert cfg.model.load_format == "safetensors"
    assert cfg.model.context_length == 64
    assert cfg.model.tokenizer_path == path
    assert cfg.server.zmq_port == 10
    assert cfg.scheduler.max_running_requests > 0
    assert os.path.isdir(cfg.runtime_dir)
    os.rmdir(cfg.runtime_dir)


def test_attention_backend_auto_and_triton_on_cpu(tmp_path, monkeypatch):
    path = _model_dir(tmp_path)
    argv = ["--model-path", path, "--device", "cpu"]
    assert resolve_config(config_from_args(argv)).runner.attention_backend == "torch_native"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        resolve_config(config_from_args([*argv, "--attention-backend", "triton"]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = resolve_config(config_from_args([*argv, "--attention-backend", "triton"]))
    assert cfg.runner.attention_backend == "triton"


def test_deterministic_inference_takes_the_triton_backend(tmp_path, monkeypatch):
    path = _model_dir(tmp_path)
    argv = ["--model-path", path, "--device", "cpu", "--enable-deterministic-inference"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="deterministic.*TRITON_INTERPRET=1"):
        resolve_config(config_from_args(argv))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = resolve_config(config_from_args(argv))
    assert cfg.runner.attention_backend == "triton" and cfg.runner.enable_deterministic_inference
    os.rmdir(cfg.runtime_dir)
    refused = [
        (["--attention-backend", "torch_native"], "drop --attention-backend torch_native"),
        (["--tp-size", "2"], "not yet available with --tp-size > 1"),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            resolve_config(config_from_args([*argv, *extra]))


def test_port_zero_asks_for_any_free_ports(tmp_path):
    """--port 0 lets the OS pick; the ZMQ port then defaults to 0 too (not 1)."""
    path = _model_dir(tmp_path)
    cfg = resolve_config(config_from_args(["--model-path", path, "--device", "cpu", "--port", "0"]))
    assert (cfg.server.port, cfg.server.zmq_port) == (0, 0)
    os.rmdir(cfg.runtime_dir)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context-length", "65"], "max_position_embeddings"),
        (["--page-size", "0"], "--page-size must be positive"),
        (["--mem-fraction-static", "1.5"], "mem-fraction-static"),
        (["--port", "70000"], r"--port must be in \[0, 65535\]"),
        (["--zmq-port", "-1"], r"--zmq-port must be in \[0, 65535\]"),
        (["--tp-size", "0"], "--tp-size, --dp-size and --nnodes must be >= 1"),
        (["--tp-size", "3"], "--tp-size 3 must divide the model's 2 attention heads"),
        (["--nnodes", "2", "--tp-size", "2"], "needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500"], "must be a multiple"),
        (["--nnodes", "2", "--node-rank", "2"], r"--node-rank must be in \[0, 2\)"),
        (["--tp-size", "2", "--dist-init-addr", "nohost"], "must be HOST:PORT"),
    ],
)
def test_resolve_refuses_impossible_values(tmp_path, argv, message):
    path = _model_dir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        resolve_config(config_from_args(["--model-path", path, "--device", "cpu", *argv]))


def test_tensor_parallel_ranks_meet_at_a_local_port(tmp_path):
    path = _model_dir(tmp_path)
    single = resolve_config(config_from_args(["--model-path", path, "--device", "cpu"]))
    assert single.parallel.dist_init_addr is None
    cfg = resolve_config(
        config_from_args(
            ["--model-path", path, "--device", "cpu", "--tp-size", "2", "--dp-size", "3"]
        )
    )
    host, port = split_host_port(cfg.parallel.dist_init_addr)
    assert host == "127.0.0.1" and 0 < port <= 65536 - 3
    for replica in range(3):  # replica d meets at port + d: each one free
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port + replica))
    assert "dist_init_addr" not in public_info(cfg)  # an internal address: debug info only
    assert public_info(cfg.replace(security={"enable_debug_info": True}))["dist_init_addr"]
    for c in (single, cfg):
        os.rmdir(c.runtime_dir)


def test_missing_weights_suggest_dummy(tmp_path):
    path = _model_dir(tmp_path, with_weights=False)
    with pytest.raises(ConfigError, match="--load-format dummy"):
        resolve_config(config_from_args(["--model-path", path, "--device", "cpu"]))
    cfg = resolve_config(config_from_args(["--model-path", path, "--load-format", "dummy"]))
    assert cfg.model.load_format == "dummy"
    os.rmdir(cfg.runtime_dir)


def _draft_dir(tmp_path, architecture="LlamaForCausalLMEagle"):
    draft = tmp_path / "draft"
    draft.mkdir()
    cfg = {
        "architectures": [architecture],
        "vocab_size": 100,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (draft / "config.json").write_text(json.dumps(cfg))
    return str(draft)


def test_speculative_defaults_are_a_chain(tmp_path):
    path, draft = _model_dir(tmp_path), _draft_dir(tmp_path)
    cfg = resolve_config(
        config_from_args(
            [
                "--model-path",
                path,
                "--device",
                "cpu",
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-draft-model-path",
                draft,
            ]
        )
    )
    spec = cfg.speculative
    assert (spec.speculative_num_steps, spec.speculative_eagle_topk) == (3, 1)
    assert spec.speculative_num_draft_tokens == 4
    assert spec.decode_alloc_len == 4
    tree = resolve_config(
        config_from_args(
            [
                "--model-path",
                path,
                "--device",
                "cpu",
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-draft-model-path",
                draft,
                "--speculative-eagle-topk",
                "4",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "8",
            ]
        )
    )
    assert tree.speculative.decode_alloc_len == 12  # topk * S draft scratch > ND verify nodes
    assert config_from_args([]).speculative.decode_alloc_len == 1
    plain = resolve_config(config_from_args(["--model-path", path, "--device", "cpu"]))
    assert plain.speculative.speculative_adaptive == "on"  # a default is not a choice made
    assert not plain.speculative.adaptive  # (nothing to adapt without speculation)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-num-steps", "3"], "need --speculative-algorithm"),
        (["--speculative-adaptive", "off"], "--speculative-adaptive need --speculative-alg"),
        (["--speculative-algorithm", "MTP"], "has no MTP layers"),
        (
            ["--speculative-algorithm", "MTP", "MTPDIR", "--speculative-num-steps", "3"],
            "needs 3 MTP layers, but there are 2",
        ),
        (
            ["--speculative-algorithm", "MTP", "MTPDIR", "--speculative-eagle-topk", "2"],
            "topk must be 1",
        ),
        (["--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
        (
            ["--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "3", "DRAFT"],
            "must be S\\+1=4",
        ),
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-eagle-topk",
                "2",
                "--speculative-num-steps",
                "2",
                "--speculative-num-draft-tokens",
                "8",
                "DRAFT",
            ],
            "at most 1 \\+ topk \\+ \\(S-1\\)\\*topk\\^2 = 7 nodes",
        ),
        (["--speculative-algorithm", "EAGLE3", "DRAFT"], "needs a LlamaForCausalLMEagle3"),
    ],
)
def test_impossible_speculative_shapes_are_refused(tmp_path, argv, message):
    path, draft = _model_dir(tmp_path), _draft_dir(tmp_path)
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 2}))
    extra = {
        "DRAFT": ["--speculative-draft-model-path", draft],
        "MTPDIR": ["--speculative-draft-model-path", str(mtp)],
    }
    argv = [a for a in argv if a not in extra] + [x for a in argv if a in extra for x in extra[a]]
    with pytest.raises(ConfigError, match=message):
        resolve_config(config_from_args(["--model-path", path, "--device", "cpu", *argv]))


def test_mtp_defaults_to_a_chain_over_the_available_layers(tmp_path):
    path = _model_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    spec = resolve_config(
        config_from_args(
            ["--model-path", path, "--device", "cpu", "--speculative-algorithm", "MTP"]
        )
    ).speculative
    assert (spec.speculative_num_steps, spec.speculative_eagle_topk) == (2, 1)
    assert spec.speculative_num_draft_tokens == 3 and spec.speculative_draft_model_path is None


def test_listening_beyond_loopback_needs_a_key(tmp_path, monkeypatch):
    path = _model_dir(tmp_path)
    argv = ["--model-path", path, "--device", "cpu", "--host", "0.0.0.0"]
    monkeypatch.delenv("AERIE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        resolve_config(config_from_args(argv))
    open_cfg = resolve_config(config_from_args([*argv, "--allow-unauthenticated"]))
    assert open_cfg.security.api_key is None and open_cfg.security.allowed_hosts is None
    monkeypatch.setenv("AERIE_API_KEY", "from-env")
    keyed = resolve_config(config_from_args(argv))
    assert keyed.security.api_key == "from-env"
    flat = keyed.to_flat_dict()
    assert "api_key" not in flat and flat["api_key_set"] is True
    assert "from-env" not in json.dumps(flat)
    with pytest.raises(ConfigError, match="blank"):
        resolve_config(config_from_args([*argv, "--api-key", " "]))
    monkeypatch.setenv("AERIE_API_KEY", "")  # an environment file's "AERIE_API_KEY=": no key
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        resolve_config(config_from_args(argv))


def test_loopback_defaults_allowed_hosts_and_the_served_model_name(tmp_path, monkeypatch):
    monkeypatch.delenv("AERIE_API_KEY", raising=False)
    path = _model_dir(tmp_path)
    cfg = resolve_config(config_from_args(["--model-path", path, "--device", "cpu"]))
    assert set(cfg.security.allowed_hosts.split(",")) >= {"localhost", "127.0.0.1"}
    assert cfg.server.served_model_name == os.path.basename(path)
    named = resolve_config(
        config_from_args(["--model-path", path, "--device", "cpu", "--served-model-name", "mine"])
    )
    assert named.server.served_model_name == "mine"
    curve = resolve_config(
        config_from_args(["--model-path", path, "--device", "cpu", "--zmq-curve"])
    )
    assert curve.security.zmq_curve_key_file.endswith("zmq_curve_secret.key")
    for cfg in (named, curve):
        os.rmdir(cfg.runtime_dir)


def test_help_states_each_default_once_and_never_as_none():
    """Each flag's help says its default exactly where the reader looks: appended when the
    text does not say it, never "(default: None)" after a text that explains it."""
    from aerie.config import build_arg_parser

    for action in build_arg_parser()._actions:
        text = action.help or ""
        assert "default: None" not in text, action.option_strings
        assert text.lower().count("(default") <= 1, action.option_strings


def test_the_prefix_cache_flag_and_vllms_spellings():
    def disabled(*argv: str) -> bool:
        return config_from_args(list(argv)).cache.disable_radix_cache

    assert not disabled()  # on by default
    assert disabled("--disable-radix-cache")
    assert disabled("--no-enable-prefix-caching")
    assert not disabled("--enable-prefix-caching")
    assert "--no-enable-prefix-caching" in build_arg_parser().format_help()


def test_the_drafts_lookahead_per_algorithm():
    def lookahead(*argv: str) -> int:
        return config_from_args(list(argv)).speculative.draft_lookahead

    assert lookahead() == 0
    assert lookahead("--speculative-algorithm", "EAGLE3") == 1
    assert lookahead("--speculative-algorithm", "MTP", "--speculative-num-steps", "2") == 2
