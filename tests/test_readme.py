"""The README and docs/ as a reader meets them: the Python runs, the commands parse, the links lead
somewhere, every CLI flag is documented, and the README stays a five-minute read.

Convention for code blocks in README.md and docs/*.md: a block fenced ```` ```python ```` runs, in
order, in one namespace per file (a later block may use an earlier block's names); a block fenced
```` ```python no-run ```` is only compiled (it names the reader's own model and batch). Only the
README has blocks that run; keep them to a tiny model built in the block itself, so this file
stays fast. Shell blocks (```` ```bash ````) are not run here: every ``sac-plan`` /
``python -m planner.apply`` line in them is parsed by the CLI's own parser. Every source path
named (``benchmarks/offload_e2e.py``, ``planner/applying/offload.py``) must exist.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from planner.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, ROOT / "CHANGELOG.md", *DOCS]
README_MAX_LINES = 220

_FENCE = re.compile(r"^```([\w-]*)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _blocks(path: Path, language: str) -> list[tuple[str, str]]:
    """``(info, code)`` of each fenced block of ``language``, outside other fences."""
    return [(m.group(2).strip(), m.group(3)) for m in _FENCE.finditer(path.read_text())
            if m.group(1) == language]


def _prose(path: Path) -> str:
    """The file without its fenced blocks (headings and links inside code do not count)."""
    return _FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to hyphens; a link in the heading counts by its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _commands(path: Path) -> list[list[str]]:
    """Each command of the file's bash blocks (``a && b`` is two), continuation lines joined,
    comments dropped."""
    out = []
    for _, code in _blocks(path, "bash"):
        for line in code.replace("\\\n", " ").splitlines():
            command: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word != "&&":
                    command.append(word)
                elif command:
                    out.append(command)
                    command = []
    return out


def _cli_argv(command: list[str]) -> list[str] | None:
    """The arguments of a ``sac-plan`` / ``python -m planner.apply`` command; None for others."""
    if command[:1] == ["sac-plan"]:
        return command[1:]
    if command[:3] == ["python", "-m", "planner.apply"]:
        return command[3:]
    return None


def test_the_readme_is_a_five_minute_read():
    n_lines = len(README.read_text().splitlines())
    assert n_lines <= README_MAX_LINES, (
        f"README.md has {n_lines} lines (at most {README_MAX_LINES}): move the detail into docs/")


def test_the_readme_python_runs_as_written(capsys):
    blocks = [code for info, code in _blocks(README, "python") if "no-run" not in info.split()]
    assert blocks, "README.md shows no Python that runs"
    namespace: dict = {"__name__": "__readme__"}
    for code in blocks:
        exec(compile(code, str(README), "exec"), namespace)
    assert "SAC plan for" in capsys.readouterr().out  # the example prints its plan


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_python_block_compiles(path):
    for info, code in _blocks(path, "python"):
        assert set(info.split()) <= {"no-run"}, f"{path.name}: unknown fence info {info!r}"
        compile(code, str(path), "exec")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(path):
    for target in _LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor:
            slugs = {_slug(h) for h in _HEADING.findall(_prose(linked))}
            assert anchor in slugs, f"{path.name} links to {target}: no such heading in {linked.name}"


def test_every_cli_flag_is_documented():
    documented = (ROOT / "docs" / "cli.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", build_parser().format_help()))
    flags -= {"-h", "--help", "-m"}  # -m: the program name, python -m planner.apply
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", documented))
    assert not missing, f"docs/cli.md does not mention {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_command_shown_parses(path):
    from planner.search.cli import build_parser as search_parser

    for command in _commands(path):
        argv = _cli_argv(command)
        if argv is not None and "--help" not in argv:
            parser = search_parser() if argv[:1] == ["search"] else build_parser()
            argv = argv[1:] if argv[:1] == ["search"] else argv
            try:
                parser.parse_args(argv)
            except SystemExit:  # the parser printed why
                pytest.fail(f"{path.name} shows `{shlex.join(command)}`, which the CLI refuses")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_file_named_in_the_tree_exists(path):
    """Paths such as `benchmarks/offload_e2e.py` or `planner/applying/offload.py` name real files
    (not checked in the changelog, which names the files of its time)."""
    for name in set(re.findall(r"(?<![\w/.])((?:benchmarks|estimators|solver|planner|examples|tests)"
                                r"/[\w/]+\.(?:py|ipynb))", path.read_text())):
        assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"
