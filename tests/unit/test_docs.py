"""The documentation: the README holds the quickstart, the concepts and the commands, its first
commands are `make demo` and `make test`, every reference chapter in docs/ is linked from it,
and every relative link of the README and the chapters resolves."""

import re

from support import REPO

README = REPO / "README.md"
CHAPTERS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def test_the_first_commands_are_make_demo_and_make_test():
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands[:2] == ["make demo", "make test"]


def test_the_readme_keeps_the_quickstart_the_concepts_and_the_commands():
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    for heading in ("Quickstart", "What it is", "Why it works", "Commands"):
        assert heading in headings


def test_every_chapter_is_linked_from_the_readme():
    text = README.read_text()
    assert CHAPTERS
    for chapter in CHAPTERS:
        assert f"](docs/{chapter.name})" in text, f"docs/{chapter.name} is not linked from the README"


def test_every_relative_link_resolves():
    for doc in [README, *CHAPTERS]:
        for target in LINK.findall(doc.read_text()):
            if not re.match(r"^[a-z]+:", target):
                assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links to {target}: it does not exist"
