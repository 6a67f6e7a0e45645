"""The package's import structure is its architecture: the core's layers import only downwards,
no modules import each other in a cycle, the core runs without Ray, and the package never
imports the benchmarks (they live beside it, in `benchmarks/`).

Imports are read from the source (module level and inside functions alike), so a function-level
import cannot hide an upward edge.
"""

import ast
from pathlib import Path

import zocheck_ray

PACKAGE = Path(zocheck_ray.__file__).parent

CORE_LAYERS = (
    ("the specification", {"config", "dtypes", "errors", "layout", "record", "scalars", "seeds", "hashing", "cpus",
                           "lazy"}),
    ("the reference implementation", {"generator", "update", "reference", "validation"}),
    ("the kernels", {"kernel_cache", "fused", "gpu", "gpu.triton_kernels", "gpu._triton_src"}),
    ("the guard", {"gpu.kernel_guard"}),
    ("backend selection and the optimizer", {"backend", "optimizer", "__init__"}),
)
"""Bottom first; a module may import from its own layer and the ones before it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """Every module `path` imports, by its full name: for `from a import b`, `a.b` when that is a module."""
    current = module_name(path)
    package = current if path.name == "__init__.py" else current.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return out


def package_edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports; a package's `__init__` (its face) is left out, as
    importing it only re-exports what lies below."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    edges = {}
    for name, path in MODULES.items():
        if name in packages:
            continue
        targets = set()
        for target in imported(path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and target not in packages:
                targets.add(target)
        edges[name] = targets
    return edges


def core_layer(name: str) -> int:
    short = name.removeprefix("zocheck_ray.core").lstrip(".") or "__init__"
    for index, (_, members) in enumerate(CORE_LAYERS):
        if short in members:
            return index
    raise AssertionError(f"{name} belongs to no layer of the core: add it to CORE_LAYERS")


def test_every_module_of_the_core_has_a_layer():
    for name in MODULES:
        if name == "zocheck_ray.core" or name.startswith("zocheck_ray.core."):
            core_layer(name)


def test_the_core_imports_only_downwards():
    upward = []
    for name, path in MODULES.items():
        if not (name == "zocheck_ray.core" or name.startswith("zocheck_ray.core.")):
            continue
        for target in imported(path):
            if target.startswith("zocheck_ray.core.") and target in MODULES and core_layer(target) > core_layer(name):
                upward.append(f"{name} ({CORE_LAYERS[core_layer(name)][0]}) imports {target} "
                              f"({CORE_LAYERS[core_layer(target)][0]})")
    assert not upward, "\n".join(upward)


def test_the_core_imports_nothing_of_ray_or_the_rest_of_the_package():
    for name, path in MODULES.items():
        if name == "zocheck_ray.core" or name.startswith("zocheck_ray.core."):
            outside = {t for t in imported(path) if t.split(".")[0] == "ray"
                       or (t.startswith("zocheck_ray") and not t.startswith("zocheck_ray.core"))}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_modules_import_each_other_in_a_cycle():
    edges = package_edges()
    state: dict[str, int] = {}  # 1: on the path being explored, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_package_never_imports_the_benchmarks():
    for name, path in MODULES.items():
        assert not {t for t in imported(path) if t.split(".")[0] == "benchmarks"}, f"{name} imports the benchmarks"
    assert not (PACKAGE / "bench").exists(), "benchmarks live in benchmarks/, beside the package"


# ---------------------------------------------------------------------------------------- the map

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def documented_layers() -> list[tuple[str, list[str]]]:
    """The layer table of docs/architecture.md, top to bottom: (layer, the module paths and directories it names)."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index("## Layers")
    layers = []
    for line in lines[start:]:
        if line.startswith("## ") and layers:
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and "`" in cells[1]:
            layers.append((cells[0], [part.strip("` ") for part in cells[1].split(",")]))
    return layers


def documented_layer(name: str, layers: list[tuple[str, list[str]]]) -> int:
    path = MODULES[name].relative_to(PACKAGE).as_posix()
    found = [i for i, (_, members) in enumerate(layers)
             if any(path == m or (m.endswith("/") and path.startswith(m)) for m in members)]
    assert len(found) == 1, f"{path} is in {len(found)} layers of {ARCHITECTURE.name}'s table (one, exactly)"
    return found[0]


def test_the_architecture_map_places_every_module_and_every_import_goes_down_it():
    layers = documented_layers()
    assert [name for name, _ in layers][:5] == ["spec", "reference", "kernels", "guard", "optimizer"]
    upward = []
    for name, path in MODULES.items():
        mine = documented_layer(name, layers)
        for target in imported(path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and documented_layer(target, layers) > mine:
                upward.append(f"{name} ({layers[mine][0]}) imports {target} "
                              f"({layers[documented_layer(target, layers)][0]})")
    assert not upward, "imports that go up the map in docs/architecture.md:\n" + "\n".join(upward)


CONTROL_FUNCTION_LINES = 40
"""The controller's code reads as a state machine of short steps: no function in `control/` is longer."""


def test_the_control_package_is_made_of_short_functions():
    long = []
    for name, path in MODULES.items():
        if not name.startswith("zocheck_ray.control."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > CONTROL_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, f"functions in control/ over {CONTROL_FUNCTION_LINES} lines:\n" + "\n".join(long)


# ---------------------------------------------------------------------------------------- the house's size

MAX_PACKAGE_LINES = 3200
"""No package (a directory of modules) holds more lines than this: past it, it is two packages."""
MAX_DOCSTRING_WORDS_PER_CODE_LINE = 2.0
"""A docstring says what and the one reason why; measurements go to docs/benchmarks.md."""


def test_no_package_is_over_its_size():
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        sizes.setdefault(path.parent, 0)
        sizes[path.parent] += len(path.read_text().splitlines())
    over = {str(d.relative_to(PACKAGE.parent)): n for d, n in sizes.items() if n > MAX_PACKAGE_LINES}
    assert not over, f"packages over {MAX_PACKAGE_LINES} lines (split them): {over}"


def _docstring_words_and_code_lines(path: Path) -> tuple[int, int]:
    source = path.read_text()
    docstring_lines, words = set(), 0
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                    and isinstance(statement.value.value, str):
                words += len(statement.value.value.split())
                docstring_lines.update(range(statement.lineno, statement.end_lineno + 1))
    code = sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstring_lines)
    return words, code


def test_docstrings_stay_short():
    words = code = 0
    for path in PACKAGE.rglob("*.py"):
        w, c = _docstring_words_and_code_lines(path)
        words, code = words + w, code + c
    assert words / code <= MAX_DOCSTRING_WORDS_PER_CODE_LINE, \
        f"{words} docstring words over {code} code lines: {words / code:.2f} per line"


def test_the_controller_imports_without_torch_or_numba():
    """The driver's state machine decides on typed errors (`runtime/errors.py`): it loads no trainer library."""
    import subprocess
    import sys

    code = ("import sys, zocheck_ray.control.controller; "
            "print(sorted(m for m in ('torch', 'numba', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
