"""The commands in README.md and HowToApproachvLLM.md keep working (MinivLLM's README drifted).

Every line of every fenced ```bash block in the two documents is a command (a trailing `\\`
continues it on the next line; blank lines and lines starting with `#` are skipped). Each one is
classified and checked, from the repository root, in a CPU-only environment:

- `uv run pytest ...`: NOT run here. Those are the CI commands themselves (.ci/run runs
  `uv run pytest` and `uv run pytest -m slow`, which include this file), so running them again
  would run the suite twice or recurse. We only check that the test files and `file::test` ids
  they name exist.
- ends with `# needs a GPU`: not run (CI has no GPU). The script must exist and
  `python SCRIPT --help` must exit 0.
- ends with `# edits your checkout` (the Llama exercise: rm / git checkout): never run. Every
  repository path it names must exist.
- `python examples/exercises.py ...`: run and checked by tests/docs/test_exercises.py, which also
  checks that the guide lists every probe. Skipped here so they do not run twice.
- `python [benchmarks/]benchmark_X.py --quick` with no output excerpt: run by
  tests/docs/test_benchmark_scripts_quick.py, which also checks that every implementation the
  script compares is marked OK. Skipped here so it does not run twice (tens of seconds); a test
  below checks that the benchmark test runs that script.
- `uv run python SCRIPT ARGS` (or `python SCRIPT ARGS`): run as `sys.executable SCRIPT ARGS`.
  `uv run` would resolve the same locked environment we are running in; calling its interpreter
  directly saves uv's start-up and the lock check, and works where uv is not on PATH.
- anything else: run with bash, must exit 0.

A command is run once even when both documents show it. The environment is CI-like: no GPU
visible (CUDA_VISIBLE_DEVICES=""), no hub access (HF_HUB_OFFLINE=1, so main.py takes its
documented offline fallback to the bundled model instead of downloading Qwen3-0.6B), CI=1.
Commands that load a real model are marked slow: `uv run pytest` skips them and
`uv run pytest -m slow` runs them.

A ```text block right after a bash block that holds one command is an excerpt of that command's
output: every line of it, except `...`, must appear as a line of the real output, in the same
order (whitespace runs compared as one space), so a line cannot be borrowed from another part
of the output. A ```python block in the guide is an excerpt of a source file: its first line
names the file (`# src/...`), the file must be one the excerpt's step names (its `## ` section
mentions the path), and every other line must be a line of the file. Finally, every repository
path and every `tests/x.py::test_name` mentioned in HowToApproachvLLM.md must exist.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "HowToApproachvLLM.md")
GUIDE = REPO / "HowToApproachvLLM.md"
GPU_MARK = "# needs a GPU"
EDITS_MARK = "# edits your checkout"
COVERED_BY_EXERCISE_TEST = "examples/exercises.py"
BENCHMARK_TEST = REPO / "tests" / "docs" / "test_benchmark_scripts_quick.py"
# Scripts that load a real model (the bundled SmolLM2 GGUF or a random checkpoint built on the fly).
SLOW_SCRIPTS = ("main.py", "main_llama32.py", "examples/prefix_cache_demo.py",
                "benchmarks/benchmark_spec_decode.py")
TIMEOUT_S = 300
SLOW_TIMEOUT_S = 900


@dataclass
class Command:
    text: str  # the command with any trailing comment
    where: str  # "FILE:LINE"
    output: list[str] = field(default_factory=list)  # expected excerpt lines (text block)

    @property
    def code(self) -> str:
        """The command without a trailing `# ...` comment."""
        words = shlex.split(self.text, comments=True)
        return shlex.join(words)

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def _fences(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first content line, lines) of every fenced block."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start, body = m.group(1), i + 2, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append((lang, start, body))
        i += 1
    return blocks


def extract_commands(doc: str) -> list[Command]:
    path = REPO / doc
    commands: list[Command] = []
    blocks = _fences(path)
    for index, (lang, start, body) in enumerate(blocks):
        if lang != "bash":
            continue
        in_block: list[Command] = []
        pending, pending_line = "", 0
        for offset, raw in enumerate(body):
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue
            if not pending:
                pending_line = start + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            in_block.append(Command(pending + line, f"{doc}:{pending_line}"))
            pending = ""
        assert not pending, f"{doc}:{pending_line}: a command ends with a line continuation"
        if len(in_block) == 1 and index + 1 < len(blocks) and blocks[index + 1][0] == "text":
            in_block[0].output = blocks[index + 1][2]
        commands.extend(in_block)
    return commands


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in extract_commands(doc)]


def kind(command: Command) -> str:
    words = command.words
    if words[:3] == ["uv", "run", "pytest"]:
        return "pytest"
    if command.text.rstrip().endswith(GPU_MARK):
        return "gpu"
    if command.text.rstrip().endswith(EDITS_MARK):
        return "edits"
    script = python_script(words)
    if script == COVERED_BY_EXERCISE_TEST:
        return "exercise"
    if (script is not None and re.fullmatch(r"(benchmarks/)?benchmark_\w+\.py", script)
            and words[words.index(script) + 1:] == ["--quick"] and not command.output):
        return "benchmark"
    if script is not None:
        return "python"
    return "shell"


def python_script(words: list[str]) -> str | None:
    if words[:3] == ["uv", "run", "python"] and len(words) > 3:
        return words[3]
    if words[:1] in (["python"], ["python3"]) and len(words) > 1:
        return words[1]
    return None


def runnable() -> list[Command]:
    seen: dict[str, Command] = {}
    for command in all_commands():
        if kind(command) in ("python", "shell"):
            first = seen.setdefault(command.code, command)
            if command.output and not first.output:
                first.output = command.output
    return list(seen.values())


def ci_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", CI="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _normalize(line: str) -> str:
    return " ".join(line.split())


def _param(command: Command) -> object:
    script = python_script(command.words) or ""
    marks = [pytest.mark.slow] if script in SLOW_SCRIPTS else []
    return pytest.param(command, id=f"{command.where} {command.code}", marks=marks)


# ------------------------------------------------------------------------------ the commands
def test_documents_have_commands() -> None:
    for doc in DOCS:
        assert extract_commands(doc), f"{doc} has no ```bash block: did the format change?"


@pytest.mark.parametrize("command", [_param(c) for c in runnable()])
def test_command_runs(command: Command) -> None:
    words = command.words
    script = python_script(words)
    if script is not None:
        argv = [sys.executable, script, *words[(4 if words[0] == "uv" else 2):]]
        assert (REPO / script).is_file(), f"{command.where}: {script} does not exist"
    else:
        argv = ["bash", "-c", command.code]
    slow = script in SLOW_SCRIPTS
    result = subprocess.run(argv, cwd=REPO, env=ci_env(), capture_output=True, text=True,
                            timeout=SLOW_TIMEOUT_S if slow else TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"{command.where}: `{command.code}` exited {result.returncode}:\n{output[-4000:]}")
    missing = _not_printed_in_order(command.output, result.stdout.splitlines())
    assert not missing, (
        f"{command.where}: the documented output of `{command.code}` no longer matches; "
        f"lines not printed any more, or not in this order:\n  " + "\n  ".join(missing)
        + f"\nactual output:\n{result.stdout[-4000:]}")


def _not_printed_in_order(excerpt: list[str], printed: list[str]) -> list[str]:
    """The excerpt's lines that are not found in `printed` after the previous line's match."""
    lines = [_normalize(line) for line in printed]
    missing, at = [], 0
    for line in excerpt:
        if not line.strip() or line.strip() == "...":
            continue
        try:
            at = lines.index(_normalize(line), at) + 1
        except ValueError:
            missing.append(line)
    return missing


@pytest.mark.parametrize("command", [pytest.param(c, id=f"{c.where} {c.code}")
                                     for c in all_commands() if kind(c) == "gpu"])
def test_gpu_command_has_working_help(command: Command) -> None:
    script = python_script(command.words)
    assert script is not None, f"{command.where}: only `python SCRIPT` commands can be GPU-only"
    if script.startswith("tests/"):
        return
    assert (REPO / script).is_file(), f"{command.where}: {script} does not exist"
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=ci_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-3000:]}"


def test_benchmark_quick_commands_are_run_by_the_benchmark_test() -> None:
    """The `[benchmarks/]benchmark_X.py --quick` commands skipped above are run there instead."""
    source = BENCHMARK_TEST.read_text()
    for command in (c for c in all_commands() if kind(c) == "benchmark"):
        script = python_script(command.words)
        assert f'["{script}"]' in source, (
            f"{command.where}: `{command.code}` is run by neither this test nor "
            f"{BENCHMARK_TEST.name}: add [\"{script}\"] to its commands")


def test_checkout_editing_commands_name_existing_paths() -> None:
    for command in (c for c in all_commands() if kind(c) == "edits"):
        paths = [w for w in command.words if "/" in w or w.endswith((".py", ".md"))]
        assert paths, f"{command.where}: names no path"
        for p in paths:
            assert (REPO / p).exists(), f"{command.where}: {p} does not exist"


def test_pytest_commands_name_existing_tests() -> None:
    """`uv run pytest ...` is CI's own command (run by .ci/run), so we only check its targets."""
    for command in (c for c in all_commands() if kind(c) == "pytest"):
        words = command.words[3:]
        for previous, word in zip([""] + words, words):
            if word.startswith("-") or previous in ("-m", "-k"):  # an option or its value
                continue
            _check_test_reference(word, command.where)


