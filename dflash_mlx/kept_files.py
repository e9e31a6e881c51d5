"""Files the runtime writes for itself and reads in later processes (cost curves,
learned rates): JSON with a kind, a format version and a checksum of their data,
written to a temporary file and renamed into place.

A file that is not what `write` made (unreadable, too large, another kind, a
checksum that fails, or data its reader refuses) is set aside, renamed to
`NAME.damaged` rather than deleted, with one warning; the caller builds it
again. A file of an older version is not damaged, only out of date: it is
ignored quietly and replaced at the next write.
"""

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

from .errors import printable

log = logging.getLogger("dflash_mlx")

# No file kept here comes near this (a cost curve is tens of kilobytes); a larger
# one is not ours, and is not read into memory.
MAX_BYTES = 16 * 2**20


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write(path: Path, kind: str, version: int, data: Any) -> bool:
    """Write `data` (JSON-able) to `path` atomically; False (nothing changed) if it cannot be written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"kind": kind, "version": version, "sha256": _digest(data), "data": data}))
        tmp.replace(path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


def set_aside(path: Path, what: str, why: str) -> None:
    """Rename a damaged `path` to NAME.damaged (replacing an earlier one) and say so once."""
    path = Path(path)
    aside = path.with_name(path.name + ".damaged")
    try:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside)  # an earlier damaged copy of a folder we wrote
        os.replace(path, aside)
        done = f"set aside as {aside.name}"
    except OSError as e:
        done = f"cannot set it aside ({e.strerror or e})"
    log.warning(printable(f"{what} {path} is damaged ({why}); {done}, and it is built again."))


def read(path: Path, kind: str, version: int, what: str) -> Optional[Any]:
    """The data `write` put at `path` for (kind, version); None if there is none, it is of
    another version, or it is damaged (then set aside). `what` names it in the warning."""
    path = Path(path)
    try:
        if not path.exists():
            return None
        if not path.is_file():
            raise ValueError("not a regular file")
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        with open(path, "rb") as f:
            raw = json.loads(f.read(MAX_BYTES + 1).decode("utf-8"))
        if not isinstance(raw, dict) or raw.get("kind") != kind:
            raise ValueError(f"not a {kind} file")
        if raw.get("version") != version:
            return None
        if not isinstance(raw.get("sha256"), str) or raw["sha256"] != _digest(raw.get("data")):
            raise ValueError("its checksum does not match its data")
        return raw["data"]
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        set_aside(path, what, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
