"""The documented commands' table (tests/documented.py) holds to the documents, names tests that exist, and the
blocks that only a reader's machine can run are checked as far as this one can: the YAML blocks validate as jobs,
the GPU cluster layouts hold together. The commands themselves run in `make test-docs` (tests/journey/)."""

from __future__ import annotations

from pathlib import Path

import yaml

from documented import COMMANDS, INLINE, JOURNEY, TABLE, all_blocks
from support import REPO


def test_every_block_of_the_docs_is_in_the_table():
    rows = [(c.doc, c.marker) for c in COMMANDS]
    assert len(set(rows)) == len(rows)
    for b in all_blocks():
        if b.lang == "yaml" or not b.lang or b.lang in ("bash", "python"):
            mine = [c for c in COMMANDS if c.doc == b.doc and c.marker in b.text]
            assert mine, f"{b.doc}:{b.line}: a {b.lang or 'plain'} block without a row in COMMANDS:\n{b.text}"
        if b.lang == "bash":
            for line in b.commands():
                assert any(c.doc == b.doc and line.startswith(c.marker) for c in COMMANDS), \
                    f"{b.doc}:{b.line}: `{line}` has no row in COMMANDS"
    for c in COMMANDS:
        matched = [b for b in all_blocks() if b.doc == c.doc and c.marker in b.text]
        commands = [b for b in matched if b.lang == "bash" and any(line.startswith(c.marker) for line in b.commands())]
        assert len(commands or matched) == 1, f"{c.doc}: {c.marker!r} matches {len(commands or matched)} blocks"
    for c in INLINE:
        assert c.marker in (REPO / c.doc).read_text(), f"{c.doc} no longer says {c.marker!r}"


def test_every_row_names_a_test_that_exists():
    here = JOURNEY.read_text() + TABLE.read_text()  # the journey's runs and this module's checks
    for c in [*COMMANDS, *INLINE]:
        kind, _, what = c.where.partition(": ") if not c.where.startswith("tests/") else ("elsewhere", "", c.where)
        assert kind in ("here", "checked", "not run", "elsewhere"), c
        if kind in ("here", "checked"):
            assert f"\ndef {what}(" in here, f"{c.marker!r}: no test {what} in {JOURNEY} or {TABLE}"
        elif kind == "elsewhere":
            path, name = what.split("::")
            assert f"\ndef {name}(" in (REPO / path).read_text(), f"{c.marker!r}: no test {name} in {path}"


def test_the_yaml_blocks_validate(tmp_path):
    from zocheck_ray.config import JobConfig

    import torch
    from safetensors.torch import save_file

    stand_in = tmp_path / "model"  # the reader's model directory (`/models/...`): one that exists here
    stand_in.mkdir()
    (stand_in / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    save_file({"lm_head.weight": torch.zeros(1)}, stand_in / "model.safetensors")
    for b in [b for b in all_blocks() if b.lang == "yaml"]:
        doc = yaml.safe_load(b.text)
        if str(doc.get("model", "")).startswith("/models/"):
            doc["model"] = str(stand_in)
        JobConfig.model_validate(doc)


def test_the_gpu_cluster_layouts_hold_together():
    import shlex

    from zocheck_ray.config import JobConfig

    rayjob = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    (workdir,) = [line.split()[1] for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines()
                  if line.startswith("WORKDIR ")]  # the image holds the repository there
    config = Path(argv[argv.index("--config") + 1])
    JobConfig.model_validate(yaml.safe_load((REPO / config.relative_to(workdir)).read_text()))
    cluster = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    assert cluster["docker"]["image"] and (REPO / "deploy" / "Dockerfile").is_file()

