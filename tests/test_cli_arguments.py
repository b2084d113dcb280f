"""The command line's flags: conventional short names, --version, defaults in --help, and every
value checked before a model loads (the model path here does not exist, so an error that names the
flag, not the path, was raised before loading), each refusal one line and no traceback."""

import subprocess
import sys

import pytest
import torch

import moerun
from moerun.cli.main import build_parser, main

MISSING = "/nonexistent/model"


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
@pytest.mark.parametrize("device", ["tpu", "banana", *([] if torch.cuda.is_available() else ["cuda"])])
def test_a_device_that_cannot_run_is_one_line(capsys, command, device):
    argv = [command, "--device", device] + (["-m", MISSING, "-p", "hi"] if command == "generate" else [])
    argv += ["-m", MISSING] if command == "chat" else []
    err = _refusal(capsys, argv)
    assert f"--device {device}:" in err


def test_a_bad_device_in_a_subprocess_prints_no_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "moerun", "generate", "-m", MISSING, "-p", "hi", "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "moerun generate: --device tpu: moerun runs on cpu or cuda (cuda:N for one GPU of several)."
    ]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-tokens", "-2"], "--max-tokens"),
        (["-n", "-5"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "1", "--top-p", "0"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--min-p", "2"], "--min-p"),
        (["--repeat-penalty", "0"], "--repeat-penalty"),
        (["-t", "0"], "--threads"),
        (["-c", "0"], "--ctx-size"),
        (["--expert-cache-gb", "0"], "--expert-cache-gb"),
        (["--logprobs", "3"], "--json"),
        (["--system", "be brief"], "--chat"),
    ],
)
def test_generate_values_are_checked_before_loading(capsys, flags, named):
    err = _refusal(capsys, ["generate", "-m", MISSING, "-p", "hi", *flags])
    assert named in err and MISSING not in err


ZERO = (["--memory-gb", "0"], "--memory-gb must be > 0, got 0.0.")
BOTH = (["--memory-gb", "4", "--expert-cache-gb", "1"], "give --memory-gb or --expert-cache-gb, not both")


@pytest.mark.parametrize(
    "command, flags, said",
    [(c, *ZERO) for c in ("generate", "chat", "serve", "perplexity", "bench")]
    + [(c, *BOTH) for c in ("generate", "chat", "serve", "perplexity")],
)
def test_memory_gb_is_checked_before_loading(capsys, tmp_path, command, flags, said):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    extra = {"generate": ["-p", "hi"], "perplexity": ["-f", str(text)]}.get(command, [])
    err = _refusal(capsys, [command, "-m", MISSING, *extra, *flags])
    assert said in err and MISSING not in err


@pytest.mark.parametrize("ids", ["1,x,3", "1,-2", ","])
def test_prompt_ids_must_be_ids(capsys, ids):
    err = _refusal(capsys, ["generate", "-m", MISSING, "--prompt-ids", ids])
    assert "--prompt-ids" in err


def test_perplexity_values_are_checked_before_loading(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    err = _refusal(capsys, ["perplexity", "-m", MISSING, "-f", str(text), "-c", "8", "--stride", "9"])
    assert "--stride" in err


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "perplexity"])
def test_a_ctx_size_below_one_is_refused_before_loading(capsys, tmp_path, command):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    extra = {"generate": ["-p", "hi"], "perplexity": ["-f", str(text)]}.get(command, [])
    err = _refusal(capsys, [command, "-m", MISSING, *extra, "-c", "0"])
    assert err == f"moerun {command}: --ctx-size must be >= 1, got 0.\n"


def test_ctx_size_help_says_its_default():
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, default in [
        ("generate", "the model's context"),
        ("chat", "the model's context"),
        ("serve", "4096, or the model's context if shorter"),
        ("perplexity", "512, or the model's context if shorter"),
    ]:
        action = next(a for a in commands[name]._actions if a.dest == "ctx_size")
        assert action.option_strings == ["-c", "--ctx-size"] and action.default is None
        assert action.help.endswith(f"(default: {default})"), (name, action.help)


def test_sampling_flags_without_temperature_are_named(capsys):
    main(["generate", "-m", MISSING, "-p", "hi", "--top-k", "5", "--seed", "1"])
    first = capsys.readouterr().err.splitlines()[0]
    assert "--top-k" in first and "--seed" in first and "--temperature" in first


def test_conventional_short_flags():
    args = build_parser().parse_args(["generate", "-m", "M", "-p", "P", "-n", "7", "-c", "64", "-t", "2"])
    assert (args.model, args.prompt, args.max_tokens, args.ctx_size, args.threads) == ("M", "P", 7, 64, 2)
    args = build_parser().parse_args(["generate", "-m", "M", "-f", "-"])
    assert args.file == "-"
    args = build_parser().parse_args(["bench", "-t", "3"])
    assert args.threads == 3


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"moerun {moerun.__version__}"


def test_every_flag_has_help_and_help_shows_defaults():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"moerun {name} {action.option_strings or action.dest} has no help"
    text = commands["generate"].format_help()
    assert "(default: 256)" in text and "(default: bf16)" in text


def test_ctrl_c_while_loading_exits_130_in_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moerun, "load", interrupted)
    assert main(["generate", "-m", MISSING, "-p", "hi", "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "moerun generate: interrupted."
