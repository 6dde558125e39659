"""`python3 -m benchmarks`: every suite's dry run holds the commands its flags ask for, flag
errors are argparse errors, a failing command stops a suite unless --keep-going, servers are
started and stopped around their steps, and `prepare` builds the carried files (on CPU)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading

import pytest

from benchmarks import __main__ as cli
from benchmarks import device_carry, model_suites, streams_suite
from benchmarks.host_profile import profile_spins
from benchmarks.runner import PYTHON, REPO_ROOT, Command, Runner, Server, SuiteError
from benchmarks.serving_suites import merge_summaries
from benchmarks.suites import Suite


def dry_run(capsys, tmp_path, *argv: str) -> list[list[str]]:
    """The suite's commands, each split back into its words."""
    assert cli.main([*argv, "--dry-run", "--out", str(tmp_path / "out")]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines()]


def runs_of(commands: list[list[str]], program: str) -> list[list[str]]:
    return [c for c in commands if program in c]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def flags(command: list[str], *names: str) -> tuple[str, ...]:
    return tuple(flag(command, name) for name in names)


def test_iteration_passes_its_flags_through_once_per_temperature(capsys, tmp_path):
    argv = ["iteration", "--models", ".device-carry/smollm2-config", "--algorithms", "EAGLE3"]
    argv += ["--shapes", "3,1,4", "--batch-sizes", "1,4", "--temperatures", "0,0.7"]
    commands = dry_run(capsys, tmp_path, *argv, "--profile", "--profile-top", "12")
    assert commands[0][0] == "nvidia-smi"
    runs = runs_of(commands, "benchmarks/bench_speculative.py")
    assert [flag(r, "--temperature") for r in runs] == ["0", "0.7"]
    for run in runs:
        assert run[0] == PYTHON
        assert flag(run, "--mode") == "iteration" and flag(run, "--algorithm") == "EAGLE3"
        assert flag(run, "--shapes") == "3,1,4" and flag(run, "--batch-sizes") == "1,4"
        assert flag(run, "--profile-top") == "12" and "--profile" in run
        assert "--spin" not in run and "--draft-path" not in run
    out = tmp_path / "out"
    assert flag(runs[0], "--output") == str(out / "iter_smollm2-config_EAGLE3.json")
    assert flag(runs[1], "--output") == str(out / "iter_smollm2-config_EAGLE3_t0.7.json")


def test_iteration_gives_mtp_its_own_shapes_and_spins_for_py_spy(capsys, tmp_path):
    argv = ["iteration", "--models", "a/m1,b/m2", "--shapes", "5,4,8", "--pyspy-seconds", "6"]
    runs = runs_of(dry_run(capsys, tmp_path, *argv), "benchmarks/bench_speculative.py")
    assert [flags(r, "--model-path", "--algorithm", "--shapes") for r in runs] == [
        ("a/m1", "EAGLE3", "5,4,8"),
        ("a/m1", "MTP", "1,1,2 3,1,4"),
        ("b/m2", "EAGLE3", "5,4,8"),
        ("b/m2", "MTP", "1,1,2 3,1,4"),
    ]
    assert all(flag(r, "--spin") == "6" for r in runs)


def test_decode_runs_each_prompt_length_here_then_in_the_baseline_tree(capsys, tmp_path):
    argv = ["decode", "--prompt-lens", "128,512", "--batch-sizes", "1,4,8"]
    commands = dry_run(capsys, tmp_path, *argv, "--baseline-tree", "/old")
    runs = [c for c in commands if "benchmarks/bench_decode.py" in " ".join(c)]
    assert len(runs) == 4
    here, base = runs[0], runs[1]
    assert flag(here, "--prompt-len") == flag(base, "--prompt-len") == "128"
    assert flag(runs[2], "--prompt-len") == "512"
    assert flag(here, "--batch-size") == "1,4,8"
    assert flag(here, "--models") == ".device-carry/smollm2-config"
    assert base[:3] == ["(cd", "/old", "&&"]  # run from the other tree, with this tree's model
    assert flag(base, "--models") == os.path.join(REPO_ROOT, ".device-carry/smollm2-config")
    assert flag(base, "--output").endswith("decode_p128_base.json)")


