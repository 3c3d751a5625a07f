"""The documents' commands and links stay true.

Every fenced shell block of README.md and docs/**/*.md is scanned for `python -m MODULE ...`
commands: each distinct module (and each subcommand used, e.g. `runtime generate`) must answer
`--help` with exit status 0 under this interpreter, and every `--flag` a document passes to it must
appear in that help. Every `bash ci/...` script named must exist, and every relative link (with
its #anchor, where it has one) must point at an existing file and heading. Runs in well under a
minute: only `--help` is executed.
"""
from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# Pages other work writes; a link to them may precede them (reported as a warning, not a failure).
PENDING = {ROOT / "docs" / "large-models.md", ROOT / "docs" / "code-notes.md"}

FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")
PYTHON_M = re.compile(r"(?:^|[\s/])python3?\s+-m\s+([A-Za-z_][\w.]*)(.*)$")
SUBCOMMAND = re.compile(r"^[a-z][a-z_]*$")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
SCRIPT = re.compile(r"\bbash\s+(ci/[\w./-]+\.sh)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def shell_blocks(path: Path) -> list[str]:
    """The text of each fenced block whose language is a shell (or none)."""
    blocks, current, language = [], None, None
    for line in path.read_text(encoding="utf-8").splitlines():
        fence = FENCE.match(line)
        if fence and current is None:
            current, language = [], fence.group(1).lower()
        elif fence:
            if language in SHELL_LANGUAGES:
                blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def split_commands(line: str) -> list[str]:
    """Split at ; && || | outside [...] (a usage synopsis writes alternatives as [--a | --b])."""
    parts, current, depth, i = [], "", 0, 0
    while i < len(line):
        c = line[i]
        depth += (c == "[") - (c == "]")
        if depth <= 0 and (line.startswith("&&", i) or line.startswith("||", i)):
            parts.append(current); current = ""; i += 2; continue
        if depth <= 0 and c in ";|":
            parts.append(current); current = ""; i += 1; continue
        current += c
        i += 1
    return [p.strip() for p in parts + [current] if p.strip()]


def shell_lines(block: str) -> list[str]:
    """Logical lines: backslash continuations and a synopsis's indented `[...` lines joined,
    comments dropped, split into commands."""
    joined: list[str] = []
    for line in re.sub(r"\\\n", " ", block).splitlines():
        if joined and re.match(r"^\s+\[", line):
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    lines = []
    for line in joined:
        line = re.split(r"\s#", " " + line, maxsplit=1)[0]
        lines.extend(split_commands(line))
    return lines


@functools.lru_cache(maxsize=None)
def commands() -> dict[tuple[str, ...], dict]:
    """(module,) or (module, subcommand) -> {"flags": set, "where": set of documents}."""
    found: dict[tuple[str, ...], dict] = {}
    for path in DOCUMENTS:
        for block in shell_blocks(path):
            for line in shell_lines(block):
                match = PYTHON_M.search(line)
                if not match:
                    continue
                module, args = match.group(1), match.group(2).split()
                key = (module,)
                if args and SUBCOMMAND.match(args[0]):
                    key = (module, args[0])   # a subcommand, or a positional word: help decides
                entry = found.setdefault(key, {"flags": set(), "where": set()})
                entry["flags"].update(FLAG.findall(" ".join(args)))
                entry["where"].add(str(path.relative_to(ROOT)))
    return found


@functools.lru_cache(maxsize=None)
def help_text(*words: str) -> str:
    result = subprocess.run([sys.executable, "-m", *words, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"python -m {' '.join(words)} --help exited {result.returncode}:\n{result.stderr}"
    return result.stdout


def subcommands(module: str) -> set[str]:
    """The subcommands argparse lists as {a,b,c} in the module's usage line, if any."""
    usage = help_text(module).split("\n\n")[0]
    match = re.search(r"\{([\w,-]+)\}", usage)
    return set(match.group(1).split(",")) if match else set()


def test_documents_show_commands():
    assert len(commands()) >= 5, "no python -m commands found: has the extraction broken?"


def _keys() -> list[tuple[str, ...]]:
    modules = sorted({key[0] for key in commands()})
    return [(m,) for m in modules] + sorted(k for k in commands() if len(k) == 2)


@pytest.mark.parametrize("key", _keys(), ids=lambda key: " ".join(key))
def test_command_help(key):
    module = key[0]
    if len(key) == 1:
        text = help_text(module)
        flags = set().union(*(v["flags"] for k, v in commands().items()
                              if k[0] == module and (len(k) == 1 or k[1] not in subcommands(module))))
    else:
        if key[1] not in subcommands(module):
            pytest.skip(f"{key[1]!r} is a positional argument of {module}, checked with the module")
        if module == "runtime" and key[1] == "serve" and importlib.util.find_spec("fastapi") is None:
            pytest.skip("runtime serve needs the serve extra (bash ci/install_serve.sh)")
        text = help_text(*key)
        flags = commands()[key]["flags"]
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    where = sorted(set().union(*(v["where"] for k, v in commands().items() if k[:len(key)] == key)))
    assert not missing, f"python -m {' '.join(key)}: flags shown in {where} that its --help lacks: {missing}"


def test_scripts_exist():
    named = {m for path in DOCUMENTS for block in shell_blocks(path) for m in SCRIPT.findall(block)}
    assert "ci/demo.sh" in named
    missing = sorted(s for s in named if not (ROOT / s).is_file())
    assert not missing, f"scripts the documents run that do not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not in_fence:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def test_relative_links_resolve():
    broken, pending = [], []
    for path in DOCUMENTS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                (pending if resolved in PENDING else broken).append(where)
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(where + " (no such heading)")
    for link in pending:
        warnings.warn(f"link to a page not written yet: {link}")
    assert not broken, "broken links:\n" + "\n".join(broken)
