"""Documentation that must say what was done: BENCHMARKS.md's tables each name their command, commit and machine;
the dated log's header and its sections agree on the machines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MACHINES = {"AMD": "AMD EPYC", "Intel": "Intel Xeon"}
RAN_ON = re.compile(r"\*?(AMD|Intel)(?: EPYC)?\*?(?: Xeon)? (?:VM|machine)")  # "This AMD EPYC VM", "(Intel machine"
COMMIT = re.compile(r"`[0-9a-f]{7,40}`")


def test_benchmarks_page_gives_each_table_its_command_commit_and_machine():
    """Every section of the front page but its methodology shows the command that printed it (a bench script
    in a code block), the commit it ran on and the machine; and every bench script it names exists."""
    text = (REPO / "BENCHMARKS.md").read_text()
    _, *sections = re.split(r"^## ", text, flags=re.M)
    assert len(sections) >= 6
    for section in sections:
        title = section.splitlines()[0]
        if title == "Methodology":
            continue
        assert re.search(r"```\n(make bench-llamacpp-deps.*\n)?python (-m )?bench[./]", section), title
        assert COMMIT.search(section), f"section {title!r} names no commit"
        assert RAN_ON.search(section), f"section {title!r} names no machine"
    for module in re.findall(r"python -m bench\.([a-z_.]+)", text):
        assert (REPO / "bench" / f"{module.replace('.', '/')}.py").exists(), module


def test_benchmarks_log_header_names_every_machine_its_sections_ran_on():
    """Each dated section of the log names its machine; the header lists every machine a section names, with the
    dates of its sections (it once described only the Intel machine of 2026-11-29 above AMD EPYC headline runs)."""
    text = (REPO / "docs" / "bench" / "history.md").read_text()
    header, *sections = re.split(r"^## ", text, flags=re.M)
    named = set()
    for section in sections:
        title = section.splitlines()[0]
        match = RAN_ON.search(section)  # the first machine a section names is the one it ran on
        assert match, f"section {title!r} names no machine"
        name = MACHINES[match.group(1)]
        named.add(name)
        date = re.match(r"\d{4}-\d{2}-\d{2}", title).group(0)
        bullet = next(line for line in header.split("\n- ")[1:] if line.startswith(f"**{name}**"))
        assert date in bullet, (name, date)
    assert named == set(MACHINES.values())
