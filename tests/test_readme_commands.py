"""Every command the README and the documentation pages show runs as written (issue 15), on small settings.

The commands are read from README.md and then ``docs/*.md`` (tables in backticks and ``bash`` code blocks), so a
new or edited command is tested without editing this file. Each runs in a scratch folder in that order, the
README's first (``compare`` reads what ``simulate`` wrote; a command shown twice runs once), with its request
counts, rates, seeds and sizes made small; the commands that need torch models (``profile``, ``validate``), the
installs and the full demo are only parsed: ``--help`` must exit 0.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import run_sim

README = Path(__file__).resolve().parents[1] / "README.md"
#: The README, then the documentation pages (docs/, built by mkdocs.yml) by name.
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]

#: Flags rewritten to keep the test cheap: flag -> small value.
SMALL = {"--num-prompts": "40", "--num-requests": "40", "--seeds": "0", "--sizes": "300", "--workers": "2",
         "--max-evals": "2"}
ROOT = README.parent
#: Commands only parsed (--help): they need torch models, a device, or minutes.
HELP_ONLY = ("profile", "validate")


def readme_commands() -> list[str]:
    """Every ``python run_sim.py ...`` command of the README and the docs pages: table cells in backticks and
    code-block lines."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"`(python run_sim\.py[^`]*)`", text):
            commands.append(match.group(1).strip())
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                for part in line.split("&&"):
                    part = part.strip()
                    if part.startswith("python run_sim.py"):
                        commands.append(part)
    seen, out = set(), []
    for c in commands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def small(argv: list[str]) -> list[str]:
    """``argv`` with the flags of :data:`SMALL` set small, at most two rates, and the shipped files of
    ``profiles/data/`` named from the repository (the commands run in a scratch folder)."""
    out = [str(ROOT / a) if a.startswith("profiles/data/") else a for a in argv]
    for i, arg in enumerate(out[:-1]):
        if arg in SMALL:
            out[i + 1] = SMALL[arg]
        elif arg == "--rates":
            out[i + 1] = ",".join(out[i + 1].split(",")[:2])
    if out and out[0] == "bench" and "--sizes" not in out:
        out += ["--sizes", SMALL["--sizes"]]
    if out and out[0] == "tune" and "--param" not in out:
        out += ["--param", "k=2,4"]
    if out and out[0] == "advise":  # a small deployment and space: few slots, two k, short ramp and rates
        for flag, value in (("--max-num-seqs", "16"), ("--ks", "1,3"), ("--trees", "5/4/8"), ("--ramp-requests", "20"),
                            ("--rates", "4,8"), ("--num-requests", SMALL["--num-requests"])):
            if flag not in out:
                out += [flag, value]
    return out


def test_the_readme_shows_the_main_commands():
    commands = readme_commands()
    for name in ("simulate", "sweep", "plot", "tune", "compare", "bench", "profile", "validate"):
        assert any(c.split()[2:3] == [name] for c in commands if len(c.split()) > 2), name


def test_every_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ran = []
    for command in readme_commands():
        argv = shlex.split(command)[2:]  # after "python run_sim.py"
        if not argv:  # the demo: a minute of runs; its parser is checked
            argv = ["demo", "--help"]
        elif argv[0] in HELP_ONLY:
            pytest.importorskip("torch")
            argv = [argv[0], "--help"]
        else:
            argv = small(argv)
        try:
            code = run_sim.main(argv)
        except SystemExit as exc:  # --help exits through argparse
            code = exc.code or 0
        out = capsys.readouterr()
        assert code == 0, f"{command}\n(as run: {' '.join(argv)})\n{out.err[-2000:]}"
        ran.append(command)
    assert len(ran) >= 10
