"""Documentation that must say what was done: BENCHMARKS.md's header and its sections agree on the machines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MACHINES = {"AMD": "AMD EPYC", "Intel": "Intel Xeon"}
RAN_ON = re.compile(r"\*?(AMD|Intel)(?: EPYC)?\*?(?: Xeon)? (?:VM|machine)")  # "This AMD EPYC VM", "(Intel machine"


def test_benchmarks_header_names_every_machine_its_sections_ran_on():
    """Each dated section names its machine; the header lists every machine a section names, with the dates
    of its sections (it once described only the Intel machine of 2026-11-29 above AMD EPYC headline runs)."""
    text = (REPO / "BENCHMARKS.md").read_text()
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
