"""The house's structural rules, checked on the source alone (pure AST, no import): module and function sizes
(scripts/check_sizes.py), the layer order with no upward import and no import cycle, an engine that imports nothing
else from asr_spec, the encoder run by the engine alone, the engine's runs made by the engine session alone, one
many-streams runner and one count of what is in the engine, chunk ids read by name, number checks written once
(asr_spec/checks.py), and the removed workarounds staying removed; and, the one check that imports, every name
imported from the project (late imports included) existing where it is imported from.

The layers, lowest first (docs/layout.md states the same rule, checked below)::

    errors, logs, testing, chunk_id, checks, allocator → engine → audio → models → stream → transcribe
    → asr_spec/__init__.py (the public API) → eval → distill → manifests, distributed, serve → cli, __main__

A module may import from its own layer or a lower one, never from a higher one (lazy imports inside functions
count too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "asr_spec"
# Top-level parts of asr_spec (a sub-package or a module; "__init__" is the package's own public API), by layer.
LAYERS = (
    ("errors", "logs", "testing", "chunk_id", "checks", "allocator"),
    ("engine",),
    ("audio",),
    ("models",),
    ("stream",),
    ("transcribe",),
    ("__init__",),
    ("eval",),
    ("distill",),
    ("manifests", "distributed", "serve"),
    ("cli", "__main__"),
)
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}
SOURCE_FOLDERS = ("asr_spec", "benchmarks", "scripts", "tests")
# Names of the workarounds removed by issue 22: no identifier, argument or keyword may carry them again.
REMOVED_NAMES = ("draft_max_batch", "engine_for", "_greedy_engine")
REMOVED_KEYWORDS = ("share",)  # Engine(share=...): packed weights are shared by construction
# The one module outside the engine that calls `Engine.run`: it composes the run's source and dispatches its results.
SESSION_MODULE = "asr_spec/transcribe/session.py"
# The one many-streams runner: the live streams' requests are made there for `asr-spec stream` and the server alike.
STREAMS_MODULE = "asr_spec/stream/decodes.py"
# Names a chunk id goes by (`ChunkId`; a request's or result's `.id`), read by field, never by position.
CHUNK_ID_NAMES = {"id", "chunk_id", "request_id", "result_id", "tail_id"}
# Callers of Engine.encode outside the engine, and why they may: none of them is a stage of transcription.
ENCODE_ALLOWED = {
    "asr_spec/distill/data.py": "the pseudo-label cache stores the target's encoder outputs for training",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The asr_spec modules `path` imports (anywhere in it): `from X import a` counts as X.a when that is a
    module, else as X."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    resolved = set()
    for target in found:
        while target and target not in modules:  # `import asr_spec.x.y` of a name inside a module: that module
            target = target.rpartition(".")[0]
        if target.startswith("asr_spec") and target != name:
            resolved.add(target)
    return resolved


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]


def test_no_module_or_function_over_the_limits() -> None:
    from scripts import check_sizes as check

    assert check.CHECKED == ("asr_spec", "benchmarks", "scripts")
    assert [line for folder in check.CHECKED for line in check.offenders(REPO / folder)] == []


def test_docs_state_the_layers() -> None:
    """docs/layout.md's layer line (the indented one with the arrows) names LAYERS, in order."""
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    [line] = [line for line in text.splitlines() if line.startswith("    ") and "→" in line]
    stated = tuple(tuple(part.strip() for part in layer.split(",")) for layer in line.strip().split("→"))
    assert stated == LAYERS

def test_every_part_of_the_package_has_a_layer() -> None:
    assert sorted({_part(name) for name in _modules()} - set(LAYER_OF)) == []


def test_no_upward_import() -> None:
    upward = [f"{name} ({_part(name)}) imports {target} ({_part(target)})"
              for name, targets in _graph().items() for target in sorted(targets)
              if LAYER_OF[_part(target)] > LAYER_OF[_part(name)]]
    assert upward == []


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    cycles: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [name, target]) if target in path
                              else f"{name} -> {target}")
            elif target not in state:
                visit(target, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_engine_imports_nothing_else_from_asr_spec() -> None:
    outside = [f"{name} imports {target}" for name, targets in _graph().items() if _part(name) == "engine"
               for target in sorted(targets) if _part(target) != "engine"]
    assert outside == []


def test_type_checking_imports_are_the_lazy_exports() -> None:
    """asr_spec/__init__.py's TYPE_CHECKING block imports exactly the names `_EXPORTS` serves lazily, each from its
    module (pyproject's ruff section lets that block's imports go unused on the strength of this test)."""
    tree = _tree(PACKAGE / "__init__.py")
    exports = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported == exports

def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code binds or uses: variables, attributes, functions, classes, parameters, keywords."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            found.add(node.arg)
    return found


def test_removed_workarounds_stay_removed() -> None:
    """`Transcriber(draft_max_batch=)`, `engine_for`, the greedy twin engine and `Engine(share=)` are gone from
    the package, the scripts and the tests (the draft decision is `models.presets.plan_models`; packed weights are
    shared by construction)."""
    found = []
    for path in _python_files(*SOURCE_FOLDERS):
        tree = _tree(path)
        found += [f"{path.relative_to(REPO)}: {name}" for name in REMOVED_NAMES if name in _identifiers(tree)]
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node.func)}({node_kw.arg}=...)"
                  for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for node_kw in node.keywords if node_kw.arg in REMOVED_KEYWORDS]
    assert found == []


