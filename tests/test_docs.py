"""The docs site builds, and every example in it is true.

- ``mkdocs build --strict`` passes: a broken link, anchor or API reference
  (mkdocstrings) fails it. Skipped only when mkdocs is not installed (the
  ``docs`` extra, part of ``dev``).
- Every ``python`` block of every page runs, in order, in one fresh directory
  per page, as a script in its own process. The conventions:

  - a block whose first line is ``# not-run: <why>`` is not run (say why);
  - a block with ``title="name.py"`` is a file: it is written to that name,
    not run by itself, so that later blocks (and the page's shell commands)
    import or run it;
  - a ``text title="Output"`` block right after a python block is that block's
    exact standard output.

- The quickstart's shell session runs as written: a durable run, a crash, the
  orphaned run listed, and the resume that completes it.
- Every ``tailrace`` command and option the docs name exists; the README's
  concept table links pages and headings that exist; the semantics page lists
  every clause and names only paths that exist.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shlex
import sqlite3
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SCRIPT = Path(sys.executable).parent / "tailrace"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

#: A fenced block at any indentation: its indent, language, attributes and body.
FENCE = re.compile(r"^( *)```(\w*)([^\n]*)\n(.*?)^\1```[ \t]*$", re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')
NOT_RUN = re.compile(r"# not-run: \S")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    language: str
    title: str | None
    code: str
    start: int  # offset of the fence in the page
    end: int


def blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, dedented to its fence."""
    found = []
    for m in FENCE.finditer(text):
        indent = len(m.group(1))
        body = "".join(line[indent:] for line in m.group(4).splitlines(keepends=True))
        title = TITLE.search(m.group(3))
        found.append(Block(m.group(2), title.group(1) if title else None, body, m.start(), m.end()))
    return found


def examples(text: str) -> list[tuple[Block, str | None]]:
    """The page's python blocks, each with the exact output its ``Output`` block promises."""
    found = blocks(text)
    pairs = []
    for i, block in enumerate(found):
        if block.language != "python":
            continue
        nxt = found[i + 1] if i + 1 < len(found) else None
        promised = None
        if (
            nxt is not None
            and nxt.language == "text"
            and nxt.title == "Output"
            and not text[block.end : nxt.start].strip()
        ):
            promised = nxt.code
        pairs.append((block, promised))
    return pairs


def _env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    return {**keep, "COLUMNS": "200", "PYTHONHASHSEED": "0"}


# -- the site builds ----------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index.html", "quickstart/index.html", "reference/tailrace/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [page for page in PAGES if f": {page}\n" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


