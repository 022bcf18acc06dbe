"""List functions in src/ longer than N lines (default 80)."""
import ast, pathlib, sys
limit = int(sys.argv[1]) if len(sys.argv) > 1 else 80
for path in sorted(pathlib.Path("src").rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                print(f"{path}:{node.lineno} {node.name} {n} lines")
