"""`marlhf-edu cache`: list or clean the model cache (`marlhf_edu.loading.model_cache`).

    marlhf-edu cache list                 # every entry: size, what it was built from, whether it checks out
    marlhf-edu cache clean [NAME ...]     # remove those entries (all of them without a name)

Taught in chapter 13.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.model_cache import cache_dir, entries


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: marlhf-edu cache list | marlhf-edu cache clean [NAME ...] (NAME as `cache list` prints it; "
             "no name: every entry)")
    if "-h" in argv or "--help" in argv:
        print(usage)
        return
    if not argv or argv[0] not in ("list", "clean"):
        raise ConfigError(usage)
    root = cache_dir()
    found = entries(root)
    if argv[0] == "list":
        for e in found:
            source = ", ".join(f"{k} {v}" for k, v in e["source"].items())
            status = "ok" if e["problem"] is None else f"FAILS: {e['problem']}"
            print(f"{e['name']:60s} {e['bytes'] / 2**20:9.1f} MiB  {status}  ({source})")
        print(f"{len(found)} entries, {sum(e['bytes'] for e in found) / 2**30:.2f} GiB in {root}")
        return
    names = argv[1:]
    unknown = sorted(set(names) - {e["name"] for e in found})
    if unknown:
        raise ConfigError(f"cache clean: no entry {', '.join(unknown)} in {root} (see `marlhf-edu cache list`)")
    chosen = [e for e in found if not names or e["name"] in names]
    links = [e for e in chosen if pathlib.Path(e["path"]).is_symlink()]
    if links:  # the cache builds real folders: a link is someone's own, and rmtree refuses links with a traceback
        raise ConfigError(f"cache clean: {', '.join(e['path'] for e in links)} is a symbolic link (to "
                          f"{os.readlink(links[0]['path'])}), not an entry the cache built; remove the link yourself "
                          "(rm, which leaves its target) and run `cache clean` again; nothing was removed")
    for e in chosen:
        shutil.rmtree(e["path"])
        print(f"removed {e['name']} ({e['bytes'] / 2**20:.1f} MiB)")
    orphans = 0
    for kind in (p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        for leftover in kind.glob("*.tmp-*"):  # left by a killed build, unless one is building it right now
            with open(kind / f"{leftover.name.split('.tmp-')[0]}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                shutil.rmtree(leftover, ignore_errors=True)
                orphans += 1
    print(f"{len(chosen)} entries removed from {root}" + (f", and {orphans} unfinished builds" if orphans else ""))
