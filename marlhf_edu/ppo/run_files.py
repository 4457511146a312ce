"""What a PPO run keeps on disk, and why it can be trusted: checkpoints written atomically and durably, with a
sha256 per file; a resume that checks them (every file and every field of `state.json`), falls back to the
previous checkpoint when the latest is damaged, loads every file as data only, and refuses a run whose settings
changed. A run stopped before its first checkpoint has nothing to resume: `--resume` starts it over.

A run folder holds `metrics.jsonl` (one record per step), `eval_curve.jsonl` (with `eval_every`),
`eval.json` / `eval_samples.jsonl` (before and after) and `checkpoints/step-NNNNNN/` (the newest two) with
`checkpoints/latest` naming the newest complete one (a hint only: never followed out of `checkpoints/`, and not
needed). Each checkpoint holds what a resume loads (`trainable.safetensors`, `optimizer.pt`, the random states)
and the policy at that step as `policy/`, written as the finished run's `policy/` is (`export_policy`), so its
answers can be read (`marlhf-edu generate`) while the run goes on or after it stopped. Used by `PPOTrainer`
(chapter 09 teaches checkpoints).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil

import torch

from marlhf_edu.errors import ConfigError, DataFileError
from marlhf_edu.loading.model_cache import file_sha256 as sha256_of
from marlhf_edu.loading.sources import record_base

#: A checkpoint's copy of the policy at its step, a model reference like the finished run's `policy/`.
CHECKPOINT_POLICY = "policy"


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file (or a directory's entries) to the disk, so a rename after it cannot outlive its contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_policy(backend, config, out_dir) -> None:
    """The policy as `out_dir`: a LoRA adapter whose `base_model_name_or_path` is the run's SFT model (so
    `marlhf-edu merge`, `generate` and any stage take it as a model reference), or the whole actor when it trained
    in full. An adapter trained on an NF4 base applies to the full-precision SFT model, as QLoRA adapters do.
    Written at the end of a run (`output_dir/policy`) and into each checkpoint (`CHECKPOINT_POLICY`)."""
    backend.export_policy(out_dir)
    record_base(out_dir, config.sft_model_path)


def seal_checkpoint(folder: pathlib.Path, state: dict) -> None:
    """Write `state.json` into a checkpoint folder whose other files are written, with the sha256 of each of
    them, those in its subfolders (`policy/`) included, under their paths inside the folder (`state["sha256"]`),
    and fsync everything, folders included: the caller renames it into place next."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / "state.json")
    for p in files:
        fsync_path(p)
    for sub in sorted({p.parent for p in files} - {folder}):
        fsync_path(sub)
    state = {**state, "sha256": {p.relative_to(folder).as_posix(): sha256_of(p) for p in files}}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    fsync_path(folder / "state.json")
    fsync_path(folder)


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _inside(name: str) -> bool:
    """Whether a checksum's file name stays inside the checkpoint folder (no absolute path, no `..`)."""
    path = pathlib.PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def _numbers(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in value.values())


#: The fields of a checkpoint's `state.json` that a resume reads, each with what it must be: a state that lacks
#: one or holds another type (`"step": "6"`) is refused here, while there is a previous checkpoint to fall back
#: to, not by a traceback after the models have loaded.
STATE_FIELDS = (
    ("step", lambda v: _whole(v, 1), "a whole number of steps >= 1"),
    ("world_size", lambda v: _whole(v, 1), "a whole number of ranks >= 1"),
    ("kl_controller", lambda v: _numbers(v) and "value" in v, "an object of numbers with a 'value'"),
    ("config", lambda v: isinstance(v, dict), "an object holding the run's settings"),
    ("sha256", lambda v: isinstance(v, dict) and all(isinstance(d, str) and _inside(name) for name, d in v.items()),
     "an object giving the sha256 of each file, by its path inside the checkpoint"),
)