def test_cuda_tests_run_the_cuda_suites_on_cuda(capsys, tmp_path):
    commands = dry_run(capsys, tmp_path, "cuda-tests", "-k", "graph")
    pytest = "-m pytest -q -p no:cacheprovider tests/gpu_worker/speculative"
    pytest += " tests/gpu_worker/test_worker.py tests/gpu_worker/test_cuda.py"
    pytest += " tests/gpu_worker/test_cuda_graph.py tests/gpu_worker/test_prefill_graph.py"
    pytest += " tests/gpu_worker/kernels tests/gpu_worker/test_deterministic.py"
    pytest += " tests/gpu_worker/test_peer_reduce.py -k graph"
    assert commands[1] == ["AERIE_SPEC_TEST_DEVICE=cuda", PYTHON, *pytest.split()]
    assert len(commands) == 2
    args = cli.build_parser().parse_args(["cuda-tests", "--e2e"])
    args.out = str(tmp_path)
    tests, e2e = cli.plan(args)[1:]
    assert tests.log == "cuda_tests.txt" and e2e.log == "e2e_tests.txt"
    assert e2e.env == {"AERIE_E2E_DEVICE": "cuda"} and "-n" in e2e.argv


def test_serving_serves_each_mode_and_loads_it_at_each_concurrency(capsys, tmp_path):
    argv = ["serving", "--modes", "on,off", "--concurrency", "1,64", "--idle-concurrency", ""]
    commands = dry_run(capsys, tmp_path, *argv)
    servers = [c for c in commands if c[-1] == "&"]
    assert len(servers) == 2
    assert "--disable-overlap-schedule" not in servers[0]
    assert "--disable-overlap-schedule" in servers[1]
    assert "launch.py" in servers[0] and flag(servers[0], "--max-running-requests") == "256"
    clients = [c for c in runs_of(commands, "benchmarks/bench_serving.py") if "--output" in c]
    ran = [
        flags(c, "--backend", "--max-concurrency", "--num-prompts", "--request-rate")
        for c in clients
    ]
    run = [("native", "1", "8", "inf"), ("openai", "64", "128", "inf")]
    run.append(("openai", "256", "256", "32"))
    assert ran == run * 2  # the Poisson run last, per mode
    assert flag(clients[0], "--output").endswith("serve_plain_on_c1.json")
    assert ["#", "merge", "the", "runs", "into", "serving_plain_off.json"] in commands
    baseline = runs_of(commands, "benchmarks/bench_decode.py")[0]
    assert flag(baseline, "--variants") == "compiled,triton+graph"


def test_serving_speculates_with_a_random_draft_and_profiles_the_host(capsys, tmp_path):
    argv = ["serving", "--modes", "on", "--concurrency", "64", "--poisson-rate", "0"]
    argv += ["--speculative", "EAGLE3", "--pyspy-seconds", "6", "--no-baseline"]
    commands = dry_run(capsys, tmp_path, *argv, "--idle-tracers", "graphs,kernels")
    assert not runs_of(commands, "benchmarks/bench_decode.py")
    draft = str(tmp_path / "out" / "random_EAGLE3_draft")
    assert commands[1][:3] == ["#", "write", "a"] and draft in commands[1]
    servers = [c for c in commands if c[-1] == "&"]
    assert len(servers) == 3  # measured, then one profiled server per tracer
    assert all(flag(s, "--speculative-draft-model-path") == draft for s in servers)
    assert [s[1].split("=")[0] for s in servers[1:]] == ["AERIE_PROFILE_TRACER"] * 2
    measured = [c for c in runs_of(commands, "benchmarks/bench_serving.py") if "--output" in c]
    assert flag(measured[0], "--num-prompts") == "512"  # 8x: the run outlasts the profile
    spy = commands.index(measured[0]) + 1
    assert commands[spy][:4] == ["#", "while", "it", "runs:"]


def test_tp_serves_each_layout_after_the_sharded_tests(capsys, tmp_path):
    commands = dry_run(capsys, tmp_path, "tp", "--layouts", "tp2,dp2", "--concurrency", "32")
    assert commands[1] == ["nvidia-smi", "topo", "-m"]
    assert commands[2][0] == "AERIE_TP_TEST_DEVICE=cuda"
    servers = [c for c in commands if c[-1] == "&"]
    assert [
        flag(s, "--tp-size") if "--tp-size" in s else "dp" + flag(s, "--dp-size") for s in servers
    ] == ["2", "dp2"]
    clients = [c for c in runs_of(commands, "benchmarks/bench_serving.py") if "--output" in c]
    assert [flag(c, "--max-concurrency") for c in clients] == ["1", "32", "1", "32"]
    commands = dry_run(capsys, tmp_path, "tp", "--skip-tests", "--layouts", "tp1")
    assert not any("pytest" in c for c in commands)
    [bench] = runs_of(commands, "benchmarks/bench_all_reduce.py")
    assert flag(bench, "--world") == "2"
    argv = ["tp", "--skip-tests", "--layouts", "tp2,tp2-nccl,tp1-det", "--all-reduce-world", "0"]
    commands = dry_run(capsys, tmp_path, *argv)
    servers = [c for c in commands if c[-1] == "&"]
    assert ["--disable-custom-all-reduce" in s for s in servers] == [False, True, False]
    assert ["--enable-deterministic-inference" in s for s in servers] == [False, False, True]
    assert not runs_of(commands, "benchmarks/bench_all_reduce.py")


