"""The help texts and the docs agree: every `--help` runs, every flag a page names after `relaytrain
COMMAND` is one of that command's flags, and every `relaytrain ...` line of a page's bash blocks parses.

The pages' words are read at run time, so a flag renamed in a parser or a typo in a page fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from relaytrain.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _commands(sub, (*prefix, name))


COMMANDS = dict(_commands(build_parser()))


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_every_help_runs(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert out.getvalue().startswith(f"usage: relaytrain {' '.join(command)}")


def _code(text: str) -> list[str]:
    """Lines of code: each bash/console block's lines (continuations joined) and each inline code span."""
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        lines += block.replace("\\\n", " ").splitlines()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return lines + re.findall(r"`([^`\n]+)`", text)


def _invocations(text: str):
    """(line, command words, the words after them) of each `relaytrain COMMAND ...` in the page's code."""
    for line in _code(text):
        # a quoted argument's words are not flags (`launch --command "python x.py --out D"`)
        unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "''", line)
        for part in re.split(r"[;|&]|\$\(|#(?!\S)", unquoted):
            match = re.search(r"(?:^|\s)relaytrain\s+([a-z][a-z-]*(?:\s+[a-z][a-z-]*)?)(.*)", part)
            if not match:
                continue
            words = match.group(1).split()
            command = tuple(words) if tuple(words) in COMMANDS else tuple(words[:1])
            if command in COMMANDS:
                # a diagram's next column (three spaces or more) is not part of the command
                rest = re.split(r"\s{3,}", " ".join(words[len(command) :]) + match.group(2))[0]
                yield line, command, rest


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_flags_the_docs_name_exist(doc):
    wrong = []
    for line, command, rest in _invocations(doc.read_text()):
        known = _flags(COMMANDS[command])
        accepts = COMMANDS[command].get_default("accepts_overrides")
        for flag in re.findall(r"(?:^|\s)(--?[a-z][a-z0-9-]*)(?=[\s=]|$)", rest):
            if flag not in known and not (accepts and "." in flag):
                wrong.append(f"relaytrain {' '.join(command)} {flag}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def bash_lines(doc: Path) -> list[str]:
    """The command lines of a page's ```bash blocks, continuations joined, comments kept."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", doc.read_text(), re.S | re.M):
        lines += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def _shell_commands(line: str) -> list[list[str]]:
    """The words of each command of a shell line (split at `;` and `&&` outside quotes, no comments)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token in (";", "&&"):
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError as exc:
        raise AssertionError(f"{line}: {exc}") from None
    return [words for words in commands if words]


def parse_line(line: str) -> list[argparse.Namespace]:
    """Each `relaytrain ...` command of a bash line, parsed as the CLI parses it (overrides included)."""
    parsed = []
    for words in _shell_commands(line):
        command = " ".join(words)
        if words[:3] == ["python", "-m", "relaytrain.job.torchrun"] and "relaytrain.cli" in words:
            words = ["relaytrain", *words[words.index("relaytrain.cli") + 1 :]]
        if words[0] != "relaytrain":
            continue
        args, extra = build_parser().parse_known_args(words[1:])
        assert getattr(args, "func", None), command
        # a flag of the command taken as an override by a remainder argument would not reach the command
        name = tuple(words[1:3]) if tuple(words[1:3]) in COMMANDS else tuple(words[1:2])
        flags = _flags(COMMANDS[name])
        taken = [w for w in getattr(args, "config_args", None) or [] if w.split("=")[0] in flags]
        assert not taken, f"{command}: {taken} are taken for overrides, not as the command's flags"
        assert not extra or args.accepts_overrides, f"{command}: {extra}"
        assert all(e.startswith("--") and "=" in e and "." in e.split("=")[0] for e in extra), command
        parsed.append(args)
    return parsed


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_example_commands_parse(doc):
    for line in bash_lines(doc):
        try:
            parse_line(line)
        except SystemExit:
            pytest.fail(f"{doc.name}: does not parse: {line}")


def _help_of(command: tuple[str, ...], flag: str | None = None) -> str:
    """A command's description, or one flag's help, with argparse's line breaks undone."""
    parser = COMMANDS[command]
    if flag is None:
        return " ".join(parser.description.split())
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return " ".join(action.help.split())


@pytest.mark.parametrize("command", [c for c in COMMANDS if "--spare-nodes" in _flags(COMMANDS[c])])
def test_spare_nodes_help_names_when_a_straggler_gets_a_spare(command):
    """A spare takes a straggler's place only under the actions that replace: the help names each action
    the schema allows and the default, read from the schema, so a new action or default fails here."""
    import dataclasses
    import typing

    from relaytrain.config.schema import ResilienceConfig

    (field,) = [f for f in dataclasses.fields(ResilienceConfig) if f.name == "straggler_action"]
    actions = typing.get_args(typing.get_type_hints(ResilienceConfig)["straggler_action"])
    default = field.default
    text = _help_of(command, "--spare-nodes")
    replacing = [action for action in actions if action != default]
    assert f"straggler_action {' or '.join(replacing)} (the default, {default}, only names it)" in text, text


def test_verify_help_names_each_check_and_the_exit_codes():
    from relaytrain.inspection.verify import CHECKS

    text = _help_of(("verify",))
    names = [name for name, _ in CHECKS]
    counts = {2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six"}
    assert text.startswith(f"{counts[len(names)]} checks"), text
    assert all(f"The {name} check:" in text for name in names), (names, text)
    assert all(f"Exit {code}:" in text for code in (0, 1, 2)), text


def test_launch_help_names_overrides_and_that_command_needs_a_name(tmp_path, monkeypatch, capsys):
    """The description says so, and the launch refuses a --command without --name (one line, exit 2)."""
    text = _help_of(("launch",))
    assert "--train.max_steps=1000" in text and "--command 'CMD'" in text and "needs --name" in text, text
    assert "required with --command" in _help_of(("launch",), "--name")
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--command", "python x.py", "--dry-run"]) == 2
    assert "--command needs --name" in capsys.readouterr().err