def state_problem(state) -> str | None:
    """What is wrong with a checkpoint's `state.json` contents, naming the field; None when every field a resume
    reads is there with its type (`STATE_FIELDS`) and the checksums cover every file it loads."""
    if not isinstance(state, dict):
        return f"not a JSON object but {type(state).__name__}"
    for key, fits, what in STATE_FIELDS:
        if key not in state:
            return f"field {key!r} is missing (it must be {what})"
        if not fits(state[key]):
            value = repr(state[key])
            return (f"field {key!r} is {value if len(value) <= 40 else value[:37] + '...'} "
                    f"({type(state[key]).__name__}), not {what}")
    if state["config"].get("adaptive_kl", True):  # the adaptive controller restores its target and horizon too
        for key in ("target", "horizon"):
            if key not in state["kl_controller"]:
                return f"field 'kl_controller' has no {key!r} (an adaptive KL controller's state needs it)"
    world = state["world_size"]
    rng = ["rng.pt"] if world == 1 else [f"rng-rank{r}.pt" for r in range(world)]
    unchecked = [name for name in ("trainable.safetensors", "optimizer.pt", *rng) if name not in state["sha256"]]
    if unchecked:  # without a checksum a damaged file is found only by loading it, after the models have loaded
        return f"field 'sha256' has no checksum for {', '.join(unchecked)}"
    return None