def test_spec_serving_converts_the_joined_gguf_first_and_passes_the_grid(capsys, tmp_path):
    gguf, model = tmp_path / "model.gguf", tmp_path / "model"
    gguf.write_bytes(b"GGUF")
    argv = ["spec-serving", "--model-path", str(model), "--gguf", str(gguf)]
    argv += ["--servers", "plain", "eagle3", "--temperatures", "0,1.0", "--concurrency", "1,16"]
    commands = dry_run(
        capsys, tmp_path, *argv, "--turns", "1,2", "--extra-server-args=--cuda-graph-max-bs 8"
    )
    assert commands[1] == [PYTHON, "tools/convert_gguf.py", str(gguf), str(model)]
    bench = commands[2]
    assert bench[bench.index("--servers") + 1 : bench.index("--servers") + 3] == ["plain", "eagle3"]
    assert flag(bench, "--temperatures") == "0,1.0" and flag(bench, "--concurrency") == "1,16"
    assert flag(bench, "--turns") == "1,2"
    assert "--extra-server-args=--cuda-graph-max-bs 8" in bench
    assert flag(bench, "--plot").endswith("spec_serving.png")
    (model / "config.json").parent.mkdir()
    (model / "config.json").write_text("{}")
    assert "tools/convert_gguf.py" not in dry_run(capsys, tmp_path, *argv)[1]


def test_spec_serving_saves_answers_and_compares_greedy_runs_with_one(capsys, tmp_path):
    model = tmp_path / "model"
    (model / "config.json").parent.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["spec-serving", "--model-path", str(model), "--divergence", "plain_turn1_T0_c1"]
    commands = dry_run(capsys, tmp_path, *argv)
    assert flag(commands[1], "--save-outputs").endswith("/answers")
    assert ["#", "compare", "the", "runs", "with", "plain_turn1_T0_c1"] in commands
    assert "--save-outputs" not in dry_run(capsys, tmp_path, *argv[:3])[1]


def test_each_run_is_compared_with_the_base_server_at_its_temperature(tmp_path, capsys):
    from tests.e2e.reference import hf_greedy
    from tests.gpu_worker.checkpoints import make_tiny_checkpoint

    model = make_tiny_checkpoint(str(tmp_path / "model"), "llama", vocab_size=96)
    prompts = [[5, 6, 7], [8, 9]]
    base = [{"prompt_ids": p, "output_ids": hf_greedy(model, p, 6)} for p in prompts]
    other = [base[0], {"prompt_ids": prompts[1], "output_ids": base[1]["output_ids"][:5] + [0]}]
    more = [*other, {"prompt_ids": [1, 2], "output_ids": [3]}]  # a run of more streams
    sampled = [{"prompt_ids": p, "output_ids": [1, 2, 3]} for p in prompts]
    answers = tmp_path / "answers"
    answers.mkdir()
    runs = {
        "plain_turn1_T0_c1": base,
        "spec_turn1_T0_c1": other,
        "spec_turn1_T0_c16": more,
        "plain_turn1_T0.7_c1": sampled,
        "plain_turn1_T0.7_c16": sampled,
        "spec_turn1_T0.7_c1": [sampled[0], {**sampled[1], "output_ids": [1, 4, 3]}],
        "spec_turn1_T1_c1": base,  # no plain run at T=1 to compare with
        "spec_turn2_T0_c1": [{"prompt_ids": [4], "output_ids": [5]}],  # another turn
    }
    for name, run in runs.items():
        (answers / f"{name}.json").write_text(json.dumps(run))
    model_suites.compare_answers(str(tmp_path), "plain_turn1_T0_c1", model)
    said = capsys.readouterr().out  # a run without a base run at its temperature says so
    assert "spec_turn1_T1_c1: not compared, no plain_turn1_T1_c1 to compare it with" in said
    reports = json.loads((tmp_path / "divergence.json").read_text())
    greedy = ["spec_turn1_T0_c1", "spec_turn1_T0_c16"]
    assert list(reports) == [*greedy, "plain_turn1_T0.7_c16", "spec_turn1_T0.7_c1"]
    for name in greedy:  # the answers both runs hold
        assert reports[name]["base"] == "plain_turn1_T0_c1"
        assert reports[name]["prompts"] == 2 and reports[name]["identical"] == 1
        assert reports[name]["divergences"][0]["position"] == 5
    assert reports["plain_turn1_T0.7_c16"]["base"] == "plain_turn1_T0.7_c1"
    assert reports["plain_turn1_T0.7_c16"]["identical"] == 2
    assert reports["spec_turn1_T0.7_c1"]["identical"] == 1
    assert reports["spec_turn1_T0.7_c1"]["divergences"][0]["position"] == 1
    with pytest.raises(SuiteError, match="greedy"):
        model_suites.compare_answers(str(tmp_path), "plain_turn1_T0.7_c1", model)


