"""Every code block of the documentation runs: each page of ``docs/`` and ``README.md``.

One test per page runs its blocks in order, the way ``docs/README.md`` says (``python`` blocks in
this process, one namespace per page; a ``python`` block whose first line is ``# FILE.py; run with:
COMMAND`` as that command; ``bash`` blocks in a shell), and fails on the first block that raises,
exits non-zero or warns, naming its page and line. A block marked ``*Not run by the docs tests:
REASON.*`` on the line before its fence is not run. The blocks are found with markdown-it, the
parser MyST itself uses, so what runs is what the site shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
README = ROOT / "README.md"
PAGES = sorted(
    p for p in (ROOT / "docs").rglob("*.md") if not {"_build", "_generated"} & set(p.relative_to(ROOT).parts)
) + [README]

NOT_RUN = re.compile(r"^\*Not run by the docs tests: (?P<reason>\S.*)\*$")
LAUNCHED = re.compile(r"^# (?P<file>[\w.-]+\.py); run with: (?P<command>.+)$")
RUNNABLE = {"python", "bash"}
NOT_CODE = {"text", "diff", "json", "toml", "c"}
MARKDOWN_DIRECTIVES = {"note", "tip", "warning", "important", "caution", "attention", "seealso", "admonition", "hint"}
"""MyST directives whose content is Markdown that may hold code blocks of its own."""
OTHER_DIRECTIVES = {"toctree", "eval-rst", "include", "literalinclude", "image", "figure", "math", "contents"}
"""Directives holding no code block to run (``literalinclude`` shows a file of the checkout, run by its own test)."""
BLOCK_TIMEOUT_S = 300
SCRATCH_LINKS = ("examples", "benchmarks", "tests")
"""The checkout's folders a block's relative paths may name, linked into its scratch directory."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the block's first line of code
    language: str
    code: str
    not_run: str | None  # the marker's reason

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced code blocks of a page, in order (those inside admonitions too)."""
    return _blocks(page, page.read_text(), 0)


def _blocks(page: Path, text: str, offset: int) -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(text)
    found = []
    for i, token in enumerate(tokens):
        if token.type == "code_block":
            raise AssertionError(f"{page}:{offset + token.map[0] + 1}: an indented code block; use a fenced one")
        if token.type != "fence":
            continue
        info = token.info.strip()
        first_line = offset + token.map[0] + 2
        directive = re.fullmatch(r"\{([\w-]+)\}.*", info)
        if directive:
            name = directive.group(1)
            if name in MARKDOWN_DIRECTIVES:
                found += _blocks(page, token.content, first_line - 1)
            elif name not in OTHER_DIRECTIVES:
                raise AssertionError(f"{page}:{first_line - 1}: directive {{{name}}}: use a plain fence for code")
            continue
        marker = None
        if i >= 3 and tokens[i - 1].type == "paragraph_close" and tokens[i - 2].type == "inline":
            match = NOT_RUN.match(tokens[i - 2].content.strip().splitlines()[-1])
            marker = match and match.group("reason")
        language = info.split()[0] if info else ""
        found.append(Block(page, first_line, language, token.content, marker))
    return found


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def scratch(tmp_path: Path) -> Path:
    for name in SCRATCH_LINKS:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def child_env(tmp_path: Path) -> dict[str, str]:
    """A block's processes: this interpreter's tools first on PATH, one CPU device per JAX process."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "XLA_FLAGS": "",
        "JAX_PLATFORMS": "cpu",
        "BAGUA_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONUNBUFFERED": "1",
    }


def run_command(block: Block, command: list[str], cwd: Path) -> None:
    try:
        result = subprocess.run(
            command, cwd=cwd, env=child_env(cwd), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{error.output}") from None
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.where}: exit {result.returncode}\n{output[-6000:]}"
    assert "Warning" not in output, f"{block.where}: printed a warning\n{output[-6000:]}"


def run_python_here(block: Block, namespace: dict) -> None:
    # Leading newlines put the block's lines at their place in the page, so tracebacks name the page's line.
    code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
    exec(code, namespace)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_block_of_the_page_runs(page, tmp_path, monkeypatch):
    blocks = blocks_of(page)
    for block in blocks:
        assert block.language in RUNNABLE | NOT_CODE, (
            f"{block.where}: fence language {block.language!r}; one of {sorted(RUNNABLE | NOT_CODE)} (docs/README.md)"
        )
    runnable = [b for b in blocks if b.language in RUNNABLE and b.not_run is None]
    if not runnable:
        pytest.skip("no block to run")
    work = scratch(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(work / "cache"))
    namespace: dict = {"__name__": "__docs__"}
    for block in runnable:
        first = block.code.splitlines()[0] if block.code.strip() else ""
        launched = LAUNCHED.match(first) if block.language == "python" else None
        if launched:
            folder = work / f"block{block.line}"
            folder.mkdir()
            scratch(folder)
            (folder / launched.group("file")).write_text(block.code)
            run_command(block, ["bash", "-c", launched.group("command")], folder)
        elif block.language == "python":
            run_python_here(block, namespace)
        else:
            run_command(block, ["bash", "-euo", "pipefail", "-c", block.code], work)


def readme_commands_ci_runs() -> list[str]:
    return [
        b.code.strip()
        for b in blocks_of(README)
        if b.language == "bash" and b.not_run is not None and "runs this command as written" in b.not_run
    ]


def test_ci_runs_the_readme_commands_as_written():
    """The README's two commands, marked as run by .ci/run, are lines of .ci/run (each in a subshell)."""
    commands = readme_commands_ci_runs()
    assert len(commands) == 2, commands
    ci_lines = [line.strip() for line in CI_RUN.read_text().splitlines()]
    for command in commands:
        assert f"({command})" in ci_lines, f".ci/run does not run the README's command as written:\n{command}"


def test_the_readme_is_a_first_page():
    """At most 250 lines, and every relative link it holds leads to a file of the checkout."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_a_marked_block_is_found_and_others_run():
    """The parser can fail: it sees a marker only right before a fence, and the launched form only on line one."""
    page = ROOT / "docs" / "README.md"
    text = (
        "Intro.\n\n*Not run by the docs tests: needs a GPU.*\n\n```bash\nnvidia-smi\n```\n\n"
        "A paragraph.\n\n```python\n# a.py; run with: python a.py\nprint(1)\n```\n"
    )
    first, second = _blocks(page, text, 0)
    assert (first.not_run, first.line, first.code) == ("needs a GPU.", 6, "nvidia-smi\n")
    assert second.not_run is None and LAUNCHED.match(second.code.splitlines()[0]).group("file") == "a.py"
