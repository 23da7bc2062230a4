"""The commands the README and docs/ show still work as written: every ``make TARGET`` is a
target of the Makefile; in shell code blocks, every ``skymesh ...``, ``skymesh-lb``,
``skymesh-controller`` and ``skymesh-replica`` command line parses with that program's own
argparse parser (parsed only, never run), every ``python -m MODULE`` (also our own modules
named in prose) names a module that exists, its arguments parsed when it has a
``build_parser``, and every ``python SCRIPT.py`` names a file that does. docs/notes/ is
left out: dated working notes keep commands as they were then."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md",
        *sorted(p for p in (REPO / "docs").rglob("*.md") if "notes" not in p.parts)]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = {"sh", "bash", "shell", "console"}
INLINE_MAKE = re.compile(r"`((?:[A-Z_]+=\S+ )*make [^`\n]*)`")
# `python -m skymesh_lab.bench.fidelity` in prose: our modules only (vllm's lives in the
# real-engine lane's own venv).
INLINE_MODULE = re.compile(r"`(?:\.venv/bin/)?(python3? -m (?:skymesh|skymesh_controller|"
                           r"skymesh_replica|skymesh_lab)\b[^`\n]*)`")
COMMENT = re.compile(r"(?:^|\s)#.*$")
OPERATORS = {"|", "||", "&", "&&", ";", "(", ")"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]+$")


# Each program's module with its ``build_parser`` (for ``skymesh``, the one that also loads
# the subcommands the controller and the lab plug in through entry points).
PROGRAMS = {"skymesh": "skymesh.cli", "skymesh-lb": "skymesh.balancer.cli",
            "skymesh-controller": "skymesh_controller.cli",
            "skymesh-replica": "skymesh_replica.cli"}


def parser_of(program: str) -> Callable[[], argparse.ArgumentParser]:
    return importlib.import_module(PROGRAMS[program]).build_parser  # type: ignore[no-any-return]


def shell_commands(text: str) -> Iterator[list[str]]:
    """Simple commands (argv lists) of the shell code blocks: continued lines joined,
    comments dropped, split at pipes and ``;``/``&&``/``&``; in a ``console`` block only
    the ``$`` lines. ``[--opt X]`` (optional, a usage line) is read as ``--opt X``."""
    for m in FENCE.finditer(text):
        if m.group(1) not in SHELL:
            continue
        lines = m.group(2).replace("\\\n", " ").splitlines()
        if m.group(1) == "console":
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        for line in lines:
            lex = shlex.shlex(COMMENT.sub("", line).replace("[", "").replace("]", ""),
                              posix=True, punctuation_chars="|&;()")
            lex.whitespace_split, lex.commenters = True, ""
            argv: list[str] = []
            for tok in [*lex, ";"]:
                if tok in OPERATORS:
                    while argv and ENV.match(argv[0]):
                        argv.pop(0)
                    if argv:
                        yield argv
                    argv = []
                else:
                    argv.append(tok)


def make_targets_named(text: str) -> Iterator[str]:
    """Targets of ``make ...`` in inline code and in shell blocks (``VAR=x`` skipped)."""
    lines = [m.group(1) for m in INLINE_MAKE.finditer(text)]
    lines += [" ".join(argv) for argv in shell_commands(text)]
    for line in lines:
        argv = line.split()
        while argv and ENV.match(argv[0]):
            argv.pop(0)
        if argv[:1] == ["make"]:
            yield from (a for a in argv[1:] if "=" not in a and not a.startswith("-"))


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {t for m in re.finditer(r"^([\w .$()/-]+?)\s*:(?!=)", text, re.M)
            for t in m.group(1).split() if "$" not in t}


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and its subcommands' parsers without prefix matching, so a doc that
    names a flag that has since grown (``--setup`` for ``--setups``) fails."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                strict(sub)
    return parser


def parse_error(build: Callable[[], argparse.ArgumentParser], args: list[str]) -> str | None:
    """argparse's complaint about ``args``, or None (``--help``/``--version`` exit 0). A
    usage line's placeholder (``--only NAME``) is not a value the option takes, but not
    drift either: the option and its placeholder are dropped and the rest parsed again."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            strict(build()).parse_args(args)
        except SystemExit as exc:
            if not exc.code:
                return None
            why = err.getvalue().strip().splitlines()[-1]
            held = [i for i, a in enumerate(args) if PLACEHOLDER.match(a) and f"'{a}'" in why]
            if not held:
                return why
            i = held[0]
            start = i - 1 if i and args[i - 1].startswith("-") else i
            return parse_error(build, args[:start] + args[i + 1:])
    return None


