"""SGLang's own HTTP request schemas, read from the ``sglang`` wheel's source without importing it.

The sglang package needs a GPU stack to import, so this parses two files of an unpacked wheel with `ast`:

- ``sglang/srt/entrypoints/http_server.py``: the routes (``@app.post("/x")``, ``@app.get``, ``@app.api_route``)
  and, for each, the request class of its ``obj`` parameter (``obj: Annotated[Cls, Body()]`` or ``obj: Cls``);
- ``sglang/srt/managers/io_struct.py``: the fields of those classes (``msgspec.Struct`` subclasses of
  ``BaseReq`` and ``@dataclass`` classes such as ``GenerateReqInput``), with whether each has a default;
- ``sglang/srt/utils/common.py``: the globals ``SafeUnpickler`` lets a tensor payload reference.

`RouteSchemas.validate(method, path, body)` then returns the problems of one request body: a route SGLang lacks,
a key the request class does not declare, a required field that is missing, or a value of the wrong JSON type.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FieldSpec:
    name: str
    annotation: str
    required: bool


@dataclass
class RouteSchemas:
    version: str
    routes: dict[tuple[str, str], str | None] = field(default_factory=dict)  # (method, path) -> request class
    classes: dict[str, dict[str, FieldSpec]] = field(default_factory=dict)
    # `SafeUnpickler` of sglang/srt/utils/common.py: an exact allow-list (0.5.23) or module prefixes (0.5.17)
    unpickle_globals: set[tuple[str, str]] | None = None
    unpickle_prefixes: set[str] | None = None
    unpickle_denied: set[tuple[str, str]] = field(default_factory=set)

    def unpickle_allowed(self, module: str, name: str) -> bool:
        """Whether SGLang's ``SafeUnpickler.find_class`` lets ``module.name`` through."""
        if (module, name) in self.unpickle_denied:
            return False
        if self.unpickle_globals is not None:
            return (module, name) in self.unpickle_globals
        return any((module + ".").startswith(p) for p in self.unpickle_prefixes or ())

    def has_route(self, method: str, path: str) -> bool:
        return (method, path) in self.routes

    def validate(self, method: str, path: str, body) -> list[str]:
        if (method, path) not in self.routes:
            return [f"sglang {self.version} has no route {method} {path}"]
        cls = self.routes[(method, path)]
        if cls is None:
            return []
        fields = self.classes.get(cls)
        if fields is None:
            return [f"sglang {self.version}: request class {cls} of {path} not found in io_struct.py"]
        if not isinstance(body, dict):
            return [f"{path}: body must be a JSON object for {cls}, got {type(body).__name__}"]
        problems = [f"{path}: {cls} has no field {k!r}" for k in body if k not in fields]
        problems += [f"{path}: {cls} requires {n!r}" for n, f in fields.items() if f.required and n not in body]
        for key, value in body.items():
            spec = fields.get(key)
            if spec is not None and not _json_matches(spec.annotation, value):
                problems.append(f"{path}: {cls}.{key} is {spec.annotation}, got {value!r:.80}")
        return problems


def _json_matches(annotation: str, value) -> bool:
    """A coarse JSON-type check of ``value`` against a Python annotation's source text."""
    ann = annotation.replace(" ", "")
    if value is None:
        return "Optional" in ann or "None" in ann or ann in ("Any",)
    for wrapper in ("Optional[", "Annotated["):
        if ann.startswith(wrapper):
            inner = ann[len(wrapper) : -1]
            if wrapper == "Annotated[":
                inner = _split_top(inner)[0]
            return _json_matches(inner, value)
    if ann.startswith("Union["):
        return any(_json_matches(a, value) for a in _split_top(ann[len("Union[") : -1]))
    if ann.startswith("Literal["):
        return value in ast.literal_eval("[" + ann[len("Literal[") : -1] + "]")
    base = ann.split("[", 1)[0]
    if base in ("str",):
        return isinstance(value, str)
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "bytes":
        return isinstance(value, str)  # base64 text on the wire (Base64Bytes)
    if base in ("List", "list", "Tuple", "tuple"):
        if not isinstance(value, list):
            return False
        if "[" in ann and base in ("List", "list"):
            inner = ann[ann.index("[") + 1 : -1]
            return all(_json_matches(inner, v) for v in value)
        return True
    if base in ("Dict", "dict"):
        return isinstance(value, dict)
    return True  # enums, nested structs, Any: not checked here


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    return parts + [cur]


