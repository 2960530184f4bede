"""The named evaluation corpora: long texts of different kinds, each from a Debian package that
``scripts/install_system_deps.sh`` installs (nothing is downloaded at run time).

    kjv                scripture            the King James Bible (bible-kjv), verse references stripped
    debian-reference   technical docs       the Debian Reference in plain text (debian-reference-en)
    python-stdlib      source code          the top-level modules of Debian's Python standard library
                                            (libpython3.X-minimal / -stdlib, pulled in by python3)
    jargon             modern prose         the Jargon File 4.4.7's lexicon entries and appendices
                                            (jargon-text; public domain)

A quality claim tuned on one kind of text may not hold on another (issue 35), so the multi-corpus
evaluation (``bench.eval.multi_corpus``) runs every one of these. ``load`` also takes any UTF-8 file path.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

KJV = "kjv"
KJV_COMMAND = ["bible", "-f", "Gen1:1-Rev22:21"]
_VERSE_REF = re.compile(r"^\S+?\d+:\d+\s+", re.MULTILINE)  # "Ge1:1 " at the start of each verse line

DEBIAN_REFERENCE = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PYTHON_LIB = Path("/usr/lib")  # Debian's python3.X standard library lives in /usr/lib/python3.X
_JARGON_ENTRY = re.compile(r"^   :", re.MULTILINE)  # "   :baroque: adj." opens each lexicon entry


def _missing(package: str, what: str) -> SystemExit:
    return SystemExit(f"the {what} corpus needs Debian's {package} package (scripts/install_system_deps.sh, or "
                      f"apt-get install {package}); or pass --corpus PATH to any text file")


def kjv_text() -> str:
    """The whole King James Bible, one verse a line, verse references ("Ge1:1") stripped."""
    try:
        text = subprocess.run(KJV_COMMAND, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise _missing("bible-kjv", KJV) from None
    return _VERSE_REF.sub("", text)


def _gzip_text(path: Path, package: str, name: str) -> str:
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    except FileNotFoundError:
        # slim container images may drop /usr/share/doc with a dpkg path-exclude even where the package is in
        e = _missing(package, name)
        raise SystemExit(f"{e.code} ({path} is missing; a dpkg path-exclude of /usr/share/doc removes it)") from None


def debian_reference_text() -> str:
    """The Debian Reference (commands, configuration files, tables of options), as packaged: plain text."""
    return _gzip_text(DEBIAN_REFERENCE, "debian-reference-en", "debian-reference")


def jargon_text() -> str:
    """The Jargon File from its first lexicon entry on: the entries (modern, informal English prose about
    computing culture) and the appendices. The front matter's 4,700-line list of entry names is left out:
    a list of headwords is not running text."""
    text = _gzip_text(JARGON, "jargon-text", "jargon")
    first = _JARGON_ENTRY.search(text)
    return text[first.start():] if first else text


def python_stdlib_dir(root: Path = PYTHON_LIB) -> Path:
    """The newest /usr/lib/python3.N holding os.py (Debian's system Python, not a virtualenv's)."""
    found = [d for d in root.glob("python3.*") if (d / "os.py").is_file()]
    if not found:
        raise _missing("python3", "python-stdlib")
    return max(found, key=lambda d: int(d.name.split(".")[1]))


def python_stdlib_text(root: Path = PYTHON_LIB) -> str:
    """The top-level ``*.py`` modules of the standard library in name order, each after a ``# file: NAME``
    line (deterministic for one Debian release; the version is in the directory name)."""
    lib = python_stdlib_dir(root)
    return "".join(f"# file: {p.name}\n{p.read_text(encoding='utf-8', errors='replace')}\n"
                   for p in sorted(lib.glob("*.py")))


CORPORA = {KJV: kjv_text, "debian-reference": debian_reference_text, "python-stdlib": python_stdlib_text,
           "jargon": jargon_text}
KINDS = {KJV: "scripture", "debian-reference": "technical documentation", "python-stdlib": "source code",
         "jargon": "modern prose"}


def load(corpus: str | None) -> str:
    """A corpus name of ``CORPORA`` (None: the KJV) -> its text; anything else is a UTF-8 text file path."""
    if corpus is None:
        corpus = KJV
    if corpus in CORPORA:
        return CORPORA[corpus]()
    text = Path(corpus).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise SystemExit(f"corpus {corpus!r} is empty")
    return text
