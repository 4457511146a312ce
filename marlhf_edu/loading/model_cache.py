"""The model cache: GGUF files dequantized and adapters merged once, kept for every later stage.

    marlhf-edu cache list                 # every entry: size, what it was built from, whether it checks out
    marlhf-edu cache clean [NAME ...]     # remove those entries (all of them without a name)

An entry is a folder `kind/key` that `from_pretrained` loads. The key is derived from the *content* it was built
from (the GGUF file's sha256; the adapter's weights, config and base), never from a name alone, so a changed
input cannot be served an old build. Each entry is

* built in a temporary folder beside it while a lock file is held (`key.lock`), then renamed into place: two
  processes asking for it at once build it once, and an interrupted build never looks finished. Temporary
  folders left by a killed build are removed by the next build of that key;
* sealed with a manifest (`marlhf_manifest.json`, the sha256 of every file), checked before it is served: a
  damaged entry, or a folder put there by hand, is rebuilt instead of loaded.

The cache lives in `$MARLHF_EDU_CACHE`, else `~/.cache/marlhf_edu`, else (home not writable, as on some CI
runners) a folder of the system's temporary directory that belongs to this user alone (mode 0700, refused if
another user owns it or can write to it).

Taught in chapter 13 (with `marlhf_edu.loading.sources`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import stat
import tempfile

from marlhf_edu.errors import ConfigError

MANIFEST = "marlhf_manifest.json"


def cache_dir() -> pathlib.Path:
    """Where converted GGUF models and merged adapters are kept (see the module docstring)."""
    if os.environ.get("MARLHF_EDU_CACHE"):
        path = pathlib.Path(os.environ["MARLHF_EDU_CACHE"])
        if path.exists() and not path.is_dir():  # every build would fail later with NotADirectoryError
            raise ConfigError(f"MARLHF_EDU_CACHE={path} is a file, not a folder; point it at a folder (it is "
                              "created if missing) or unset it")
        return path
    home = pathlib.Path.home() / ".cache" / "marlhf_edu"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return private_temporary_cache()


def private_temporary_cache() -> pathlib.Path:
    """`<tmp>/marlhf_edu_cache-<uid>`, created 0700; refused when it exists and is not this user's alone (another
    user could otherwise plant a model in it that every later stage would load)."""

    path = pathlib.Path(tempfile.gettempdir()) / f"marlhf_edu_cache-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"model cache {path}: not a folder that belongs to this user alone; remove it or set "
                          "MARLHF_EDU_CACHE to a folder of your own")
    return path


@contextlib.contextmanager
def cache_at(path):
    """Use `path` as the cache (`$MARLHF_EDU_CACHE`) inside the `with` block, then restore the previous one.

    For throw-away runs: each 7B-width smoke run merges fresh random adapters into about 1.4 GB of new cache
    entries that no later run reuses; kept in the run's own directory, they go when it is deleted. Used in
    chapter 15 and by `tests/test_pipeline_7b.py`."""
    old = os.environ.get("MARLHF_EDU_CACHE")
    os.environ["MARLHF_EDU_CACHE"] = str(path)
    try:
        yield pathlib.Path(path)
    finally:
        if old is None:
            del os.environ["MARLHF_EDU_CACHE"]
        else:
            os.environ["MARLHF_EDU_CACHE"] = old


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def seal(folder: pathlib.Path) -> None:
    """Record the sha256 of every file of a built entry in its manifest."""
    manifest = {str(p.relative_to(folder)): file_sha256(p) for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


_VERIFIED: set[tuple] = set()  # entries this process has hashed, with their files' sizes and times then


def _fingerprint(folder: pathlib.Path) -> tuple:
    return (str(folder.resolve()),) + tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                             for p in sorted(folder.rglob("*")) if p.is_file())


def check_entry(folder: pathlib.Path) -> str | None:
    """None when the entry matches its manifest, else what is wrong with it. An entry is hashed once per
    process while its files keep their sizes and modification times (a stage resolves one model several times:
    tokenizer, model, reference), and again as soon as any of them changes."""
    fingerprint = _fingerprint(folder) if folder.is_dir() else None
    if fingerprint in _VERIFIED:
        return None
    problem = _check_entry(folder)
    if problem is None and fingerprint is not None:
        _VERIFIED.add(fingerprint)
    return problem


def _check_entry(folder: pathlib.Path) -> str | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest (not built by marlhf-edu, or damaged)"
    present = {str(p.relative_to(folder)) for p in _files(folder)}
    if present != set(manifest):
        return f"files differ from its manifest ({sorted(present ^ set(manifest))[:3]})"
    for name, digest in manifest.items():
        if file_sha256(folder / name) != digest:
            return f"{name} does not match its recorded sha256"
    return None


def publish(build, target: pathlib.Path) -> pathlib.Path:
    """The entry `target`, built by `build(tmp_folder)` unless a sealed one is there (see the module docstring)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per key; the others wait, then find it built
        if target.exists():
            problem = check_entry(target)
            if problem is None:
                return target
            print(f"model cache: {target} failed its check ({problem}); rebuilding it")
            shutil.rmtree(target)
        for stale in target.parent.glob(f"{target.name}.tmp-*"):  # left by a killed build: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            seal(tmp)
            os.replace(tmp, target)
            _VERIFIED.add(_fingerprint(target))  # just hashed by seal
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def entries(root: pathlib.Path | None = None) -> list[dict]:
    """Every entry of the cache: `{"name", "path", "bytes", "source", "problem"}` (problem None when it checks)."""
    root = cache_dir() if root is None else pathlib.Path(root)
    found = []
    for kind in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        for folder in sorted(p for p in kind.iterdir() if p.is_dir() and ".tmp-" not in p.name):
            try:
                source = json.loads((folder / "marlhf_source.json").read_text())
            except (OSError, ValueError):
                source = {}
            found.append({"name": f"{kind.name}/{folder.name}", "path": str(folder), "source": source,
                          "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
                          "problem": check_entry(folder)})
    return found