def test_spec_serving_traces_and_profiles_each_server_apart(capsys, tmp_path):
    model = tmp_path / "model"
    (model / "config.json").parent.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["spec-serving", "--model-path", str(model), "--servers", "eagle3-fixed", "s5=--x 5"]
    commands = dry_run(capsys, tmp_path, *argv, "--concurrency", "16,1", "--step-trace")
    bench, summaries = commands[1], commands[2:]
    home = os.path.expanduser("~")
    assert flag(bench, "--server-env") == f"AERIE_STEP_TRACE=1,10000000,{home}/trace_{{server}}"
    assert [(c[2], flag(c, "--mode"), flag(c, "--batch-size")) for c in summaries] == [
        (f"{home}/trace_{name}", mode, "1")
        for name in ("plain", "eagle3-fixed", "s5")
        for mode in ("decode", "speculate")
    ]
    bench = dry_run(capsys, tmp_path, *argv, "--host-profile", "500,200")[1]
    assert flag(bench, "--server-env").startswith("AERIE_HOST_PROFILE=500,200,")
    assert flag(bench, "--server-env").endswith("/profile_{server}")
    for bad in ("500", "0,200", "500,0"):
        with pytest.raises(SystemExit):
            dry_run(capsys, tmp_path, *argv, "--host-profile", bad)


def test_mtbench_and_train_step_and_kernels_pass_their_flags(capsys, tmp_path):
    model = tmp_path / "model"
    argv = ["mtbench", "--model-path", str(model), "--drafts", "EAGLE3=~/eagle3,MTP=/d/mtp"]
    bench = dry_run(capsys, tmp_path, *argv, "--temperatures", "0,0.7", "--turns", "1")[1]
    home = os.path.expanduser("~")
    assert flag(bench, "--draft-path") == f"EAGLE3={home}/eagle3,MTP=/d/mtp"
    assert flag(bench, "--temperatures") == "0,0.7" and flag(bench, "--turns") == "1"
    assert flag(bench, "--max-running-requests") == "1"
    commands = dry_run(
        capsys, tmp_path, "train-step", "--windows", "on,off", "--generate-batch-sizes", "64,128"
    )
    assert flag(commands[1], "--windows") == "on,off" and "--check-target" in commands[1]
    assert [flag(c, "--batch-size") for c in commands[2:]] == ["64", "128"]
    argv = ["kernels", "--benchmarks", "linear", "--linear", "--rows 1 --shapes '8b.down,8b.o'"]
    commands = dry_run(capsys, tmp_path, *argv, "--linear=--prologues-only")
    assert [c[2:-2] for c in commands[1:]] == [
        ["--rows", "1", "--shapes", "8b.down,8b.o"],
        ["--prologues-only"],
    ]


@pytest.fixture
def train_dirs(tmp_path):
    carry, model = tmp_path / "carry", tmp_path / "model"
    for part, names in (
        ("train_a", ("prompts_a.npz", "mtbench.npz")),
        ("train_b", ("data_a.npz", "data_b.npz")),
    ):
        (carry / part).mkdir(parents=True)
        for name in names:
            (carry / part / name).write_bytes(b"")
    model.mkdir()
    (model / "config.json").write_text("{}")
    return carry, model, tmp_path / "work"


def train_argv(carry, model, work) -> list[str]:
    return ["train", "--carry-dir", str(carry), "--model", str(model), "--work", str(work)]


