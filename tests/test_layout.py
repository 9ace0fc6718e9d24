"""The test suite's layout: helpers that several test modules share live in helper modules
(conftest, configs, stepping, reference, safety_model, residency_driver, ...), never in a test
module. Importing a test module from another runs its collection-time code twice under two
names and ties one test file's refactoring to another's; so no ``test_*.py`` imports a
``test_*`` module, at module level, inside a function, or in the source of a subprocess script
it holds as a string.
"""
import ast
import pathlib

HERE = pathlib.Path(__file__).resolve().parent

def imported_modules(tree):
    """(module name, line, enclosing top-level function or None) of every import in ``tree``."""
    found = []
    for top in tree.body:
        owner = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                found += [(alias.name, node.lineno, owner) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.module, node.lineno, owner))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    "import " in node.value:
                try:  # a script run in a subprocess (python -c): its imports count too
                    script = ast.parse(node.value)
                except SyntaxError:
                    continue
                found += [(name, node.lineno, owner) for name, _, _ in imported_modules(script)]
    return found


def test_no_test_module_imports_another_test_module():
    offenders = []
    for path in sorted(HERE.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for module, line, owner in imported_modules(tree):
            if module.split(".")[0].startswith("test_"):
                offenders.append(f"{path.name}:{line} imports {module}")
    assert not offenders, ("shared test helpers belong in a helper module, not a test module: "
                           + "; ".join(offenders))


def test_the_check_sees_every_form_of_import():
    """The checker itself: module-level, function-level and subprocess-script imports."""
    source = ("import T_a\nfrom T_b import x\ndef f():\n    from T_c import y\n"
              "SCRIPT = 'import os\\nfrom T_d import z\\n'\nfrom stepping import run\n")
    source = source.replace("T_", "test_")  # spelt so that this file does not import them
    names = {m for m, _, _ in imported_modules(ast.parse(source))}
    assert {"test_a", "test_b", "test_c", "test_d", "stepping", "os"} <= names
    owners = {m: o for m, _, o in imported_modules(ast.parse(source))}
    assert owners["test_c"] == "f" and owners["test_a"] is None
