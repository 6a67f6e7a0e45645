"""workload/ is one way through: files -> rows -> sample -> render -> examples -> task, driven by `build_task`.

A stage imports nothing of a later stage, and of an earlier one only its types and constants, so the stages
never call each other: `build_task` enters each once, in order. The modules every stage reads (the task's
schema, errors, the tokenizer, the batch order) and the model's side import no stage.

Imports are read from the source, at module level and inside functions alike.
"""

import ast
from pathlib import Path

import zocheck_ray.workload

WORKLOAD = Path(zocheck_ray.workload.__file__).parent
STAGES = ["datafiles", "rows", "sampling", "prompts", "examples", "tasks"]
"""In the order a task's rows go through them: files, rows, sample, render, examples, the task."""
PARTS = {"sft.rows": "rows", "sft.prepare": "examples", "sft.task": "tasks"}
"""A kind's own module within a stage (kind sft's rows, examples and task, in its subpackage): it counts as its
stage."""
SHARED = {"errors", "data", "task_config", "tokenization"}
MODEL_SIDE = {"models", "names", "weights", "adapters", "peft_settings", "model_init", "quantized.settings", "quantized.load",
              "quantized.qzo", "quantized.snapshot", "quantized.probe"}
DRIVER = "builder"
DRIVERS = {DRIVER, "custom"}
"""`build_task`, and the user's collator and loss over rows handed over (`custom.py`), which take the stages' parts."""


def parse(module: str) -> ast.Module:
    return ast.parse((WORKLOAD / f"{module.replace('.', '/')}.py").read_text())


def stage_of(module: str) -> str:
    return PARTS.get(module, module)


def modules_of(stage: str) -> list[str]:
    return [stage, *(part for part, of in PARTS.items() if of == stage)]


def imports(module: str) -> dict[str, set[str]]:
    """workload module -> the names `module` takes from it."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(parse(module)):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                name = f"zocheck_ray.workload.{name}".rstrip(".")
            if name.startswith("zocheck_ray.workload."):
                out.setdefault(_module(name), set()).update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("zocheck_ray.workload."):
                    out.setdefault(_module(alias.name), set()).add("*")
    return out


def _module(name: str) -> str:
    """A workload module's key: `rows`, or `sft.rows` within a subpackage."""
    parts = name.removeprefix("zocheck_ray.workload.").split(".")
    return ".".join(parts[:2]) if (WORKLOAD / parts[0]).is_dir() else parts[0]


def classes(module: str) -> set[str]:
    return {node.name for node in parse(module).body if isinstance(node, ast.ClassDef)}


def test_every_module_of_the_workload_has_a_place():
    placed = set(STAGES) | set(PARTS) | SHARED | MODEL_SIDE | DRIVERS | {"__init__", "sft.__init__", "quantized.__init__"}
    assert {".".join(p.relative_to(WORKLOAD).with_suffix("").parts) for p in WORKLOAD.rglob("*.py")} == placed


def test_no_stage_imports_a_later_stage_or_the_builder():
    back = [f"{module} imports {target}" for i, stage in enumerate(STAGES) for module in modules_of(stage)
            for target in imports(module) if stage_of(target) in STAGES[i + 1:] or target in DRIVERS]
    assert not back, back


def test_a_stage_takes_only_types_and_constants_from_an_earlier_one():
    calls = []
    for i, stage in enumerate(STAGES):
        for module in modules_of(stage):
            for target, names in imports(module).items():
                if stage_of(target) in STAGES[:i]:
                    calls += [f"{module} takes {target}.{n}" for n in names
                              if n not in classes(target) and not n.isupper()]
    assert not calls, calls


def test_the_shared_modules_and_the_model_side_import_no_stage():
    wrong = [f"{module} imports {target}" for module in SHARED | MODEL_SIDE for target in imports(module)
             if stage_of(target) in STAGES or target in DRIVERS]
    assert not wrong, wrong


def test_build_task_enters_each_stage_once_in_order():
    builder = parse(DRIVER)
    origin = {name: stage_of(target) for target, names in imports(DRIVER).items() for name in names}
    build_task = next(n for n in builder.body if isinstance(n, ast.FunctionDef) and n.name == "build_task")
    calls = sorted((node.lineno, origin[node.func.id]) for node in ast.walk(build_task) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Name) and origin.get(node.func.id) in STAGES)
    assert [stage for _, stage in calls] == STAGES[:-1]
