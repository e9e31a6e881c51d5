"""The repository's shape: the wheel installs one top-level package with its data, modules import
without circles, and the sources and docs describe the code as it is."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_dflash_mlx(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("dflash_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"dflash_mlx"}, top
    for module in ("dflash_mlx/cli/main.py", "dflash_mlx/convert/readers.py", "dflash_mlx/kernels/verify_accept.py",
                   "dflash_mlx/aliases.json", "dflash_mlx/demo/target/config.json", "dflash_mlx/suites/code.jsonl"):
        assert module in names, module
    for package in (ROOT / "dflash_mlx").rglob("__init__.py"):  # every subpackage of the source tree
        assert package.relative_to(ROOT).as_posix() in names, package
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dflash-mlx = dflash_mlx.cli.main:app" in zipfile.ZipFile(wheel).read(entry).decode()


def test_user_folders_named_cli_or_convert_do_not_shadow(tmp_path):
    # A user's own convert.py / cli/ in the working directory must not be run.
    (tmp_path / "convert.py").write_text("raise SystemExit('user convert.py was imported')\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("raise SystemExit('user cli/ was imported')\n")
    code = "import dflash_mlx.pair, dflash_mlx.cli.main, dflash_mlx.convert; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def _imports():
    """Module -> the project modules it imports (at the top or inside functions)."""
    import re

    files = {}
    for folder, package in (("dflash_mlx", "dflash_mlx"), ("cli", "dflash_mlx.cli"), ("convert", "dflash_mlx.convert")):
        for f in (ROOT / folder).rglob("*.py"):
            parts = [package, *f.relative_to(ROOT / folder).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        pkg = name if f.stem == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        pattern = r"^\s*from\s+(\.+)([\w.]*)\s+import\s+([\w ,]*)|^\s*from\s+(dflash_mlx[\w.]*)\s+import\s+([\w ,]*)"
        for m in re.finditer(pattern, f.read_text(), re.M):
            if m.group(4):
                dep, names = m.group(4), m.group(5)
            else:
                base = pkg
                for _ in range(len(m.group(1)) - 1):
                    base = base.rsplit(".", 1)[0]
                dep, names = base + ("." + m.group(2) if m.group(2) else ""), m.group(3)
            # `from package import module`: the module; other names: the package
            named = {f"{dep}.{n.split()[0]}" for n in names.split(",") if n.strip()}
            modules = named & files.keys()
            while dep and dep not in files:
                dep = dep.rsplit(".", 1)[0] if "." in dep else ""
            for d in modules | ({dep} if named - modules or not named else set()):
                if d and d != name:
                    deps.add(d)
        graph[name] = deps
    return graph, {n for n, f in files.items() if f.stem == "__init__"}


def test_no_import_circles():
    graph, packages = _imports()

    def reaches(start, goal, seen):
        for d in graph[start] - packages:  # a package's __init__ only re-exports
            if d == goal or (d not in seen and not seen.add(d) and reaches(d, goal, seen)):
                return True
        return False

    circles = sorted(n for n in graph if n not in packages and reaches(n, n, set()))
    assert circles == [], circles
    # Only the front ends reach the loop.
    loop = {"dflash_mlx.decode", "dflash_mlx.decode.generate"}
    users = sorted(n for n, deps in graph.items() if deps & loop and n not in loop)
    assert users == ["dflash_mlx", "dflash_mlx.bench", "dflash_mlx.distributed", "dflash_mlx.serve.worker"], users
    assert "dflash_mlx.pair" not in graph["dflash_mlx.convert.convert"]


# Folder -> the folders its modules never import: the arrows run one way, from the
# front ends (serve/, the root's pair, bench, train, distributed) down to the basics.
NEVER = {
    "policy": ("decode", "serve", "cache", "target", "pair"),
    "decode": ("serve",),
    "cache": ("decode", "serve", "policy"),
    "draft": ("decode", "serve", "cache"),
    "target": ("decode", "serve", "cache", "draft", "policy", "pair"),
    "kernels": ("decode", "serve", "cache", "draft", "target", "policy", "pair"),
}


def test_imports_run_one_way():
    graph, _ = _imports()
    folders = {n.split(".")[1] for n in graph if n.count(".") >= 2}
    assert set(NEVER) | {"serve", "cli", "convert"} <= folders, folders
    wrong = sorted(
        f"{n} -> {d}" for n, deps in graph.items() for d in deps
        if n.count(".") >= 1 and n.split(".")[1] in NEVER
        and any(d == f"dflash_mlx.{f}" or d.startswith(f"dflash_mlx.{f}.") for f in NEVER[n.split(".")[1]])
    )
    assert wrong == [], wrong


# Words that tell the story of the work rather than describe the code (history lives in git log).
HISTORY = re.compile(r"\b(issue|session) #?\d+\b|\b[a-z]+(st|nd|rd|th) session\b", re.IGNORECASE)


def test_the_sources_and_docs_describe_the_code_not_its_history():
    listed = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.stdout.splitlines() if ROOT / name != Path(__file__).resolve()]
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files if f.is_file()
             for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if HISTORY.search(line)]
    assert found == [], "\n".join(found)