def test_ci_runs_the_readme_test_commands() -> None:
    """.ci/run runs the README's `uv run pytest` commands, verbatim and all of them."""
    readme = [c.code for c in extract_commands("README.md") if kind(c) == "pytest"]
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci = [line.strip() for line in ci_lines if line.strip().startswith("uv run pytest")]
    assert readme, "README.md shows no `uv run pytest` command"
    assert ci == readme, f".ci/run runs {ci}, README.md gives {readme}"


# ------------------------------------------------------------------------------ the guide's names
def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def _check_test_reference(ref: str, where: str) -> None:
    file, _, name = ref.partition("::")
    assert (REPO / file).exists(), f"{where}: {file} does not exist"
    if name:
        name = name.split("[")[0]
        assert name in _test_functions(REPO / file), f"{where}: {file} has no test {name}"


def test_guide_names_existing_files_and_tests() -> None:
    text = GUIDE.read_text()
    refs = set(re.findall(r"`((?:tests|src|examples|configs|docs)/[\w./]+(?:::\w+)?)`", text))
    refs |= {f"src/myvllm/{m}" for m in re.findall(
        r"`((?:layers|kernels|models|engine|utils)/[\w.]+\.py)`", text)}
    assert len(refs) > 20, "the guide should name its files; did the pattern break?"
    for ref in sorted(refs):
        _check_test_reference(ref.rstrip("/").rstrip("."), "HowToApproachvLLM.md")
    # Bare test names in the guide's text (tests/x.py::name above covers the table).
    for file, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text):
        _check_test_reference(f"{file}::{name}", "HowToApproachvLLM.md")


