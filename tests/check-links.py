#!/usr/bin/env python3
"""Every relative link in the repository's Markdown files resolves.

    python3 tests/check-links.py [REPO]

Checks each `[text](target)` and `![alt](target)` outside fenced code blocks in
every tracked *.md file (git ls-files; without git, every *.md below REPO
outside build folders): the target, relative to the file, must be an existing
file or folder, and a `#fragment` into a Markdown file must name one of its
headings (GitHub's anchors: lower case, punctuation dropped, spaces as
hyphens). Links with a scheme (https:, mailto:) are not followed. Prints each
broken link as FILE:LINE: TARGET (why) and exits 1 when there is one.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_files(repo):
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "*.md"],
                             capture_output=True, text=True, check=True).stdout
        return [repo / f for f in out.split()]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for root, dirs, files in os.walk(repo):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
            found += [Path(root) / f for f in files if f.endswith(".md")]
        return found


def lines_outside_code(path):
    """(line number, text) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def anchor(heading):
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, result = {}, set()
        for _, line in lines_outside_code(path):
            m = HEADING.match(line)
            if m:
                a = anchor(m.group(1))
                n = seen.get(a, 0)
                seen[a] = n + 1
                result.add(a if n == 0 else f"{a}-{n}")
        cache[path] = result
    return cache[path]


def main():
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else
                Path(__file__).resolve().parent.parent).resolve()
    broken = []
    files = markdown_files(repo)
    for md in files:
        for number, line in lines_outside_code(md):
            for target in LINK.findall(line):
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                    continue  # https:, mailto:, ...
                where, _, fragment = target.partition("#")
                dest = (md.parent / where).resolve() if where else md
                why = None
                if not dest.exists():
                    why = "no such file"
                elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                    why = f"no heading #{fragment}"
                if why:
                    broken.append(f"{md.relative_to(repo)}:{number}: {target} ({why})")
    for b in broken:
        print(b)
    print(f"check-links: {len(files)} Markdown files, {len(broken)} broken links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