def _is_engine(expr: ast.expr) -> bool:
    """`engine`, `x.engine`, `greedy_engine`, `self._engine`...: an expression naming an engine."""
    return re.search(r"(^|[._])engine$", ast.unparse(expr)) is not None


def test_the_encoder_runs_only_in_the_engine() -> None:
    """Outside asr_spec/engine/ nothing builds an `Encoder` or imports `engine.encoder`, and no stage of the
    package calls `Engine.encode` (the engine encodes the chunks it decodes; ENCODE_ALLOWED lists the tools that
    need encoder outputs themselves). Tokenizers' and strings' `.encode` are other methods: only calls on an
    expression naming an engine count."""
    found = []
    for path in _python_files("asr_spec", "benchmarks", "scripts"):
        where = path.relative_to(REPO).as_posix()
        if where.startswith("asr_spec/engine/"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("engine.encoder"):
                found.append(f"{where}:{node.lineno}: imports {node.module}")
            elif isinstance(node, ast.ImportFrom) and any(alias.name == "Encoder" for alias in node.names):
                found.append(f"{where}:{node.lineno}: imports Encoder from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.endswith("engine.encoder") for a in node.names):
                found.append(f"{where}:{node.lineno}: imports the encoder module")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "encode"
                  and _is_engine(node.func.value) and where.startswith("asr_spec/") and where not in ENCODE_ALLOWED):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node.func)}(...)")
    assert found == []


def test_no_lambda_kept_by_a_noqa() -> None:
    """A lambda assigned to a name needs a noqa for E731 to pass the linter: write a def (or inline it) instead."""
    marker = "noqa: " + "E731"  # split: this file must not match itself
    found = [f"{path.relative_to(REPO)}:{number}" for path in _python_files(*SOURCE_FOLDERS)
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if marker in line]
    assert found == []


# A path of one machine: the roots where this project's machines keep their venvs, voices and data.
MACHINE_PATH = re.compile(r"(?<![\w.~])/(work|data|home|root|mnt)/")


def test_benchmarks_and_scripts_are_packages_without_path_tricks() -> None:
    """benchmarks/ and scripts/ are packages run with `python -m` from the repository root: none edits sys.path,
    keeps a late import by a noqa, or names a path of one machine (an environment variable or an option with a
    documented default says where such things are)."""
    late_import = "noqa: " + "E402"  # split: this file must not match itself
    found = []
    for path in _python_files("benchmarks", "scripts") + sorted((REPO / "scripts").glob("*.sh")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "sys.path" in line or late_import in line or MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []
    assert (REPO / "benchmarks" / "__init__.py").is_file() and (REPO / "scripts" / "__init__.py").is_file()

def test_every_package_is_in_the_wheel() -> None:
    """A package missing from pyproject's [tool.setuptools] packages works from a checkout but not once installed."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "asr_spec").rglob("__init__.py")}
    assert sorted(found - listed) == []


def _engine_runs(path: Path) -> list[int]:
    """Lines of `path` that call `.run(...)` on an expression naming an engine (`engine.run`, `self.engine.run`)."""
    return [node.lineno for node in ast.walk(_tree(path))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run"
            and _is_engine(node.func.value)]


def test_only_the_engine_session_runs_the_engine() -> None:
    """One place composes the engine's source and dispatches its results: outside asr_spec/engine/ only the
    session module calls `Engine.run` (the CLI's and API's `Transcriber`, the server's batcher and the live
    streams are its clients); scripts/ (benchmarks decoding the same requests two ways) and tests may."""
    found = [f"{path.relative_to(REPO).as_posix()}:{line}" for path in _python_files("asr_spec")
             if not path.relative_to(REPO).as_posix().startswith("asr_spec/engine/")
             for line in _engine_runs(path)]
    assert [where for where in found if not where.startswith(SESSION_MODULE + ":")] == []
    assert found, "the session module calls Engine.run: the check looks for the right calls"


def _calls(node: ast.AST, name: str) -> bool:
    """`name(...)` or `x.name(...)`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == name) or (isinstance(func, ast.Attribute) and func.attr == name)