def problem(argv: list[str]) -> str | None:
    """Why ``argv`` does not work as written, or None; programs this test does not know
    (curl, kubectl, terraform ...) pass."""
    if argv[0] == "docker" and argv[1:2] == ["run"]:
        at = [i for i, a in enumerate(argv) if a in PROGRAMS]
        if not at:
            return None
        argv = argv[at[0]:]
    prog = argv[0].removeprefix(".venv/bin/")
    if prog in PROGRAMS:
        return parse_error(parser_of(prog), argv[1:])
    if prog not in ("python", "python3") or len(argv) < 2:
        return None
    if argv[1] == "-m":
        spec = importlib.util.find_spec(argv[2])
        if spec is None:
            return f"no module {argv[2]}"
        if spec.origin and "def build_parser(" in Path(spec.origin).read_text():
            return parse_error(importlib.import_module(argv[2]).build_parser, argv[3:])
        return None  # it reads its arguments some other way: that it exists will do
    if argv[1].endswith(".py") and not (REPO / argv[1]).is_file():
        return f"no script {argv[1]}"
    return None


def test_the_command_reader_joins_splits_and_skips() -> None:
    text = ("```sh\nA=1 skymesh-lb --config x.yaml &   # a comment\n"
            "skymesh sim --a 1 \\\n  --b 2 | jq .\nmake image ROLE=replica\n```\n"
            "```console\n$ skymesh-replica [--time-scale 0.1]\noutput line\n```\n"
            "```yaml\nskymesh: no\n```\nAnd `make demo` or `TEST_WORKERS=0 make test`.\n")
    assert list(shell_commands(text)) == [
        ["skymesh-lb", "--config", "x.yaml"], ["skymesh", "sim", "--a", "1", "--b", "2"],
        ["jq", "."], ["make", "image", "ROLE=replica"],
        ["skymesh-replica", "--time-scale", "0.1"]]
    assert sorted(make_targets_named(text)) == ["demo", "image", "test"]


def test_a_wrong_flag_subcommand_module_or_script_is_a_problem() -> None:
    assert problem(["skymesh-lb", "--config", "x.yaml"]) is None
    assert problem(["skymesh-lb", "--no-such-flag"])
    assert problem(["skymesh-lb", "--conf", "x.yaml"])  # no abbreviations
    assert problem(["skymesh", "no-such-command"])
    assert problem(["skymesh", "faults", "run", "--only", "NAME"]) is None  # a usage line
    assert problem(["skymesh", "faults", "run", "--only", "no_such_fault"])
    assert problem(["docker", "run", "img", "skymesh-replica", "--bogus"])
    assert problem(["python", "-m", "skymesh_lab.no_such_module"])
    assert problem(["python", "-m", "skymesh_lab.bench.skylb_faithful", "--no-such-flag"])
    assert problem(["python", "tools/no_such_script.py"])
    assert problem(["curl", "-s", "x"]) is None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_the_docs_name_exists(doc: Path) -> None:
    missing = sorted(set(make_targets_named(doc.read_text())) - makefile_targets())
    assert not missing, f"{doc.relative_to(REPO)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_command_line_parses(doc: Path) -> None:
    text = doc.read_text()
    inline = [shlex.split(m) for m in INLINE_MODULE.findall(text)]
    wrong = {" ".join(argv): why for argv in [*shell_commands(text), *inline]
             if (why := problem(argv))}
    assert not wrong, f"{doc.relative_to(REPO)}: commands that do not work as written: {wrong}"


def test_the_checks_see_the_docs_commands() -> None:
    # A reader that found nothing would pass everything.
    seen = [argv[0] for doc in DOCS for argv in shell_commands(doc.read_text())]
    assert {"skymesh", "skymesh-lb", "skymesh-controller", "skymesh-replica"} <= set(seen)
    assert "demo" in set(make_targets_named((REPO / "README.md").read_text()))
    assert INLINE_MODULE.findall((REPO / "docs" / "lab.md").read_text())
