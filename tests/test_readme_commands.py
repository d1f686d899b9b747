"""The README works as written: after the quick start, a second terminal's first command makes `prefect` and
`mn-prefect` resolve (the quick start's `.venv` is not on PATH), the fast tier says how to get the `dev` extra it
needs, and there are exactly two set-up commands (the quick start and the test command `.ci/run` reads). Fast: reads
README.md and starts one shell with a bare PATH, no server."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ACTIVATE = "source .venv/bin/activate"
COMMANDS = ("prefect", "mn-prefect")  # what the quick start installs into .venv (`mn` is pip install mirrorneuron-cli)
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Each ```bash fence of ``text``: its first line number and its lines (continuations joined)."""
    blocks, lines, start, inside = [], [], 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if not inside and line.strip() == "```bash":
            inside, lines, start = True, [], number + 1
        elif inside and line.startswith("```"):
            inside = False
            blocks.append((start, lines))
        elif inside:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line)
    return blocks


def command_word(line: str) -> str | None:
    """The program a shell line runs (after any VAR=value prefixes); None for a comment or a blank line."""
    code = line.split(" #", 1)[0].strip()
    if not code or code.startswith("#"):
        return None
    words = code.split()
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words[0] if words else None


def after_quick_start() -> list[tuple[int, list[str]]]:
    """The README's bash fences after the test command's (the quick start and the test command set things up)."""
    marker = README.splitlines().index("<!-- test-command -->") + 1
    return [(start, lines) for start, lines in bash_blocks(README) if start > marker + 2]  # its fence, then its line


def test_the_second_terminal_activates_the_environment_before_its_first_prefect_or_mn_prefect_command():
    activated_at = None
    bare = []
    for start, lines in after_quick_start():
        for offset, line in enumerate(lines):
            word = command_word(line)
            if line.strip().startswith(ACTIVATE) and activated_at is None:
                activated_at = start + offset
            elif word in COMMANDS and activated_at is None:
                bare.append(f"README.md:{start + offset}: {line.strip()}")
    assert activated_at is not None, f"no {ACTIVATE!r} line after the quick start"
    assert bare == [], "commands that fail with 'command not found' in a second terminal:\n" + "\n".join(bare)
    # Said once, where it is needed: the first fence after the quick start opens with it.
    assert after_quick_start()[0][1][0].strip().startswith(ACTIVATE)
    assert README.count(ACTIVATE) == 1


def test_after_activation_every_program_of_the_readme_sections_resolves_in_a_fresh_shell(tmp_path):
    assert (ROOT / ".venv" / "bin" / "activate").exists(), "no .venv in the checkout: the README's commands make one"
    words = sorted({w for _, lines in after_quick_start() for line in lines
                    if (w := command_word(line)) in COMMANDS})
    assert words == sorted(COMMANDS)
    script = f"{ACTIVATE} && " + " && ".join(f"command -v {w}" for w in words)
    bare_path = "/usr/local/bin:/usr/bin:/bin"
    before = subprocess.run(["bash", "-c", "command -v mn-prefect"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": bare_path, "HOME": str(tmp_path)})
    assert before.returncode != 0  # the fresh shell of the issue: the quick start's .venv is not on PATH
    shell = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={"PATH": bare_path, "HOME": str(tmp_path)})
    assert shell.returncode == 0, shell.stdout + shell.stderr
    assert all(line.startswith(str(ROOT / ".venv" / "bin")) for line in shell.stdout.split()), shell.stdout


def test_exactly_two_set_up_commands_and_the_fast_tier_says_how_to_get_the_dev_extra():
    setups = [line for _, lines in bash_blocks(README) for line in lines if line.startswith("python3 -m venv")]
    assert len(setups) == 2, setups
    quick_start, test_command = setups
    assert ".venv/bin/mn-prefect up" in quick_start and "'.[dev]'" not in quick_start
    assert "install -e '.[dev]'" in test_command  # .ci/run runs this line: it installs what the tests need
    fast_tier = README[README.index("The fast tier"):][:600]
    assert '.venv/bin/python -m pytest -m "not lab"' in fast_tier
    assert ".venv/bin/pip install -e '.[dev]'" in fast_tier  # after the quick start alone, what to install
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("pytest>=") for d in dev) and any(d.startswith("pytest-xdist") for d in dev)  # -n 3


def test_ci_reads_the_test_command_from_the_readme():
    script = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in script and "README.md" in script