# -- every example is true ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if "```python" in (DOCS / p).read_text()])
def test_the_python_examples_of_a_page_run(page: str, tmp_path: Path) -> None:
    text = (DOCS / page).read_text()
    ran = 0
    for n, (block, promised) in enumerate(examples(text)):
        where = f"{page}, python block {n + 1}"
        if block.code.startswith("# not-run"):
            assert NOT_RUN.match(block.code), f"{where}: say why after '# not-run: '"
            assert promised is None, f"{where}: an output is promised for a block never run"
            continue
        if block.title is not None:
            (tmp_path / block.title).write_text(block.code)
            assert promised is None, f"{where}: {block.title} is a file, it prints nothing"
            continue
        script = tmp_path / f"block_{n + 1}.py"
        script.write_text(block.code)
        done = subprocess.run(
            [sys.executable, script.name],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{where} failed:\n{block.code}\n{done.stderr}"
        if promised is not None:
            assert done.stdout.rstrip() == promised.rstrip(), f"{where} printed:\n{done.stdout}"
        ran += 1
    assert ran, f"{page} has python blocks but none runs"


def test_the_block_conventions_are_understood() -> None:
    page = (
        '```python title="m.py"\nX = 1\n```\n\n'
        "```python\nimport m\nprint(m.X)\n```\n\n"
        '```text title="Output"\n1\n```\n'
        "    ```python\n    # not-run: indented, in an admonition\n    ```\n"
    )
    [(file, nothing), (script, promised), (skipped, none)] = examples(page)
    assert (file.title, file.code, nothing) == ("m.py", "X = 1\n", None)
    assert (script.title, script.code, promised) == (None, "import m\nprint(m.X)\n", "1\n")
    assert skipped.code == "# not-run: indented, in an admonition\n" and none is None


# -- the quickstart works as written ------------------------------------------------


@pytest.mark.slow
def test_the_quickstart_session_runs_as_written(tmp_path: Path) -> None:
    assert SCRIPT.is_file(), f"the console script is not installed at {SCRIPT}"
    text = (DOCS / "quickstart.md").read_text()
    for block in blocks(text):
        if block.language == "python" and block.title:
            (tmp_path / block.title).write_text(block.code)
    session = [
        line
        for block in blocks(text)
        if block.language == "bash"
        for line in block.code.splitlines()
        if line.strip() and not line.startswith(("pip ", "python3 -m venv"))
    ]
    assert session, "quickstart.md shows no shell session"
    bin_dir = str(SCRIPT.parent)
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    outputs = []
    for line in session:
        done = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        outputs.append((line, done))
    crashed = [done for line, done in outputs if "CRASH=1" in line]
    assert crashed and crashed[0].returncode in (-9, 128 + 9), "the crash line did not crash"
    for line, done in outputs:
        if "CRASH=1" not in line:
            assert done.returncode == 0, f"$ {line}\n{done.stdout}{done.stderr}"
    listed = [
        done.stdout for line, done in outputs if shlex.split(line)[:2] == ["tailrace", "runs"]
    ]
    assert any("running (orphaned)" in out for out in listed), listed
    resumed = [done for line, done in outputs if shlex.split(line)[1:2] == ["resume"]]
    assert resumed and "completed" in resumed[-1].stdout
    assert '"tides: 3 pages"' in resumed[-1].stdout
    # What the page says: fetch's committed completion is reused, summarise runs again.
    with contextlib.closing(sqlite3.connect(tmp_path / "tailrace.db")) as db:
        starts = db.execute(
            "SELECT node_id, COUNT(*) FROM events WHERE run_id = 'second' AND type = ?"
            " GROUP BY node_id ORDER BY node_id",
            ("node_started",),
        ).fetchall()
    assert starts == [("fetch", 1), ("summarise", 2)]


# -- pages say what is, not how it came to be ---------------------------------------------

#: Words of development history: a round of work, an issue, a wave, the release before.
HISTORY = re.compile(
    r"\bround[ -]\d|\bissues? \d+|\bfinding \d+|\bwave\b|previous release|DESIGN\.md", re.I
)


@pytest.mark.parametrize("page", ["../README.md", *PAGES])
def test_a_page_carries_no_development_history(page: str) -> None:
    """History (rounds, issue numbers, before and after) belongs in CHANGELOG.md, and the
    design notes the pages were written from do not ship."""
    text = (DOCS / page).read_text()
    found = [m.group(0) for m in HISTORY.finditer(text)]
    assert not found, f"{page} says {found}: move it to CHANGELOG.md"


# -- the otel page's install line installs what its examples import ---------------------


def _distribution_of(module: str) -> str:
    """The installed distribution that provides ``module`` (namespace packages included)."""
    top = module.partition(".")[0]
    path = module.replace(".", "/")
    for name in importlib.metadata.packages_distributions().get(top, []):
        files = importlib.metadata.files(name) or []
        if any(str(f) in (f"{path}/__init__.py", f"{path}.py") for f in files):
            return name
    raise AssertionError(f"no installed distribution provides {module}")


def _extra(name: str) -> set[str]:
    """The distributions extra ``name`` of pyproject.toml requires, by their names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[;\s]", req, maxsplit=1)[0].lower()
            for req in project["optional-dependencies"][name]}  # fmt: skip


def test_the_otel_pages_install_line_installs_what_its_examples_import() -> None:
    text = (DOCS / "otel.md").read_text()
    (install,) = [
        line for b in blocks(text) if b.language == "bash" for line in b.code.splitlines()
        if line.startswith("pip install")
    ]  # fmt: skip
    assert shlex.split(install.partition("#")[0])[2:] == ["tailrace[otel]"], install
    imported = {
        m.group(1)
        for b, _ in examples(text)
        if not b.code.startswith("# not-run")
        for m in re.finditer(r"^(?:from|import) (opentelemetry[\w.]*)", b.code, re.M)
    }
    assert any(m.startswith("opentelemetry.sdk") for m in imported), imported
    for module in sorted(imported):
        assert _distribution_of(module).lower() in _extra("otel"), module


# -- the versions page's commands run as printed ---------------------------------------


def _section(text: str, heading: str) -> str:
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"no section {heading!r}"
    return found.group(1)


@pytest.mark.slow
def test_the_versions_commands_run_as_printed(tmp_path: Path) -> None:
    """versions.md's example, then its shell commands in the same folder, as printed: the
    graph files import their neighbours, and a file of two graphs of one name is named."""
    assert SCRIPT.is_file(), f"the console script is not installed at {SCRIPT}"
    text = (DOCS / "versions.md").read_text()
    for block in blocks(text):
        if block.language == "python" and block.title:
            (tmp_path / block.title).write_text(block.code)
    (main,) = [b for b, _ in examples(text) if b.title is None and "asyncio.run" in b.code]
    (tmp_path / "example.py").write_text(main.code)
    env = {**_env(), "PATH": f"{SCRIPT.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (commands,) = [b for b in blocks(_section(text, "From the command line (V5)"))]
    lines = [line for line in commands.code.splitlines() if line.strip()]
    assert len(lines) >= 5, lines
    for line in lines:
        done = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        expected = 1 if "# exit 1" in line else 0
        assert done.returncode == expected, f"$ {line}\n{done.stdout}{done.stderr}"
        assert "Traceback" not in done.stdout + done.stderr, f"$ {line}\n{done.stderr}"
        if expected:
            assert "'review': its kind changed from gate to task" in done.stdout, done.stdout
    whole = subprocess.run(
        [str(SCRIPT), "check", "r2", "--graphs", "flow_v2.py"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert whole.returncode != 0
    assert "flow_v2.py:graph, flow_v2.py:broken" in " ".join(whole.stderr.split())


# -- names and links ------------------------------------------------------------------


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, subcommand, options) of every ``tailrace`` command line the docs show or name."""
    found = []
    for page in PAGES:
        text = (DOCS / page).read_text()
        lines = [
            line
            for block in blocks(text)
            if block.language in ("bash", "")
            for line in block.code.splitlines()
        ]
        spans = re.findall(r"`(tailrace [a-z][^`]*)`", text)
        for snippet in lines + spans:
            snippet = " ".join(snippet.split())
            words = snippet.split()
            if "tailrace" not in words[:2] or len(words) < words.index("tailrace") + 2:
                continue
            command = words[words.index("tailrace") + 1]
            if not re.fullmatch(r"[a-z][a-z-]*", command):
                continue
            found.append((page, command, re.findall(r"(?<![\w-])--[a-z][a-z-]*", snippet)))
    return found


@pytest.mark.parametrize(("page", "command", "options"), _documented_commands())
def test_every_command_and_option_the_docs_name_exists(
    page: str, command: str, options: list[str]
) -> None:
    from typer.testing import CliRunner

    from tailrace.cli._app import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, f"{page}: tailrace {command}: {result.output}"
    for option in options:
        assert option in result.output, f"{page}: tailrace {command} has no {option}"


def _anchor(heading: str) -> str:
    """The anchor of a heading, as both GitHub and mkdocs' toc make it for plain headings."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_concept_table_links_pages_and_headings_that_exist() -> None:
    section = re.search(r"^## Concepts\n(.*?)(?=^## |\Z)", README.read_text(), re.M | re.S)
    assert section, "README.md has no Concepts section"
    links = re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#([\w-]+))?\)", section.group(1))
    assert len(links) >= 8, links
    for path, anchor in links:
        assert (ROOT / path).is_file(), f"README links a missing page {path}"
        if anchor:
            assert anchor in _headings(ROOT / path), f"README links a missing {path}#{anchor}"


CLAUSES = [
    *(f"G{i}" for i in range(1, 4)),
    *(f"E{i}" for i in range(1, 12)),
    *(f"D{i}" for i in range(1, 7)),
    *(f"Q{i}" for i in range(1, 8)),
    *(f"T{i}" for i in range(1, 6)),
    *(f"M{i}" for i in range(1, 8)),
    *(f"V{i}" for i in range(1, 6)),
    *(f"S{i}" for i in range(1, 5)),
    *(f"R{i}" for i in range(1, 7)),
    *(f"X{i}" for i in range(1, 7)),
]


def test_the_semantics_page_lists_every_clause_and_names_real_paths() -> None:
    text = (DOCS / "semantics.md").read_text()
    for clause in CLAUSES:
        assert f"| {clause} |" in text, clause
    paths = set(re.findall(r"`([\w./]+(?:\.py|/))`", text))
    assert paths
    for path in sorted(paths):
        if path.startswith(("tests/", "examples/", "src/")):
            assert (ROOT / path).exists(), f"docs/semantics.md names missing {path}"
        else:  # a module or package of the source tree
            assert (ROOT / "src" / "tailrace" / path).exists(), f"no src/tailrace/{path}"