def test_train_plans_from_the_carried_files_and_resumes(capsys, tmp_path, train_dirs):
    carry, model, work = train_dirs
    argv = train_argv(carry, model, work) + ["--algorithms", "eagle3,mtp:5", "--max-minutes", "9"]
    commands = dry_run(capsys, tmp_path, *argv, "--train-args", "eagle3=--depth 6")
    assert commands[1] == ["#", "copy", "4", "carried", "files", "into", str(work)]
    answers = commands[2]
    assert answers[2:4] == ["training", "generate"] and flag(answers, "--sampled-per-prompt") == "0"
    assert flag(answers, "--out") == str(work / "mtbench_answers.npz")
    trains = [c for c in commands if c[2:4] == ["training", "train"]]
    assert [(c[4], flag(c, "--max-minutes")) for c in trains] == [("eagle3", "9"), ("mtp", "5")]
    assert all("--resume" in c for c in trains) and flag(trains[0], "--depth") == "6"
    assert flag(trains[0], "--data") == f"{work / 'data_a.npz'},{work / 'data_b.npz'}"
    estimates = [c for c in commands if c[2:4] == ["training", "estimate"]]
    assert [(c[4], flag(c, "--depth")) for c in estimates] == [("eagle3", "5"), ("mtp", "0")]
    packs = [c for c in commands if c[0] == "bash"]
    assert "split -b 15M" in packs[0][2] and "draft_eagle3.tar." in packs[0][2]


def test_train_generates_from_the_prompts_first_and_smokes_on_random_weights(
    capsys, tmp_path, train_dirs
):
    carry, model, work = train_dirs
    for name in os.listdir(carry / "train_b"):
        (carry / "train_b" / name).unlink()
    (carry / "train_c").mkdir()
    (carry / "train_c" / "prompts_c.npz").write_bytes(b"")
    argv = train_argv(carry, model, work)
    argv += ["--generate-minutes", "6", "--seed", "5", "--algorithms", "eagle3", "--smoke"]
    commands = dry_run(capsys, tmp_path, *argv, "--smoke-algorithms", "mtp")
    smoke_generate, smoke_train = commands[2:4]
    assert flag(smoke_generate, "--load-format") == "dummy" and smoke_train[4] == "mtp"
    assert flag(smoke_train, "--data") == str(work / "smoke.npz")
    generate = next(c for c in commands if str(work / "data.npz") in c)
    assert flag(generate, "--prompts") == f"{work / 'prompts_a.npz'},{work / 'prompts_c.npz'}"
    assert flag(generate, "--max-minutes") == "6" and flag(generate, "--seed") == "5"
    train = next(c for c in commands if c[2:4] == ["training", "train"] and c[4] == "eagle3")
    assert flag(train, "--data") == str(work / "data.npz")


def test_train_stages_until_the_model_is_assembled(capsys, tmp_path, train_dirs):
    carry, _, work = train_dirs
    argv = train_argv(carry, tmp_path / "none", work) + ["--algorithms", "eagle3"]
    argv += ["--gguf", str(tmp_path / "none.gguf")]
    commands = dry_run(capsys, tmp_path, *argv)
    assert commands[-1][:4] == ["#", "the", "model", "is"] and len(commands) == 3


def test_train_without_data_or_prompts_is_an_error(capsys, tmp_path, train_dirs):
    _, model, work = train_dirs
    argv = train_argv(tmp_path / "empty", model, work)
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--algorithms", "eagle3", "--dry-run"])
    assert e.value.code == 2 and "training needs data.npz" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nonsense"], "invalid choice: 'nonsense'"),
        (["decode", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["iteration", "--batch-sizes", "1,x"], "expected comma-separated integers"),
        (["iteration", "--shapes", "3,1"], "expected S,topk,ND triples"),
        (["iteration", "--algorithms", "EAGLE3,eagle"], "expected EAGLE3, EAGLE or MTP"),
        (["serving", "--speculative", "MEDUSA"], "invalid choice: 'MEDUSA'"),
        (["tp", "--layouts", "pp2"], "expected tpN or dpN layouts"),
        (["train", "--algorithms", "medusa:3"], "expected ALGO or ALGO:MINUTES"),
        (["train", "--train-args", "medusa=--depth 2"], "expected ALGO=ARGS"),
        (["decode", "--env", "NOEQUALS"], "expected KEY=VALUE"),
    ],
)
def test_bad_suites_and_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--dry-run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_flag_says_what_it_does_and_its_default():
    parser = cli.build_parser()
    suites = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(suites.choices) == set(cli.SUITES) >= {"prepare", "iteration", "serving", "train"}
    formatter = cli.HelpFormatter("prog")
    for name, sub in suites.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.dest)
                assert "(default: " in formatter._get_help_string(action), (name, action.dest)
    text = " ".join(suites.choices["iteration"].format_help().split())
    assert "comma list (default: 1,32)" in text and "(default: none)" in text


