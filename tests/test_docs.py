"""Docs that cannot rot: the options the docs name exist, every option is documented, links resolve,
no dated or issue-numbered section is left, the README's figures are the report's, and the quick
start's offline snippet runs.

Each check reads the files a user reads (README.md, CHANGELOG.md, docs/) and compares them with
the real thing: the `--help` of the real commands, the files in the tree, the report generator.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"
USER_DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SERVE_CMD = re.compile(r"(?:llmserve|python3? -m gateway) serve\b")
ENGINE_CMD = re.compile(r"(?:python3? -m engine_svc\.server|llmserve engine)\b")


def help_options(*cmd: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, *cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    ).stdout
    return set(OPTION.findall(out)) - {"--help"}


@pytest.fixture(scope="module")
def serve_options() -> set[str]:
    return help_options("-m", "gateway", "serve")


@pytest.fixture(scope="module")
def engine_options() -> set[str]:
    return help_options("-m", "engine_svc.server")


def command_lines(pattern: re.Pattern) -> list[tuple[Path, str]]:
    """The rest of every shell line (in code blocks, continuations joined) or inline code span that
    runs the command, comments cut off."""
    found = []
    for path in USER_DOCS:
        joined = re.sub(r"\\\n\s*", " ", path.read_text())  # a command continued over lines is one
        fence = False
        for line in joined.splitlines():
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            for span in [line] if fence else re.findall(r"`([^`]+)`", line):
                m = pattern.search(span)
                if m:
                    found.append((path, span[m.end() :].split(" #")[0]))
    return found


def section_text(path: Path, section: str) -> str:
    """The text under a heading, up to the next heading of its level or above."""
    text = path.read_text()
    rest = text[text.index(section) + len(section) :]
    level = len(section) - len(section.lstrip("#"))
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def table_options(path: Path, section: str) -> list[str]:
    """The options in the first column of the tables under the heading."""
    rows = [row.split("|")[1] for row in section_text(path, section).splitlines() if row.startswith("| `")]
    return [opt for cell in rows for opt in OPTION.findall(cell)]


def test_serve_options_the_docs_name_exist(serve_options):
    lines = command_lines(SERVE_CMD)
    assert len(lines) >= 10, "the docs should show the serve command more than this"
    for path, line in lines:
        for opt in set(OPTION.findall(line)) - {"--help"}:
            assert opt in serve_options, f"{path.name}: `{opt}` is not an option of llmserve serve: {line!r}"
    named = set(OPTION.findall(section_text(SERVING, "## Options of `llmserve serve`"))) - {"--help"}
    for opt in named:
        assert opt in serve_options, f"serving.md names `{opt}`, which llmserve serve --help lacks"


def test_engine_options_the_docs_name_exist(engine_options):
    for path, line in command_lines(ENGINE_CMD):
        for opt in set(OPTION.findall(line)) - {"--help"}:
            assert opt in engine_options, f"{path.name}: `{opt}` is not an option of the engine: {line!r}"
    for opt in table_options(SERVING, "## Options of the engine alone"):
        assert opt in engine_options, f"serving.md: `{opt}` is not an option of python -m engine_svc.server"


def test_every_serve_option_is_documented_in_serving_md(serve_options):
    text = SERVING.read_text()
    documented = set(table_options(SERVING, "## Options of `llmserve serve`"))
    missing = sorted(serve_options - documented)
    assert not missing, f"options of llmserve serve without a row in docs/serving.md: {missing}"
    assert len(serve_options) > 40 and "--model" in text


def test_every_engine_option_is_documented(engine_options, serve_options):
    # The engine takes the engine flags and the logging flags of serve, and its own (listening, TLS).
    shared = set(table_options(SERVING, "### The engine")) | {"--model", "--log-level", "--log-format"}
    documented = set(table_options(SERVING, "## Options of the engine alone")) | shared
    missing = sorted(engine_options - documented)
    assert not missing, f"options of python -m engine_svc.server not in docs/serving.md: {missing}"


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text, fence, out = path.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            out.add(github_anchor(line.lstrip("#")))
    return out


def test_relative_links_resolve():
    checked = 0
    for path in USER_DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            assert dest.exists(), f"{path.relative_to(ROOT)}: link to {target} names no file"
            assert ROOT in dest.parents or dest == ROOT, f"{path.name}: {target} leaves the repository"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors_of(dest), f"{path.relative_to(ROOT)}: {target}: no such heading"
            checked += 1
    assert checked > 50


def test_nothing_links_a_file_outside_the_repository():
    tracked = subprocess.run(
        ["git", "grep", "-l", "-e", "shared/DESIGN.md", "--", ".", ":!tests/test_docs.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if tracked.returncode not in (0, 1):  # not a git checkout: read the files themselves
        hits = [p for p in USER_DOCS if "shared/DESIGN.md" in p.read_text()]
    else:
        hits = tracked.stdout.split()
    assert not hits, f"these files still refer to ../shared/DESIGN.md: {hits}"


DATED = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b|\bissue\s*#?\d+"
    r"|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? \d{4}\b",
    re.I,
)


def test_no_dated_or_issue_numbered_section_heading():
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        fence = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                fence = not fence
            elif not fence and re.match(r"^#{1,6} ", line):
                assert not DATED.search(line), f"{path.relative_to(ROOT)}:{n}: dated heading {line!r}"


def test_dated_heading_check_catches_what_the_old_readme_had():
    for heading in (
        "### Issue 13, 2026-12-02, later: the native GEMM",
        "### Issue 13: the peer (2026-12-01)",
    ):
        assert DATED.search(heading)
    assert not DATED.search("## Quick start")


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:8])
    assert "make run" in head and "make test" in head


def test_readme_figures_are_the_reports():
    from benchmarks.report import README_BEGIN, README_END, collect, headline_table

    text = README.read_text()
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip("\n")
    assert block == "\n".join(headline_table(collect())), (
        "the README's headline table differs from the results: run python -m benchmarks.report"
    )
    report = (ROOT / "benchmarks" / "results" / "REPORT.md").read_text()
    assert block in report, "REPORT.md is older than the results: run python -m benchmarks.report"
    assert re.search(r"^- Commit: `[0-9a-f]{7,}", report, re.M), "the report names no commit"
    assert re.search(r"^- Date: \d{4}-\d{2}-\d{2} ", report, re.M), "the report has no date"
    assert re.search(r"^- Machine[^:]*: .+ \(.*\), \d+ CPUs", report, re.M), "no CPU model, flags and count"


def test_report_stamp_reads_the_cpu():
    from benchmarks.machine import cpu_model_and_flags, describe

    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9R45\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile\n"
    )
    model, flags = cpu_model_and_flags(cpuinfo)
    assert model == "AMD EPYC 9R45" and flags == ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_tile"]
    line = describe(dict(cpu_model=model, cpu_flags=flags, cpus=2, platform="Linux", python="3", torch="2"))
    assert line.startswith("AMD EPYC 9R45 (sse4_2, avx, avx2, fma, avx512f, amx_tile), 2 CPUs")


def offline_snippet() -> str:
    text = README.read_text()
    after = text.split("<!-- quick start: offline (run by tests/test_docs.py) -->", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.fixture(scope="module")
def snippet_model(tmp_path_factory, trained_tokenizer_dir) -> Path:
    """A tiny random Llama with the project's tokenizer and chat template (the real default model
    may not be on this machine)."""
    from tests.conftest import TINY_ARCHS
    from tests.engine_helpers import random_model

    return random_model(
        tmp_path_factory.mktemp("snippet") / "model", trained_tokenizer_dir, seed=7, **TINY_ARCHS["llama"]
    )


def test_quick_start_offline_snippet_runs(snippet_model):
    from engine_svc.llm import LLM

    code = offline_snippet()
    assert 'LLM(model="models/default")' in code
    code = code.replace('"models/default"', repr(str(snippet_model)))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md quick start", "exec"), {})
    except AttributeError as e:
        # LLM.chat comes with the GGUF / default-model change; until it is merged the chat line is
        # the only one allowed to fail, and only for that reason.
        if hasattr(LLM, "chat") or "chat" not in str(e):
            raise
        assert len(out.getvalue().splitlines()) == 1, "the generate line should have printed its text"
        pytest.xfail("LLM.chat is not in this tree yet")
    printed = out.getvalue().splitlines()
    assert len(printed) == 2, printed


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


@pytest.mark.slow
def test_quick_start_against_a_real_service(snippet_model):
    """The README's curl, openai-client, Python-client and CLI steps, against `llmserve serve` on a
    tiny model, with the README's addresses swapped for the test's ports."""
    from tests.service_process import ServiceProcess

    args = ("--http-port", "0", "--served-model-name", "default", "--num-kv-blocks", "256")
    with ServiceProcess(snippet_model, *args) as sp:
        http = f"127.0.0.1:{sp.http_port}"
        curls = [
            line
            for block in readme_blocks("bash")
            for line in re.sub(r"\\\n\s*", " ", block).splitlines()
            if line.startswith("curl ")
        ]
        assert len(curls) == 2
        for line in curls:
            cmd = line.replace("localhost:8000", http).split("#")[0]
            out = subprocess.run(
                cmd, shell=True, capture_output=True, text=True, timeout=120, check=True
            ).stdout
            if '"stream": true' in cmd:
                assert out.rstrip().endswith("data: [DONE]"), out[-300:]
            else:
                assert '"choices"' in out and '"finish_reason"' in out, out[:300]

        python = [
            b
            for b in readme_blocks("python")
            if ("OpenAI(" in b or "LLMServeClient(" in b) and "tools=" not in b
        ]
        assert len(python) == 2
        for code in python:
            code = code.replace("127.0.0.1:8000", http).replace("127.0.0.1:50051", sp.target)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, "README.md quick start", "exec"), {})
            assert out.getvalue().strip(), f"printed nothing:\n{code}"

        cli = next(
            line for b in readme_blocks("bash") for line in b.splitlines() if "llmserve generate" in line
        )
        cli_args = shlex.split(cli.split("#")[0].split("llmserve", 1)[1])
        run = subprocess.run(
            [sys.executable, "-m", "gateway", *cli_args, "--target", sp.target],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]
        if shutil.which("grpcurl"):
            grpc_cmd = next(
                re.sub(r"\\\n\s*", " ", b) for b in readme_blocks("bash") if b.startswith("grpcurl")
            ).splitlines()[0]
            out = subprocess.run(
                grpc_cmd.replace("127.0.0.1:50051", sp.target),
                shell=True,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout
            assert '"text"' in out


@pytest.mark.slow
def test_readme_tool_call_example_against_a_real_service(snippet_model):
    """The README's tool-calling step: the server started with the README's flags, the client code
    as written; a random model still returns a call of the tool (it is decoded under the grammar)."""
    from tests.service_process import ServiceProcess

    serve = next(
        line for b in readme_blocks("bash") for line in b.splitlines() if "--tool-call-parser" in line
    )
    flags = shlex.split(serve.split("--model", 1)[1])[1:]  # after the model path
    flags = [f for f in flags if f not in ("--http-port", "8000")]
    code = next(b for b in readme_blocks("python") if "tools=" in b)
    with ServiceProcess(snippet_model, *flags, "--http-port", "0", "--served-model-name", "default") as sp:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(
                compile(
                    code.replace("127.0.0.1:8000", f"127.0.0.1:{sp.http_port}"), "README.md tools", "exec"
                ),
                {},
            )
    printed = out.getvalue()
    assert "name='get_weather'" in printed and "arguments='{" in printed, printed
