"""The package's architecture, checked: the import-linter contracts of pyproject.toml (layers, the model layer's
forbidden imports, no cycles between sibling packages) and what import-linter cannot express, read from the
source: module size, cycles between modules through function-local imports too, the reason comment of every
function-local import, and ``__all__`` naming only public names that exist. Each failure names the offending
modules and lines."""

from __future__ import annotations

import ast
import importlib
import io
import os
import shutil
import subprocess
import sys
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recursive_lightning"
MAX_LINES = 600
LOCAL_IMPORT_REASONS = ("# heavy", "# optional", "# startup")  # startup: a module a .pth runs at every start
# what a `# heavy` import may load: RULES.md's libraries kept off a light start path, and the others that take
# a good part of a second to import
HEAVY = {
    "torch",
    "lightning",
    "mlflow",
    "optuna",
    "matplotlib",
    "lm_eval",
    "transformers",
    "litdata",
    "scipy",
}
HEAVY |= {"datasets", "pandas", "pyarrow", "sqlalchemy", "psycopg", "psycopg2", "numpy", "tqdm"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def tree(name: str) -> ast.Module:
    path = modules()[name]
    return ast.parse(path.read_text(), str(path))


def where(name: str, line: int) -> str:
    return f"{modules()[name].relative_to(ROOT)}:{line}"


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def imports(name: str, type_only: bool = False) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement run at some point (``if TYPE_CHECKING:`` blocks left out, unless ``type_only``),
    each with whether it sits inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
                for other in child.orelse:
                    visit(other, local)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, local))
            visit(child, local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree(name), False)
    return out


def absolute(name: str, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    is_package = modules()[name].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules (of any package) one statement imports: ``from pkg import mod`` names the module ``pkg.mod``
    when it is one of ours."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = absolute(name, node)
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in modules() else source)
    return list(dict.fromkeys(out))


def internal_edges(name: str, type_only: bool = False) -> dict[str, int]:
    """Our modules ``name`` imports anywhere in it (function-local imports included; with ``type_only`` the
    ``if TYPE_CHECKING:`` ones too, except a package ``__init__``'s, which name its lazy public names) -> first
    line."""
    out: dict[str, int] = {}
    type_only = type_only and modules()[name].name != "__init__.py"
    for node, _ in imports(name, type_only):
        for target in imported_modules(name, node):
            if target in modules() and target != name:
                out.setdefault(target, node.lineno)
    return out


def comments(name: str) -> dict[int, str]:
    """Line -> its comment, a leading ``# noqa: ...`` dropped (``import x  # noqa: F401  # heavy`` says heavy)."""
    tokens = tokenize.generate_tokens(io.StringIO(modules()[name].read_text()).readline)
    out = {}
    for t in tokens:
        if t.type == tokenize.COMMENT:
            text = t.string.strip()
            if text.startswith("# noqa") and "  # " in text:
                text = "# " + text.split("  # ", 1)[1]
            out[t.start[0]] = text
    return out


_VISITING: set[str] = set()


@cache
def pulls_heavy(name: str) -> bool:
    """Whether importing our module ``name`` loads a heavy library, through module-level imports."""
    if name in _VISITING:  # a cycle: the other path decides
        return False
    _VISITING.add(name)
    try:
        return any(heavy_target(name, node) for node, local in imports(name) if not local)
    finally:
        _VISITING.discard(name)


def heavy_target(name: str, node: ast.Import | ast.ImportFrom) -> bool:
    for target in imported_modules(name, node):
        if target.split(".")[0] in HEAVY:
            return True
        # the package's own __init__ runs first: follow the parents too
        parts = target.split(".")
        ours = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
        if any(m in modules() and m != name and pulls_heavy(m) for m in ours):
            return True
    return False