def failing_suite(marker) -> Suite:
    steps = [
        Command([PYTHON, "-c", "print('first')"], "first.txt"),
        Command([PYTHON, "-c", "import sys; sys.exit(3)"], "fails.txt"),
        Command([PYTHON, "-c", f"open({str(marker)!r}, 'w')"], "third.txt"),
    ]
    return Suite("failing", "fails", lambda p: None, lambda args: steps, on_device=False)


@pytest.mark.parametrize("keep_going", [False, True])
def test_a_failing_command_stops_the_suite_unless_keep_going(
    monkeypatch, capsys, tmp_path, keep_going
):
    marker = tmp_path / "third_ran"
    monkeypatch.setitem(cli.SUITES, "failing", failing_suite(marker))
    argv = ["failing", "--out", str(tmp_path / "out")] + (["--keep-going"] if keep_going else [])
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "step failed (exit 3)" in err and "sys.exit(3)" in err and "fails.txt" in err
    assert marker.exists() == keep_going
    assert (tmp_path / "out" / "first.txt").read_text() == "first\n"


def test_a_command_past_its_timeout_fails(tmp_path):
    runner = Runner(str(tmp_path), dict(os.environ), keep_going=False, tail=0)
    slow = Command([PYTHON, "-c", "import time; time.sleep(30)"], "slow.txt", timeout_s=0.5)
    assert not runner.run([slow])
    assert "timed out after 0.5 s" in runner.failures[0] and "time.sleep(30)" in runner.failures[0]


def test_setup_passes_its_exports_to_every_command(monkeypatch, tmp_path):
    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "on_device.sh").write_text("echo model: joined\necho export AERIE_TEST_SETUP=staged\n")
    seen = tmp_path / "seen"
    record = f"import os; open({str(seen)!r}, 'w').write(os.environ['AERIE_TEST_SETUP'])"
    cmd = Command([PYTHON, "-c", record + "; open(os.environ['X'], 'w')"], "env.txt")
    env_suite = Suite("env", "env", lambda p: None, lambda a: [cmd], on_device=False)
    monkeypatch.setitem(cli.SUITES, "env", env_suite)
    marker = tmp_path / "x_seen"
    argv = ["env", "--setup", "--carry-dir", str(carry), "--env", f"X={marker}"]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert seen.read_text() == "staged" and marker.exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_serves_its_steps_and_is_stopped_after_them(tmp_path):
    script, port = tmp_path / "server.py", free_port()
    script.write_text(HEALTH_SERVER)
    probe = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/health').status)"
    inner = [Command([PYTHON, "-c", probe], "probe.txt")]
    runner = Runner(str(tmp_path), dict(os.environ), keep_going=False, tail=0)
    assert runner.run([Server([PYTHON, str(script), str(port)], "server.log", port, inner)])
    assert (tmp_path / "probe.txt").read_text() == "200\n"
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # stopped
    quits = Server([PYTHON, "-c", "pass"], "quits.log", free_port(), inner, start_timeout_s=10)
    assert not runner.run([quits])
    assert "server did not start (exited with 0)" in runner.failures[-1]
    with socket.socket() as busy:  # a server already there would be the one measured
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert not runner.run([Server([PYTHON, str(script), str(taken)], "s.log", taken, inner)])
    assert f"something already listens on port {taken}" in runner.failures[-1]


