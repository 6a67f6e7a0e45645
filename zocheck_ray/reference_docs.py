"""The configuration and metrics reference, generated from the pydantic schemas' field docstrings.

    zocheck-ray config-reference                                # print it (Markdown)
    zocheck-ray config-reference --write docs/configuration.md  # replace the section between the markers
    zocheck-ray config-reference --check docs/configuration.md  # exit 1 when the file is out of date

The field docstrings are the documentation (one schema, one place), read from the
source with `ast`: one table per model, dotted names for nested sections.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

from pydantic import BaseModel

REFERENCE_FILE = "docs/configuration.md"
"""Where the repository keeps the generated reference (`make reference` rewrites it)."""
BEGIN = f"<!-- BEGIN GENERATED: zocheck-ray config-reference --write {REFERENCE_FILE} -->"
END = "<!-- END GENERATED -->"


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """`{field: docstring}` of `model` and its pydantic bases, from the string literal under each field."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _annotation(model: type[BaseModel], name: str) -> str:
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(typing|zocheck_ray(\.\w+)*)\.", "", repr(annotation))


def _default(model: type[BaseModel], name: str, section: BaseModel | None = None) -> str:
    info = model.model_fields[name]
    if section is not None:  # the job's own default for a section's field (the job's `zo.lr`, not `ZOConfig`'s)
        value = getattr(section, name)
    elif info.is_required():
        return "required"
    elif info.default_factory is not None:
        first, second = info.default_factory(), info.default_factory()
        if first != second:
            return "generated"
        value = first
    else:
        value = info.default
    if isinstance(value, BaseModel):
        changed = value.model_dump(mode="json", exclude_defaults=True)
        return "see below" + (f", with `{json.dumps(changed)}`" if changed else "")
    return "`" + json.dumps(value if not isinstance(value, tuple) else list(value)) + "`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def model_table(model: type[BaseModel], prefix: str = "", with_defaults: bool = True,
                section: BaseModel | None = None) -> str:
    """A Markdown table of `model`'s fields: name, type, default (if `with_defaults`: `section`'s values, where the
    job's default section differs from the model's), description."""
    docs = field_docs(model)
    header = "| field | type | default | description |\n| --- | --- | --- | --- |" if with_defaults else \
        "| field | type | description |\n| --- | --- | --- |"
    rows = [header]
    for name in model.model_fields:
        cells = [f"`{prefix}{name}`", f"`{_cell(_annotation(model, name))}`"]
        if with_defaults:
            cells.append(_default(model, name, section))
        cells.append(_cell(docs.get(name, "")))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def undocumented_fields() -> list[str]:
    """Fields of the documented models that carry no docstring (the reference would show them blank)."""
    missing = []
    for _, model, _, _ in _sections():
        docs = field_docs(model)
        missing += [f"{model.__name__}.{name}" for name in model.model_fields if not docs.get(name)]
    return missing


def _sections():
    from zocheck_ray.runtime.messages import ShadowMetrics
    from zocheck_ray.config import DurabilitySettings, FailureSettings, JobConfig, ScalingSettings, ShadowSettings
    from zocheck_ray.control.summary import Recovery, RunSummary
    from zocheck_ray.core.config import ZOConfig
    from zocheck_ray.workload.peft_settings import PeftSettings
    from zocheck_ray.workload.quantized.settings import QuantizationSettings
    from zocheck_ray.workload.task_config import TaskConfig

    return [
        ("`JobConfig`: the job (YAML file, `--set key=value`)", JobConfig, "", True),
        ("`zo`: the zeroth-order optimizer (`ZOConfig`)", ZOConfig, "zo.", True),
        ("`task`: data, prompt, batches, evaluation (`TaskConfig`)", TaskConfig, "task.", True),
        ("`peft`: an adapter trained alone (`PeftSettings`; absent by default: set `peft.method`)", PeftSettings,
         "peft.", True),
        ("`quantization`: a quantized frozen base (`QuantizationSettings`; absent by default: set "
         "`quantization.backend`)", QuantizationSettings, "quantization.", True),
        ("`shadow`: the shadow's CPUs, snapshots and lag (`ShadowSettings`)", ShadowSettings, "shadow.", True),
        ("`durability`: durable snapshots, the step log, the lease (`DurabilitySettings`)", DurabilitySettings,
         "durability.", True),
        ("`failure`: restarts and the warm standby (`FailureSettings`)", FailureSettings, "failure.", True),
        ("`scaling`: data-parallel ranks and placement (`ScalingSettings`)", ScalingSettings, "scaling.", True),
        ("Shadow metrics (`ShadowMetrics`: `zocheck-ray status`, Prometheus gauges `ray_zocheck_shadow_*`)",
         ShadowMetrics, "", False),
        ("Run summary (`RunSummary`: `zocheck_ray.run(...)`, `zocheck-ray train --json`)", RunSummary, "", False),
        ("Recoveries (`Recovery`: `RunSummary.recoveries`)", Recovery, "", False),
    ]


def render_reference() -> str:
    """The whole generated section (without the markers)."""
    parts = [f"_Generated from the schemas' field docstrings by `zocheck-ray config-reference --write "
             f"{REFERENCE_FILE}`; a test fails when this section is out of date._"]
    from zocheck_ray.config import JobConfig

    job = JobConfig(run_id="reference")
    for title, model, prefix, with_defaults in _sections():
        section = getattr(job, prefix[:-1], None) if prefix else None
        section = section if isinstance(section, model) else None
        parts.append(f"#### {title}\n\n{model_table(model, prefix, with_defaults, section)}")
    return "\n\n".join(parts) + "\n"


def _split(text: str, path: str) -> tuple[str, str, str]:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path} must hold the markers {BEGIN!r} and {END!r} once each, in that order")
    head, rest = text.split(BEGIN)
    body, tail = rest.split(END)
    return head, body, tail


def check_reference(path: str | Path) -> str | None:
    """None when `path`'s generated section equals `render_reference()`; else what to do."""
    head, body, tail = _split(Path(path).read_text(), str(path))
    if body.strip() != render_reference().strip():
        return f"{path}: the generated reference is out of date; run zocheck-ray config-reference --write {path}"
    return None


def write_reference(path: str | Path) -> bool:
    """Replace `path`'s generated section; returns whether it changed."""
    text = Path(path).read_text()
    head, body, tail = _split(text, str(path))
    new = head + BEGIN + "\n" + render_reference() + END + tail
    if new != text:
        Path(path).write_text(new)
    return new != text
