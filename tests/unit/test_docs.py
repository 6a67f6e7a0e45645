"""The documentation: the README holds the quickstart, the concepts and the commands, its first
commands are `make demo` and `make test`, every reference chapter in docs/ is linked from it,
and every relative link of the README and the chapters resolves."""

import re
from pathlib import Path

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


PATH_TOKEN = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\.(?:py|md|yaml|yml|sh|json|toml|png|jsonl|txt))`")
ROOTS = ("", "zocheck_ray/", "benchmarks/", "benchmarks/results/", "tests/")
"""Where a path a document names may start (`core/fused.py` is `zocheck_ray/core/fused.py`)."""
NOT_OURS = {"manifest.json", "model.safetensors.index.json", "model.safetensors", "config.json",
            "adapter_config.json", "setup_worker.py", "zocheck_pointer.json", "retention.json", "identity.json"}
"""File names the documents use for files the product writes, or another project holds."""


def test_every_file_a_document_names_exists():
    """A file named in backquotes (`core/fused.py`, `scale.md`) is one of the repository's: a renamed or deleted
    file takes its mentions with it."""
    names = {Path(p).name for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = []
    for doc in [README, *CHAPTERS, REPO / "benchmarks" / "README.md"]:
        for token in set(PATH_TOKEN.findall(doc.read_text())):
            if "/" in token:
                found = any((REPO / (root + token)).exists() for root in ROOTS)
            else:
                found = token in names or token in NOT_OURS
            if not found:
                missing.append(f"{doc.relative_to(REPO)}: {token}")
    assert not missing, "documents name files that do not exist:\n" + "\n".join(sorted(missing))
