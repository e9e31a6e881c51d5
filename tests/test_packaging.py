"""The built wheel installs one top-level package, with its data."""

import subprocess
import sys
import zipfile
from pathlib import Path

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
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dflash-mlx = dflash_mlx.cli.main:app" in zipfile.ZipFile(wheel).read(entry).decode()


def test_user_folders_named_cli_or_convert_do_not_shadow(tmp_path):
    # A user's own convert.py / cli/ in the working directory must not be run.
    (tmp_path / "convert.py").write_text("raise SystemExit('user convert.py was imported')\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("raise SystemExit('user cli/ was imported')\n")
    code = "import dflash_mlx.load, dflash_mlx.cli.main, dflash_mlx.convert; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
