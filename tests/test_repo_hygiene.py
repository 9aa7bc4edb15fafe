"""The repository stands alone and reads as documentation, not as a diary.

Every tracked text file (code, comments, tests, scripts, docs, measurement logs) is searched
for two kinds of line: a path that points outside the repository (a clone has nothing there),
and narration of how the project was worked on (numbered work periods, times of day, machines
by nickname rather than by CPU or GPU model). A measurement record names the date and the
hardware model; that is all it needs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The forbidden words are assembled from pieces so that this file does not itself contain
# what it forbids (it is also left out of its own scan).
_SHARED = "sha" + "red"
_BOX = "b" + "ox"
_STOP = "st" + "op"
_TODAY = "to" + "day"
_MORNING = "mor" + "ning"
OUTSIDE = re.compile(rf"\.\./{_SHARED}|\b{_SHARED}/(DESIGN|STYLE)\.md|\b{_SHARED}/peers\b"
                     r"|/work/|/root/")
NARRATION = re.compile(
    rf"\b{_STOP}s? \d+\b"                             # numbered work periods
    r"|\bsessions? \d+\b|\b(this|that|next|last|earlier|previous|later) session\b"
    rf"|\b{_TODAY}\b|\byesterday\b|\btonight\b|\bthis {_MORNING}\b|\bthe {_MORNING}'s\b"
    r"|\ban hour (earlier|later|before|after)\b"
    rf"|(?<![-\w]){_BOX}(es)?\b"                      # a machine as "the <CPU> <that word>"
    r"|\b(AMX|Zen ?\d|SPR|EPYC|Xeon)[- ](VM|machine)\b",
    re.IGNORECASE)
BINARY_SUFFIXES = {".png", ".jpg", ".ipynb_checkpoints", ".so", ".gguf", ".safetensors"}


def tracked_text_files() -> list[Path]:
    """The files git tracks (a CI clone's whole tree), or every file when there is no git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and ".git" not in p.parts]
    files = []
    for name in names:
        path = ROOT / name
        if path.suffix in BINARY_SUFFIXES or not path.is_file() or path == Path(__file__):
            continue
        files.append(path)
    return files


def offending_lines(pattern: re.Pattern) -> list[str]:
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = pattern.search(line)
            if match:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in "
                            f"{line.strip()[:120]}")
    return hits


def test_the_patterns_catch_what_they_name():
    # a negative control: each pattern finds the kind of line it exists for
    assert OUTSIDE.search(f"see ../{_SHARED}/DESIGN.md")
    assert OUTSIDE.search(f"bash /work/{_SHARED}/peers/setup.sh")
    assert NARRATION.search(f"measured in {_STOP} 57 on the AMX {_BOX}")
    assert NARRATION.search(f"the {_MORNING}'s run, on the 2-core Zen 4 {_BOX}")
    assert NARRATION.search(f"rerun {_TODAY}")
    assert not NARRATION.search("an AMD EPYC 9B14 (Zen 4), 2 cores, 2026-12-06")
    assert not OUTSIDE.search("~/.cache/jaxpage-peers/vllm-cpu/bin/python")


def test_nothing_points_outside_the_repository():
    hits = offending_lines(OUTSIDE)
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_nothing_narrates_how_the_project_was_built():
    hits = offending_lines(NARRATION)
    assert not hits, ("narration (use the date and the hardware model instead):\n"
                      + "\n".join(hits[:80]))


def test_the_search_reads_the_whole_tree():
    # the scan covers code, tests, scripts and docs alike, so an empty result means something
    files = {p.relative_to(ROOT).parts[0] for p in tracked_text_files()}
    assert {"jaxpage", "pallas_kernels", "tests", "scripts", "docs", "README.md"} <= files