def test_a_terminated_suite_stops_its_server_and_command(monkeypatch, tmp_path):
    """SIGTERM (a `timeout` around the suite) while a step runs: the step's command and the
    server are stopped before the suite exits, so the next suite finds the port free."""
    script, port = tmp_path / "server.py", free_port()
    script.write_text(HEALTH_SERVER)
    pid_file = tmp_path / "command.pid"
    stop_me = (
        f"import os, signal, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    )
    steps = [
        Server(
            [PYTHON, str(script), str(port)],
            "server.log",
            port,
            [
                Command([PYTHON, "-c", stop_me], "command.txt"),
                Command([PYTHON, "-c", f"open({str(tmp_path / 'after')!r}, 'w')"], "after.txt"),
            ],
        )
    ]
    suite = Suite("stops", "stops", lambda p: None, lambda a: steps, on_device=False)
    monkeypatch.setitem(cli.SUITES, "stops", suite)
    assert cli.main(["stops", "--out", str(tmp_path / "out")]) == 128 + 15
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # the server stopped
    with pytest.raises(ProcessLookupError):  # the command too
        os.kill(int(pid_file.read_text()), 0)
    assert not (tmp_path / "after").exists()  # and nothing ran after it


STOPS_LATE_SERVER = HEALTH_SERVER.replace(
    "print(",
    """import os, signal, time
def stop(*_):  # a second SIGTERM to the suite, sent while it waits for this server to stop
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(0.5)
    open(sys.argv[2], "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
print(""",
    1,
)


def test_a_second_sigterm_does_not_cut_the_servers_stop_short(monkeypatch, tmp_path):
    """A SIGTERM while the suite stops its server (a `timeout` sending it again, or the server
    itself) is ignored: the suite still waits for the server, and restores the handler."""
    script, port, stopped = tmp_path / "server.py", free_port(), tmp_path / "stopped"
    script.write_text(STOPS_LATE_SERVER)
    stop_me = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    inner = [Command([PYTHON, "-c", stop_me], "command.txt")]
    steps = [Server([PYTHON, str(script), str(port), str(stopped)], "server.log", port, inner)]
    suite = Suite("stops", "stops", lambda p: None, lambda a: steps, on_device=False)
    monkeypatch.setitem(cli.SUITES, "stops", suite)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["stops", "--out", str(tmp_path / "out")]) == 128 + 15
    assert stopped.exists()  # the second signal did not end the wait for the server
    assert signal.getsignal(signal.SIGTERM) == before


def test_prepare_builds_the_carry_dir_from_the_default_model(monkeypatch, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in device_carry.TOKENIZER_FILES + device_carry.SHAPE_FILES:
        (model / name).write_text(json.dumps({"file": name}))
    monkeypatch.setattr(device_carry, "ensure_default_model", lambda: str(model))
    conversations = [
        [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}] for i in range(6)
    ]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": c} for c in conversations])[:-30])  # cut
    mt_bench = tmp_path / "mt_bench.jsonl"
    mt_bench.write_text('{"turns": ["hello"]}\n')
    mt_bench.chmod(0o444)  # as the questions file is: a rerun must still replace its copy
    carry = tmp_path / "carry"
    argv = [
        "prepare",
        "--carry-dir",
        str(carry),
        "--sharegpt",
        str(sharegpt),
        "--mt-bench",
        str(mt_bench),
    ]
    assert (
        cli.main([*argv, "--num-conversations", "3", "--no-pyspy", "--out", str(tmp_path / "out")])
        == 0
    )
    assert "nvidia-smi" not in capsys.readouterr().out
    assert sorted(os.listdir(carry / "smollm2-config")) == sorted(
        device_carry.TOKENIZER_FILES + device_carry.SHAPE_FILES
    )
    assert json.loads((carry / "llama8b" / "config.json").read_text())["hidden_size"] == 4096
    assert json.loads((carry / "llama8b" / "tokenizer.json").read_text()) == {
        "file": "tokenizer.json"
    }
    subset = [r["conversations"] for r in json.loads((carry / "sharegpt_subset.json").read_text())]
    assert subset == random.Random(0).sample(conversations[:5], 3)  # the cut sixth is dropped
    assert (carry / "mt_bench_questions.jsonl").read_text() == mt_bench.read_text()
    assert cli.main([*argv, "--no-pyspy", "--out", str(tmp_path / "out")]) == 0


def test_merged_serving_summaries_replace_the_per_run_files(tmp_path):
    for run in ("1", "64", "poisson"):
        (tmp_path / f"serve_plain_on_c{run}.json").write_text(
            json.dumps({"summary": {"run": run}, "requests": []})
        )
    merge_summaries(str(tmp_path), "plain_on")
    merged = json.loads((tmp_path / "serving_plain_on.json").read_text())
    assert merged == {"1": {"run": "1"}, "64": {"run": "64"}, "poisson": {"run": "poisson"}}
    assert sorted(os.listdir(tmp_path)) == ["serving_plain_on.json"]


def test_python_m_benchmarks_prints_a_dry_run(tmp_path):
    argv = [sys.executable, "-m", "benchmarks", "cuda-tests", "--dry-run", "--setup"]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"bash {os.path.join(REPO_ROOT, '.device-carry', 'on_device.sh')}"
    assert lines[2].startswith("AERIE_SPEC_TEST_DEVICE=cuda ")