def verify_checkpoint(folder: pathlib.Path) -> dict:
    """The checkpoint's `state.json`, after checking every field a resume reads (`state_problem`) and every file
    against its recorded sha256; `ValueError` saying what is wrong otherwise, naming the file and the field. A
    state without checksums is refused too: nothing could then tell a truncated optimizer file from a good one
    before loading it, after the models have loaded, with no fallback left."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"state.json cannot be read ({err.__class__.__name__}: {err})") from None
    problem = state_problem(state)
    if problem is not None:
        raise ValueError(f"state.json: {problem}")
    for name, digest in state["sha256"].items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != digest:
            raise ValueError(f"{name} does not match its recorded sha256 (damaged or changed)")
    return state


def checkpoint_folders(root: pathlib.Path) -> list[pathlib.Path]:
    """The complete checkpoint folders of a run (`root` is its `checkpoints/`), newest first: `step-*` folders
    themselves, not an unfinished `.tmp` one, and not a link (which could lead out of the run)."""
    return sorted((p for p in root.glob("step-*") if p.is_dir() and not p.is_symlink() and not p.name.endswith(".tmp")),
                  reverse=True)


def usable_checkpoint(root: pathlib.Path) -> tuple[pathlib.Path, dict, list[str]]:
    """The newest checkpoint under `root` that verifies, its state, and a line for each thing passed over.
    `latest` is tried first when it names one of the run's own checkpoint folders (`checkpoint_folders`), then
    every other one, newest first. A `latest` naming anything else (`../../other_run/...`, a folder that is
    gone) is never followed, and a deleted one loses nothing: the folders beside it are still found.
    `ConfigError` when none verifies."""
    folders = checkpoint_folders(root)
    notes, damaged = [], []
    pointer = root / "latest"
    if pointer.exists():
        try:
            name = pointer.read_text().strip()
        except (OSError, ValueError):
            name = None
        named = [p for p in folders if p.name == name]
        if named:
            folders = named + [p for p in folders if p not in named]
        else:
            notes.append(f"{pointer} names {name!r}, which is not a checkpoint folder of this run: not followed")
    elif folders:
        notes.append(f"{pointer} is missing: taking the newest checkpoint that verifies")
    if not folders:
        raise ConfigError(f"--resume: no checkpoint in {root}" + "".join(f" ({line})" for line in notes))
    for folder in folders:
        try:
            return folder, verify_checkpoint(folder), notes + [f"skipping damaged checkpoint {d}" for d in damaged]
        except ValueError as err:
            damaged.append(f"{folder.name}: {err}")
    raise ConfigError(f"--resume: no usable checkpoint in {root}:\n  " + "\n  ".join(notes + damaged))


#: The records a run appends to or writes from its start, before its first checkpoint.
RECORDS = ("metrics.jsonl", "eval_curve.jsonl", "eval_samples.jsonl")
#: Where `set_aside_stopped_run` moves the records of a run stopped before its first checkpoint.
STOPPED_RUN = "stopped_before_first_checkpoint"


def stopped_before_first_checkpoint(out: pathlib.Path) -> bool:
    """Whether `out` holds a run that started (it wrote records or began a checkpoint) and was stopped before
    any checkpoint was complete, so nothing of it can be continued: no `checkpoints/latest`, no complete
    `step-*` folder, and not finished (a finished run wrote `eval.json` or `policy/`, and a checkpoint)."""
    root = out / "checkpoints"
    started = root.exists() or any((out / name).exists() for name in RECORDS)
    finished = (out / "eval.json").exists() or (out / "policy").exists()
    return started and not finished and not (root / "latest").exists() and not checkpoint_folders(root)


def set_aside_stopped_run(out: pathlib.Path) -> pathlib.Path:
    """Move the records of a run stopped before its first checkpoint into `out/stopped_before_first_checkpoint/`
    (replacing what an earlier such move put there) and remove its unfinished `.tmp` checkpoint, so the run that
    starts over writes each step once and its records are its own. Called by the writing process, after every
    rank has looked at the folder."""
    out = pathlib.Path(out)
    aside = out / STOPPED_RUN
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    for name in RECORDS:
        if (out / name).exists():
            os.replace(out / name, aside / name)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # unfinished folders only: none of them is complete
    return aside


def check_run_folder(config):
    """What `output_dir` holds, checked before any model is loaded or any file written (`ppo.run.run` calls
    it first). A fresh run (`resume` false) needs a folder without a run: `None`. A resume needs a checkpoint
    that verifies (`usable_checkpoint`) and whose settings equal this config's
    (`PPOConfig.resume_differences`): `(folder, state)`; or, for a run stopped before its first checkpoint
    (`stopped_before_first_checkpoint`), `None`: the run starts over from step 0, its records set aside by the
    writing process (`set_aside_stopped_run`), said here. Every problem is a `ConfigError` naming the folder
    and, for changed settings, each one."""
    out = pathlib.Path(config.output_dir)
    root = out / "checkpoints"
    stopped = stopped_before_first_checkpoint(out)
    if not config.resume:
        if ((out / "metrics.jsonl").exists() or root.exists()) and stopped:
            raise ConfigError(f"{out} holds a run stopped before its first checkpoint: pass --resume true to start "
                              f"it over from step 0 (its records are moved to {out / STOPPED_RUN}), or choose "
                              "another output_dir (nothing was loaded, and nothing in it was changed)")
        if (out / "metrics.jsonl").exists() or root.exists():
            raise ConfigError(f"{out} already holds a run; pass --resume true to continue it or choose another "
                              "output_dir (nothing was loaded, and nothing in it was changed)")
        return None
    if stopped:  # nothing was saved to continue from, so starting over loses nothing
        print(f"--resume: {out} holds a run stopped before its first checkpoint: there is nothing to resume, so "
              f"this run starts over from step 0; the stopped run's records are moved to {out / STOPPED_RUN}")
        return None
    ckpt, state, skipped = usable_checkpoint(root)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # what torchrun and accelerate launch set for every rank
    if state.get("world_size", 1) != world:
        raise ConfigError(f"--resume: {ckpt} was written by a run on {state.get('world_size', 1)} rank(s), this one "
                          f"has {world}: resume with the same number of processes")
    for name, key in (("metrics.jsonl", "step"), ("eval_curve.jsonl", "updates")):  # records the resume rewrites:
        if (out / name).exists():  # readable, each with its step, before any load
            read_jsonl(out / name, key)
    for line in skipped:
        print(f"--resume: {line}; resuming from {ckpt.name}")
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


def read_jsonl(path: pathlib.Path, key: str | None = None) -> list[dict]:
    """The records of a JSONL file the run appends to; a last line cut off by a kill mid-write is ignored (any
    other line that does not parse is an error naming the file and line). With `key` (`"step"` in
    `metrics.jsonl`), every record must hold it as a whole number, or the error names the file and line: a resume
    cuts the file back by it."""
    lines = pathlib.Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                continue  # half-written by a killed run
            raise DataFileError(f"{path}, line {i + 1}: not a JSON record (only a last line cut off by a kill is "
                                "ignored): repair or remove that line") from None
        if key is not None and not (isinstance(record, dict) and _whole(record.get(key), 0)):
            raise DataFileError(f"{path}, line {i + 1}: a record without a whole-number {key!r} (every record of "
                                "this file has one): repair or remove that line")
        out.append(record)
    return out


def keep_records_up_to(path: pathlib.Path, key: str, last: int) -> None:
    """Rewrite a run's JSONL file with only the records whose `key` is at most `last` (a resumed run drops what
    the killed one logged after its checkpoint, and any half-written line)."""
    if path.exists():
        kept = [r for r in read_jsonl(path, key) if r[key] <= last]
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

        # what this launch creates, so that one refused under the lock (a resume with changed settings) takes it away
        # again on its way out: a refused launch leaves nothing behind, not even an empty folder and its lock
        self.made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        self.made_lock = not self.path.exists()
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
            if exc[0] is not None:  # refused or failed: remove the lock and the folders this launch made, if empty
                if self.made_lock:
                    self.path.unlink(missing_ok=True)
                for folder in self.made:  # deepest first; one holding anything stops it
                    try:
                        folder.rmdir()
                    except OSError:
                        break
