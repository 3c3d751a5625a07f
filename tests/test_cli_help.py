"""Every command's help runs, and help advertises only commands that exist: the subcommands that
`python -m runtime --help` lists, `python -m export --help`, every console script of pyproject.toml,
and every `python -m MODULE [SUBCOMMAND]` their help texts name."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# [project.scripts] of pyproject.toml (tomllib is Python 3.11+; the project supports 3.10)
_section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', _section, re.M))


def help_text(*args: str) -> str:
    out = subprocess.run([sys.executable, *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(args)} --help failed:\n{out.stderr[-2000:]}"
    return out.stdout


def runtime_subcommands() -> list[str]:
    listed = re.search(r"\{([\w,-]+)\}", help_text("-m", "runtime"))
    assert listed, "python -m runtime --help lists no subcommands"
    return listed.group(1).split(",")


def test_runtime_lists_its_subcommands():
    assert {"generate", "chat", "tune", "serve"} <= set(runtime_subcommands())


@pytest.mark.parametrize("command", runtime_subcommands())
def test_runtime_subcommand_help(command):
    if command == "serve" and importlib.util.find_spec("fastapi") is None:
        pytest.skip("the serve extra is not installed (bash ci/install_serve.sh)")
    assert "usage:" in help_text("-m", "runtime", command)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_help(name):
    module, _, function = SCRIPTS[name].partition(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function} as f; sys.exit(f())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{name} --help failed:\n{out.stderr[-2000:]}"
    assert "usage:" in out.stdout


def test_help_names_only_commands_that_exist():
    texts = [help_text("-m", "export"), help_text("-m", "runtime")]
    texts += [help_text("-m", "runtime", c) for c in runtime_subcommands()
              if c != "serve" or importlib.util.find_spec("fastapi") is not None]
    subcommands = set(runtime_subcommands())
    for text in texts:
        for module, word in re.findall(r"python -m ([\w.]+)(?: ([a-z][\w-]*))?", text):
            assert importlib.util.find_spec(module) is not None, f"help names python -m {module}, which does not exist"
            if module == "runtime" and word:
                assert word in subcommands, f"help names python -m runtime {word}, which is not a subcommand"
