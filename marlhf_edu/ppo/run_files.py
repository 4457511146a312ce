"""What a PPO run keeps on disk, and why it can be trusted: checkpoints written atomically and durably, with a
sha256 per file; a resume that checks them, falls back to the previous checkpoint when the latest is damaged,
loads every file as data only, and refuses a run whose settings changed.

A run folder holds `metrics.jsonl` (one record per step), `eval_curve.jsonl` (with `eval_every`),
`eval.json` / `eval_samples.jsonl` (before and after) and `checkpoints/step-NNNNNN/` (the newest two) with
`checkpoints/latest` naming the newest complete one. Used by `PPOTrainer` (chapter 09 teaches checkpoints).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle

import torch

from marlhf_edu.errors import ConfigError, DataFileError
from marlhf_edu.model_cache import file_sha256 as sha256_of  # one streaming sha256 for checkpoints and the cache


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file (or a directory's entries) to the disk, so a rename after it cannot outlive its contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_checkpoint(folder: pathlib.Path, state: dict) -> None:
    """Write `state.json` into a checkpoint folder whose other files are written, with the sha256 of each of
    them (`state["sha256"]`), and fsync everything, folder included: the caller renames it into place next."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != "state.json")
    for p in files:
        fsync_path(p)
    state = {**state, "sha256": {p.name: sha256_of(p) for p in files}}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    fsync_path(folder / "state.json")
    fsync_path(folder)


def verify_checkpoint(folder: pathlib.Path) -> dict:
    """The checkpoint's `state.json`, after checking every file against its recorded sha256; `ValueError` saying
    what is wrong otherwise (a checkpoint written before checksums existed is checked for its state only)."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"state.json cannot be read ({err.__class__.__name__}: {err})") from None
    for name, digest in state.get("sha256", {}).items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != digest:
            raise ValueError(f"{name} does not match its recorded sha256 (damaged or changed)")
    return state


def usable_checkpoint(root: pathlib.Path) -> tuple[pathlib.Path, dict, list[str]]:
    """The newest checkpoint under `root` that verifies, its state, and a line for each newer one skipped.
    `latest` is tried first, then every other complete `step-*` folder, newest first. `ConfigError` when none."""
    if not (root / "latest").exists():
        raise ConfigError(f"--resume: no checkpoint in {root}")
    latest = root / (root / "latest").read_text().strip()
    others = sorted((p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp") and p != latest),
                    reverse=True)
    skipped = []
    for folder in [latest, *others]:
        try:
            return folder, verify_checkpoint(folder), skipped
        except ValueError as err:
            skipped.append(f"{folder.name}: {err}")
    raise ConfigError(f"--resume: no usable checkpoint in {root}:\n  " + "\n  ".join(skipped))


def check_run_folder(config):
    """What `output_dir` holds, checked before any model is loaded or any file written (`stages.ppo.run` calls
    it first). A fresh run (`resume` false) needs a folder without a run: `None`. A resume needs a checkpoint
    that verifies (`usable_checkpoint`) and whose settings equal this config's
    (`PPOConfig.resume_differences`): `(folder, state)`. Every problem is a `ConfigError` naming the folder
    and, for changed settings, each one."""
    out = pathlib.Path(config.output_dir)
    root = out / "checkpoints"
    if not config.resume:
        if (out / "metrics.jsonl").exists() or root.exists():
            raise ConfigError(f"{out} already holds a run; pass --resume true to continue it or choose another "
                              "output_dir (nothing was loaded, and nothing in it was changed)")
        return None
    ckpt, state, skipped = usable_checkpoint(root)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # what torchrun and accelerate launch set for every rank
    if state.get("world_size", 1) != world:
        raise ConfigError(f"--resume: {ckpt} was written by a run on {state.get('world_size', 1)} rank(s), this one "
                          f"has {world}: resume with the same number of processes")
    for name in ("metrics.jsonl", "eval_curve.jsonl"):  # records the resume rewrites: readable, before any load
        if (out / name).exists():
            read_jsonl(out / name)
    for line in skipped:
        print(f"--resume: skipping damaged checkpoint {line}; resuming from {ckpt.name}")
    changed = config.resume_differences(state.get("config", {}))
    if changed:
        raise ConfigError(f"--resume: the settings differ from the run in {out} (checkpoint {ckpt.name}):\n  "
                          + "\n  ".join(changed) + "\nresume with the run's settings, or start a new run in "
                          "another output_dir")
    return ckpt, state


def load_data(path: pathlib.Path, **kwargs):
    """`torch.load` of a checkpoint file as data only (`weights_only=True`): a pickle that asks to call anything
    (a crafted `rng.pt` calling `os.system`, say) is refused before it runs, with the file named."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise ConfigError(f"--resume: {path} is not plain checkpoint data (tensors, dicts, numbers) and was not "
                          f"loaded: {str(err).splitlines()[0]}. Resume only from checkpoints this engine wrote.") from None


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The records of a JSONL file the run appends to; a last line cut off by a kill mid-write is ignored (any
    other line that does not parse is an error naming the file and line)."""
    lines = pathlib.Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                continue  # half-written by a killed run
            raise DataFileError(f"{path}, line {i + 1}: not a JSON record (only a last line cut off by a kill is "
                                "ignored): repair or remove that line") from None
    return out


def keep_records_up_to(path: pathlib.Path, key: str, last: int) -> None:
    """Rewrite a run's JSONL file with only the records whose `key` is at most `last` (a resumed run drops what
    the killed one logged after its checkpoint, and any half-written line)."""
    if path.exists():
        kept = [r for r in read_jsonl(path) if r[key] <= last]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class RunLock:
    """An exclusive lock on a run folder (`output_dir/.lock`, `fcntl.flock`) held for the whole run by the
    process that writes (rank 0): a second launch into the same folder, a `--resume` beside a running run say,
    is refused at once instead of interleaving its records with the first's. The lock dies with its process,
    so a killed run leaves nothing to clean up. Other ranks of a data-parallel run take no lock."""

    def __init__(self, output_dir, enabled: bool = True):
        self.path, self.enabled, self.fd = pathlib.Path(output_dir) / ".lock", enabled, None

    def __enter__(self):
        if not self.enabled:
            return self
        import fcntl

        try:  # also the run's first write: a folder it cannot write is found now, not at the first checkpoint
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"{self.path.parent} cannot be written ({err.strerror}): choose an output_dir this "
                              "user can write") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"{self.path.parent} is being written by another process (it holds {self.path}); "
                              "wait for it to finish or choose another output_dir") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