def _class_fields(tree: ast.Module) -> dict[str, dict[str, FieldSpec]]:
    bases: dict[str, list[str]] = {}
    own: dict[str, dict[str, FieldSpec]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
        fields = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                ann = ast.unparse(stmt.annotation)
                if ann.startswith("ClassVar"):
                    continue
                fields[stmt.target.id] = FieldSpec(stmt.target.id, ann, required=stmt.value is None)
        own[node.name] = fields

    def resolve(name: str, seen=()) -> dict[str, FieldSpec]:
        out: dict[str, FieldSpec] = {}
        for base in bases.get(name, []):
            if base in own and base not in seen:
                out.update(resolve(base, seen + (name,)))
        out.update(own.get(name, {}))
        return out

    return {name: resolve(name) for name in own}


def _routes(tree: ast.Module) -> dict[tuple[str, str], str | None]:
    routes: dict[tuple[str, str], str | None] = {}
    for node in tree.body:
        if not isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        paths = []
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if ast.unparse(dec.func.value) != "app" or not dec.args or not isinstance(dec.args[0], ast.Constant):
                continue
            kind = dec.func.attr
            if kind in ("get", "post", "put", "delete"):
                paths += [(kind.upper(), dec.args[0].value)]
            elif kind == "api_route":
                methods = ["GET"]
                for kw in dec.keywords:
                    if kw.arg == "methods":
                        methods = ast.literal_eval(kw.value)
                paths += [(m, dec.args[0].value) for m in methods]
        if not paths:
            continue
        cls = None
        for arg in node.args.args:
            if arg.arg == "obj" and arg.annotation is not None:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
                    ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Optional":
                    ann = ann.slice
                cls = ast.unparse(ann).split(".")[-1]
        for key in paths:
            routes[key] = cls
    return routes


def _unpickler_rules(tree: ast.Module) -> dict:
    rules: dict = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    key = {
                        "ALLOWED_GLOBALS": "unpickle_globals",
                        "ALLOWED_MODULE_PREFIXES": "unpickle_prefixes",
                        "DENY_CLASSES": "unpickle_denied",
                    }.get(stmt.targets[0].id)
                    if key:
                        rules[key] = set(ast.literal_eval(stmt.value))
    if "unpickle_globals" not in rules and "unpickle_prefixes" not in rules:
        raise RuntimeError("SafeUnpickler allow-list not found in sglang/srt/utils/common.py")
    return rules


def load_schemas(package_root: str | Path, version: str = "unknown") -> RouteSchemas:
    """Parse an unpacked ``sglang`` package directory (the one holding ``srt/``)."""
    root = Path(package_root)
    http = ast.parse((root / "srt/entrypoints/http_server.py").read_text())
    io_struct = ast.parse((root / "srt/managers/io_struct.py").read_text())
    common = ast.parse((root / "srt/utils/common.py").read_text())
    return RouteSchemas(
        version=version, routes=_routes(http), classes=_class_fields(io_struct), **_unpickler_rules(common)
    )


_FILES = ("sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py", "sglang/srt/utils/common.py")


def fetch_schemas(version: str, cache_dir: str | Path, timeout_s: float = 300.0) -> RouteSchemas:
    """Download the ``sglang==version`` wheel (``pip download --no-deps``, once per cache dir), unpack the
    files read here, and parse them. Raises `RuntimeError` when the wheel cannot be had (offline CI)."""
    import subprocess
    import sys
    import zipfile

    root = Path(cache_dir) / f"sglang-{version}"
    if not all((root / f).exists() for f in _FILES):
        wheel_dir = Path(cache_dir) / f"wheel-{version}"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        wheels = sorted(wheel_dir.glob(f"sglang-{version}-*.whl"))
        if not wheels:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux_2_34_x86_64",
                f"sglang=={version}",
                "-d",
                str(wheel_dir),
                "-q",
            ]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise RuntimeError(f"pip download sglang=={version}: {exc}") from exc
            wheels = sorted(wheel_dir.glob(f"sglang-{version}-*.whl"))
            if done.returncode != 0 or not wheels:
                raise RuntimeError(f"pip download sglang=={version} failed: {done.stderr[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in _FILES:
                zf.extract(name, root.parent / f"sglang-{version}-unpacked")
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        (root.parent / f"sglang-{version}-unpacked" / "sglang").rename(root)
        (root.parent / f"sglang-{version}-unpacked").rmdir()
        shutil.rmtree(wheel_dir, ignore_errors=True)  # only the two parsed files are kept
    return load_schemas(root, version)