def test_one_runner_makes_the_live_streams_requests() -> None:
    """One many-streams runner (stream/decodes.py) for the CLI's streams (stream/driver.py) and the server's
    (serve/stream_jobs.py): no other module of the package makes a live stream's request owner (`StreamKey(...)`),
    so a second runner cannot appear without failing here."""
    found = [f"{path.relative_to(REPO).as_posix()}:{node.lineno}" for path in _python_files("asr_spec")
             for node in ast.walk(_tree(path)) if _calls(node, "StreamKey")]
    assert [where for where in found if not where.startswith(STREAMS_MODULE + ":")] == []
    assert found, "the runner makes StreamKey owners: the check looks for the right calls"


def test_no_count_of_chunks_in_the_engine_is_kept_by_hand() -> None:
    """What each owner has in the engine is the engine session's count (transcribe/inflight.py, updated where the
    session feeds and finishes chunks): no module of the package adds to or subtracts from a counter named for
    chunks in the engine or in flight (`job.in_engine += 1`, `self._n_in_engine -= 1`)."""
    found = []
    for path in _python_files("asr_spec"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
                target = ast.unparse(node.target)
                if "in_engine" in target or "in_flight" in target:
                    found.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _names_chunk_id(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Attribute):
        return expr.attr in CHUNK_ID_NAMES
    return isinstance(expr, ast.Name) and expr.id in CHUNK_ID_NAMES - {"id"}


def test_no_chunk_id_is_read_by_position() -> None:
    """A chunk id is a `ChunkId` (owner, index, attempt), read by field: no `result.id[1]`, no `len(chunk_id)`
    telling kinds of ids apart, in the package, the scripts or the tests."""
    found = []
    for path in _python_files(*SOURCE_FOLDERS):
        for node in ast.walk(_tree(path)):
            by_position = isinstance(node, ast.Subscript) and _names_chunk_id(node.value)
            by_length = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
                         and len(node.args) == 1 and _names_chunk_id(node.args[0]))
            if by_position or by_length:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _isinstance_of(node: ast.AST, names: set[str]) -> bool:
    """`isinstance(x, T)` or `isinstance(x, (.., T, ..))` with a T in `names`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and len(node.args) == 2):
        return False
    kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
    return any(isinstance(kind, ast.Name) and kind.id in names for kind in kinds)


def test_numbers_are_checked_in_one_place() -> None:
    """"A number, not a bool" is written once, in asr_spec/checks.py (`int_at_least`, `positive_seconds`,
    `finite`...), which every options dataclass, the CLI and the server call: no other module of the package
    tests a value for bool and for int/float in one condition. The engine keeps its own `check_int` (it imports
    nothing else from asr_spec)."""
    found = []
    for path in _python_files("asr_spec"):
        where = path.relative_to(REPO).as_posix()
        if where == "asr_spec/checks.py" or where.startswith("asr_spec/engine/"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.BoolOp):
                tests = [n for value in node.values for n in ast.walk(value)]
                bools = [n for n in tests if _isinstance_of(n, {"bool"})]
                if bools and any(_isinstance_of(n, {"int", "float"}) for n in tests if n not in bools):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


OWN_PACKAGES = ("asr_spec", "benchmarks", "scripts")


def _own_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from M import name` in `path` whose M is one of this project's packages,
    anywhere in the file (a function's late import too); relative imports resolved against the file's package."""
    package = ".".join(path.relative_to(REPO).parent.parts)
    found = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([module] if module else []))
        if module.split(".")[0] in OWN_PACKAGES:
            found += [(node.lineno, module, alias.name) for alias in node.names if alias.name != "*"]
    return found


def test_every_name_imported_from_the_project_exists() -> None:
    """A name a module, benchmark or script imports from this project exists there, late imports inside functions
    included: those run only when their command does (a benchmark's mode no test runs), so a rename elsewhere broke
    one unseen (`benchmarks/bench_stream.py` imported the allocator from its old module). A module that needs an
    optional package this machine lacks is left out, by name."""
    import importlib
    import importlib.util

    missing, unavailable = [], set()
    for path in _python_files(*OWN_PACKAGES):
        for line, module, name in _own_imports(path):
            try:
                imported = importlib.import_module(module)
            except ModuleNotFoundError as error:
                if (error.name or "").split(".")[0] in OWN_PACKAGES:
                    missing.append(f"{path.relative_to(REPO)}:{line}: no module {module}")
                else:
                    unavailable.add(f"{module} (needs {error.name})")
                continue
            if not hasattr(imported, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"{path.relative_to(REPO)}:{line}: {module} has no {name}")
    assert missing == [], unavailable