def lint_imports() -> str:
    for candidate in (Path(sys.executable).parent / "lint-imports", shutil.which("lint-imports")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail(
        f"lint-imports is not installed beside {sys.executable} (import-linter, requirements.lock): run ./setup.sh"
    )


def test_import_linter_contracts_are_kept():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, (
        "import-linter contracts broken (pyproject.toml [tool.importlinter]):\n"
        + (report.split("Broken contracts", 1)[-1])
    )


def test_no_module_is_over_600_lines():
    long = {name: len(p.read_text().splitlines()) for name, p in modules().items()}
    over = [
        f"{modules()[n].relative_to(ROOT)}: {lines} lines" for n, lines in long.items() if lines > MAX_LINES
    ]
    assert not over, f"modules over {MAX_LINES} lines (split them by concept):\n" + "\n".join(over)


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time", "with-type-only"])
def test_no_import_cycle_between_modules_counting_function_local_imports(type_only):
    """No cycle through function-local imports, nor (``with-type-only``) through ``if TYPE_CHECKING:`` ones: a
    type a module names lives where both sides can import it."""
    graph = {name: internal_edges(name, type_only) for name in modules()}
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    lines = []
    for component in sorted(cycles):
        lines.append("cycle among " + ", ".join(component) + ":")
        members = set(component)
        for a in component:
            for b, line in sorted(graph[a].items()):
                if b in members:
                    lines.append(f"  {where(a, line)}: {a} -> {b}")
    assert not cycles, "import cycles (function-local imports counted):\n" + "\n".join(lines)


def test_every_function_local_import_says_heavy_or_optional():
    bad = []
    for name in modules():
        notes = comments(name)
        for node, local in imports(name):
            if not local:
                continue
            said = {notes.get(node.lineno), notes.get(node.end_lineno)}
            if not said & set(LOCAL_IMPORT_REASONS):
                text = ast.unparse(node)
                comment = next((c for c in said if c), None)
                bad.append(f"{where(name, node.lineno)}: {text}" + (f"  {comment}" if comment else ""))
    assert not bad, (
        "function-local imports without a trailing `# heavy`, `# optional` or `# startup` (RULES.md: move them to the top "
        "of the module, or say why they are local):\n" + "\n".join(bad)
    )


def test_every_heavy_local_import_loads_a_heavy_library():
    bad = []
    for name in modules():
        notes = comments(name)
        for node, local in imports(name):
            if local and "# heavy" in {notes.get(node.lineno), notes.get(node.end_lineno)}:
                if not heavy_target(name, node):
                    bad.append(f"{where(name, node.lineno)}: {ast.unparse(node)}")
    assert not bad, (
        f"`# heavy` local imports that load none of {', '.join(sorted(HEAVY))} (at the module's import, "
        "through our modules too): move them to the top of the module:\n" + "\n".join(bad)
    )


def modules_with_all() -> list[str]:
    return [
        name
        for name in modules()
        if any(
            isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
            and "__all__" in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
            for node in tree(name).body
        )
    ]


@pytest.mark.parametrize("name", modules_with_all())
def test_all_names_only_public_names_that_exist(name):
    module = importlib.import_module(name)
    names = list(module.__all__)
    problems = [f"'{n}' is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"'{n}' is private (starts with _)" for n in names if n.startswith("_")]
    problems += [f"'{n}' does not exist in the module" for n in names if not hasattr(module, n)]
    assert not problems, f"{modules()[name].relative_to(ROOT)} __all__: " + "; ".join(problems)


def lightning_modules_after(code: str, env: dict | None = None) -> str:
    """The Lightning and torchmetrics modules a fresh interpreter holds after running ``code`` (printed list)."""
    code += "; import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torchmetrics')))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_reading_a_checkpoint_does_not_import_lightning():
    """`generate`, `eval` and `probe` load checkpoints without Lightning (about 4 s of every such command's
    start); only training builds a Trainer (``training/trainer.py``)."""
    imported = lightning_modules_after(
        "import recursive_lightning.training.checkpoint, recursive_lightning.evaluation.run, "
        "recursive_lightning.probes.run, recursive_lightning.cli"
    )
    assert imported == "[]", imported[:500]


def test_a_sweeps_coordinator_prepares_the_data_without_lightning(tmp_path, data_cache):
    """`sweep --workers N` builds the tokenizer and shards once, then only waits for its workers and reports:
    it never imports Lightning (each worker does)."""
    from conftest import ENV, write_sweep

    spec = write_sweep(tmp_path / "sweep.yaml", data_cache, "coordinator", {"model.topology": ["mesh"]})
    imported = lightning_modules_after(
        "from recursive_lightning.sweep import prepare, runner; from recursive_lightning.sweep.spec import load_sweep; "
        f"runner.quiet_libraries(trains=False); prepare.prepare_data(load_sweep({str(spec)!r}))",
        env=ENV,
    )
    assert imported == "[]", imported[:500]
    assert list(Path(data_cache, "shards").glob("*/meta.json"))  # it did build them


# the files of a run or sweep directory: only run_dir.py (RunDir, SweepDir) spells their names
LAYOUT_OWNER = "recursive_lightning.run_dir"
LAYOUT_NAMES = {
    "config.yaml",
    "result.json",
    "checkpoints",
    "last.ckpt",
    "best.ckpt",
    "mlflow_tracking_uri",
    "mlflow.db",
    "mlartifacts",
    ".writer.lock",
    "sweep.json",
    "sweep.yaml",
    "sweep_result.json",
    "optuna.db",
    "report.md",
    "report.html",
    "trial.yaml",
    "init_tokenizer.json",
}


def layout_spellings(name: str) -> list[tuple[int, str]]:
    """(line, string) of the string literals in ``name`` that spell a run or sweep directory's file, alone or
    as a segment of a path (``"checkpoints/last.ckpt"``); docstrings and comments say what they like."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree(name))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if set(node.value.strip().split("/")) & LAYOUT_NAMES:
                out.append((node.lineno, node.value))
    return out


def test_only_run_dir_spells_the_run_and_sweep_directory_layout():
    bad = [
        f"{where(name, line)}: {text!r}"
        for name in modules()
        if name != LAYOUT_OWNER
        for line, text in layout_spellings(name)
    ]
    assert not bad, (
        "string literals naming a run or sweep directory's files outside recursive_lightning/run_dir.py (use "
        "RunDir / SweepDir):\n" + "\n".join(bad)
    )


MAX_FUNCTION_LINES = 80
# the modules (path -> function names, None: every function) allowed a function over MAX_FUNCTION_LINES: none
LONG_FUNCTIONS_ALLOWED: dict[str, set[str] | None] = {}


def test_no_library_function_is_over_80_lines():
    """A function over 80 lines is split into named steps (each helper named for what it does)."""
    long = []
    for name, path in modules().items():
        where_ = str(path.relative_to(ROOT))
        allowed = LONG_FUNCTIONS_ALLOWED.get(where_, set())
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and allowed is not None and node.name not in allowed:
                    long.append(f"{where_}:{node.lineno}: {node.name} ({lines} lines)")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)
    )