def test_a_thread_hook_runs_while_its_command_runs(tmp_path):
    seen = []
    cmd = Command([PYTHON, "-c", "import time; time.sleep(0.3)"], "hooked.txt")
    cmd.during = lambda proc: seen.append((proc.poll(), threading.current_thread().name))
    assert Runner(str(tmp_path), dict(os.environ), keep_going=False, tail=0).run([cmd])
    assert seen[0][0] is None and seen[0][1] != threading.main_thread().name


FAKE_PYSPY = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
echo "thread (0x1);main (bench.py:1);sleep (time:1) 200" > "$out"
"""


def test_each_spinning_step_gets_a_host_profile(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "py-spy").write_text(FAKE_PYSPY)
    (bin_dir / "py-spy").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spin = "import os, time; print(f'spinning plain bs=1 for 2 s in pid {os.getpid()}', flush=True)"
    cmd = Command([PYTHON, "-c", spin + "; time.sleep(1)"], "iter.txt")
    cmd.during = profile_spins(str(tmp_path / "iter.txt"), 2, str(tmp_path / "host_profile"))
    assert Runner(str(tmp_path), dict(os.environ), keep_going=False, tail=0).run([cmd])
    summary = (tmp_path / "host_profile_1.txt").read_text()
    assert summary.startswith("== spinning plain bs=1") and "spy_iter.txt" in summary
    assert not (tmp_path / "spy_iter.txt").exists()  # the raw samples are dropped


def test_streams_serves_each_frontend_count_and_loads_it_at_each_concurrency(capsys, tmp_path):
    argv = ["streams", "--frontends", "1,4", "--concurrency", "1,64,512"]
    commands = dry_run(capsys, tmp_path, *argv)
    servers = [c for c in commands if c[-1] == "&"]
    assert [flag(s, "--tokenizer-worker-num") for s in servers] == ["1", "4"]
    assert all(flag(s, "--max-running-requests") == "512" for s in servers)
    clients = [c for c in runs_of(commands, "benchmarks/bench_serving.py") if "--output" in c]
    ran = [flags(c, "--backend", "--max-concurrency", "--num-prompts") for c in clients]
    run = [("native", "1", "8"), ("native", "64", "128"), ("native", "512", "800")]
    assert ran == run * 2
    assert all(flag(c, "--output-len") == "512" for c in clients)
    assert flag(clients[-1], "--output").endswith("serve_streams_f4_c512.json")
    assert ["#", "merge", "the", "runs", "into", "serving_streams_f4.json"] in commands
    disturbances = runs_of(commands, "benchmarks/bench_disturbance.py")
    scenarios = [flags(c, "--scenario", "--steady") for c in disturbances]
    assert scenarios == [(s, "128") for s in ("none", "burst", "prefill", "slow")] * 2
    assert flag(disturbances[-1], "--output").endswith("disturb_streams_f4_slow.json")
    assert ["#", "merge", "the", "disturbances", "into", "disturbance_streams_f4.json"] in commands
    more = dry_run(capsys, tmp_path, *argv, "--max-requests", "1024", "--disturbances", "")
    clients = [c for c in runs_of(more, "benchmarks/bench_serving.py") if "--output" in c]
    assert [flag(c, "--num-prompts") for c in clients] == ["8", "128", "1024"] * 2
    dp = dry_run(capsys, tmp_path, *argv, "--dp-size", "2", "--disturbances", "")
    servers = [c for c in dp if c[-1] == "&"]
    assert [flag(s, "--dp-size") for s in servers] == ["2", "2"]
    assert not runs_of(dp, "benchmarks/bench_disturbance.py")
    assert ["#", "merge", "the", "runs", "into", "serving_streams_f4_dp2.json"] in dp


def test_the_streams_disturbances_merge_into_one_file_per_frontend_count(tmp_path):
    for scenario in ("burst", "none"):
        result = {"scenario": scenario, "during": {"gaps": 3}, "args": {"x": 1}}
        (tmp_path / f"disturb_streams_f2_{scenario}.json").write_text(json.dumps(result))
    streams_suite.merge_disturbances(str(tmp_path), "streams_f2")
    merged = json.loads((tmp_path / "disturbance_streams_f2.json").read_text())
    assert merged == {s: {"scenario": s, "during": {"gaps": 3}} for s in ("burst", "none")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disturbance_streams_f2.json"]