# ------------------------------------------------------------------------------ code excerpts
def _sections(text: str) -> list[tuple[int, str]]:
    """(line number of the heading, text) of each `## ` section of the guide."""
    starts = [i for i, line in enumerate(text.splitlines()) if line.startswith("## ")]
    lines = text.splitlines()
    return [(start, "\n".join(lines[start:end]))
            for start, end in zip(starts, starts[1:] + [len(lines)])]


def test_guide_code_excerpts_are_in_the_files_their_steps_name() -> None:
    sections = _sections(GUIDE.read_text())
    excerpts = [(start, body) for lang, start, body in _fences(GUIDE) if lang == "python"]
    assert excerpts, "the guide quotes no code in ```python blocks: did the format change?"
    for start, body in excerpts:
        where = f"HowToApproachvLLM.md:{start}"
        m = re.fullmatch(r"#\s*((?:src|tests|examples|benchmarks)/\S+)", body[0].strip())
        assert m, f"{where}: a python excerpt's first line names its file: '# src/...'"
        path = m.group(1)
        assert (REPO / path).is_file(), f"{where}: {path} does not exist"
        section = next(text for heading, text in reversed(sections) if heading < start)
        assert f"`{path}`" in section, (
            f"{where}: quotes {path}, which the section ({section.splitlines()[0]!r}) never "
            "names: quote the file the step is about, or name it in its 'Where it lives'")
        source = {_normalize(line) for line in (REPO / path).read_text().splitlines()}
        missing = [line for line in body[1:] if line.strip() and _normalize(line) not in source]
        assert not missing, f"{where}: not (any more) in {path}:\n  " + "\n  ".join(missing)
