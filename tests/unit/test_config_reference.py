"""The configuration and metrics reference (docs/configuration.md) is generated from the schemas and kept current."""

from __future__ import annotations

from support import REPO
from zocheck_ray.cli import main
from zocheck_ray.config import JobConfig
from zocheck_ray.reference_docs import (BEGIN, END, REFERENCE_FILE, check_reference, field_docs, render_reference,
                                        undocumented_fields)

REFERENCE = REPO / REFERENCE_FILE


def test_the_reference_is_up_to_date_and_linked_from_the_readme():
    assert check_reference(REFERENCE) is None, f"run: zocheck-ray config-reference --write {REFERENCE_FILE}"
    assert f"]({REFERENCE_FILE})" in (REPO / "README.md").read_text()


def test_every_documented_field_has_a_docstring():
    assert undocumented_fields() == []


def test_reference_lists_every_job_field_with_its_docstring():
    text = render_reference()
    docs = field_docs(JobConfig)
    for name in JobConfig.model_fields:
        assert f"| `{name}` |" in text
        assert " ".join(docs[name].split()) in text
    for dotted in ("`zo.lr`", "`task.batch_size`", "`task.max_length`", "`task.eval_interval`", "`lag_steps`"):
        assert dotted in text


def test_check_and_write_on_a_stale_copy(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# title\n\n{BEGIN}\nold table\n{END}\n\nrest\n")
    assert main(["config-reference", "--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["config-reference", "--write", str(stale)]) == 0
    assert main(["config-reference", "--check", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{END}\n\nrest\n") and "old table" not in text


def dotted_fields(model, prefix: str = "") -> list[str]:
    """Every field a job can set, sections opened (`zo.lr`, `peft.target_modules`)."""
    from pydantic import BaseModel

    out = []
    for name, info in model.model_fields.items():
        kinds = [t for t in getattr(info.annotation, "__args__", (info.annotation,))
                 if isinstance(t, type) and issubclass(t, BaseModel)]
        out += dotted_fields(kinds[0], f"{prefix}{name}.") if kinds else [f"{prefix}{name}"]
    return out


def test_every_field_a_job_can_set_has_a_row_in_the_reference_with_the_jobs_default():
    text = REFERENCE.read_text()
    missing = [name for name in dotted_fields(JobConfig) if f"| `{name}` |" not in text]
    assert missing == [], f"no row in {REFERENCE_FILE}: {missing}"
    assert "| `zo.lr` | `float` | `0.002` |" in text  # the job's default, not ZOConfig's
