"""The user's cache folder for work that can be redone ($XDG_CACHE_HOME/vgpu-ctl, else ~/.cache/vgpu-ctl): made
0700, each file 0600 and replaced at once. Nothing in it is needed; whatever can't be read or written there, or
that someone else could have written, is worked out as without it."""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any


def cache_dir() -> Path | None:
    """Where the cache is kept ($XDG_CACHE_HOME/vgpu-ctl, else ~/.cache/vgpu-ctl); None without a home."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (KeyError, RuntimeError):
            return None
    return Path(base) / "vgpu-ctl"


def read_json(name: str, digest: str) -> Any | None:
    """The `data` of cache file `name` if it was written for `digest`, else None."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        if not _private(folder) or not _private(folder / name):
            return None
        with open(folder / name, encoding="utf-8") as f:
            cached = json.load(f)
        return cached["data"] if cached.get("digest") == digest else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _private(path: Path) -> bool:
    """Whether only this user could have written `path` (owned by us, not writable by group or others): what
    anyone else could write is not trusted as a parse of the user's files."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def write_json(name: str, digest: str, data: Any, encoded: str | None = None) -> None:
    """Replace cache file `name` with `data` (or `encoded`: data already as JSON text) for `digest` (a temporary
    file renamed, so a reader never sees half of one); nothing when the folder can't be made or written."""
    import tempfile  # only when the cache is written

    folder = cache_dir()
    if folder is None:
        return
    with suppress(OSError):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid == os.getuid():
            folder.chmod(0o700)  # ours, but made looser by someone: private again, so what is written is read
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cache-", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                # json.dumps, not json.dump: dump encodes in Python, several times slower on a large file
                out.write(f'{{"digest": {json.dumps(digest)}, "data": {encoded or json.dumps(data)}}}')
            os.replace(tmp, folder / name)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
