"""The model cache (`marlhf_edu.loading.model_cache`): entries keyed by content, sealed, checked, built once under a lock,
in a private folder when the home directory is not writable, and listed or cleaned from the command line."""

import os
import pathlib
import stat
import threading
import time

import pytest

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading import model_cache
from marlhf_edu.loading.model_cache import cache_dir, check_entry, publish


def _builder(calls, text="weights"):
    def build(tmp):
        calls.append(tmp)
        time.sleep(0.2)  # long enough for a second process to arrive while the first builds
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_text(text)
    return build


def test_an_entry_is_built_once_sealed_and_rebuilt_when_changed_or_planted(tmp_path, capsys):
    target, calls = tmp_path / "merged" / "adapter-0123", []
    (tmp_path / "merged").mkdir()
    stale = tmp_path / "merged" / "adapter-0123.tmp-killed"  # what a killed build leaves
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    assert publish(_builder(calls), target) == target and len(calls) == 1
    assert not stale.exists() and check_entry(target) is None
    assert publish(_builder(calls), target) == target and len(calls) == 1  # served, not rebuilt
    (target / "model.safetensors").write_text("planted")  # a changed file: rebuilt, not served
    publish(_builder(calls), target)
    assert len(calls) == 2 and (target / "model.safetensors").read_text() == "weights"
    assert "failed its check (model.safetensors does not match its recorded sha256); rebuilding" in capsys.readouterr().out
    planted = tmp_path / "merged" / "other-4567"  # a folder put under a key by hand, no manifest
    planted.mkdir()
    (planted / "config.json").write_text("{}")
    publish(_builder(calls), planted)
    assert len(calls) == 3 and check_entry(planted) is None


def test_two_builders_of_one_key_build_it_once(tmp_path):
    target, calls, errors = tmp_path / "gguf" / "model-89ab", [], []

    def one():
        try:
            publish(_builder(calls), target)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and check_entry(target) is None


def test_gguf_entries_are_keyed_by_content_not_name_and_size(tmp_path, monkeypatch):
    from marlhf_edu.loading.sources import gguf_digest

    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, text in ((a, "one"), (b, "two")):
        path.parent.mkdir()
        path.write_text(text)
    assert a.stat().st_size == b.stat().st_size and gguf_digest(a) != gguf_digest(b)
    # and materialize_gguf files each under its own content's key (publish is where the key is used)
    import marlhf_edu.loading.sources as sources

    targets = []
    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "publish", lambda build, target: targets.append(target) or target)
    monkeypatch.setattr(sources, "gguf_special_tokens", lambda path: {})  # these files hold no GGUF header
    sources.materialize_gguf(a), sources.materialize_gguf(b)
    assert [t.name for t in targets] == [f"model-{gguf_digest(a)[:16]}", f"model-{gguf_digest(b)[:16]}"]


def test_without_a_writable_home_the_cache_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.delenv("MARLHF_EDU_CACHE", raising=False)
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.setattr(pathlib.Path, "home", classmethod(lambda cls: blocker))  # ~/.cache cannot be made
    monkeypatch.setattr(model_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    path = cache_dir()
    assert path == tmp_path / f"marlhf_edu_cache-{os.getuid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    path.chmod(0o777)  # as if another user had made it, open to all
    with pytest.raises(ConfigError, match="not a folder that belongs to this user alone"):
        cache_dir()


def test_cache_list_and_clean_from_the_command_line(tmp_path, monkeypatch, capsys):
    from marlhf_edu.cli import main

    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path))
    publish(_builder([]), tmp_path / "merged" / "a-1")
    publish(_builder([]), tmp_path / "merged" / "b-2")
    (tmp_path / "merged" / "b-2" / "model.safetensors").write_text("changed")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "merged/a-1" in out and "ok" in out and "FAILS: model.safetensors does not match" in out
    assert "2 entries" in out
    assert main(["cache", "clean", "merged/nope"]) == 2
    assert "no entry merged/nope" in capsys.readouterr().err
    assert main(["cache", "clean", "merged/b-2"]) == 0
    assert [p.name for p in (tmp_path / "merged").iterdir() if p.is_dir()] == ["a-1"]
    killed = tmp_path / "merged" / "c-3.tmp-999"  # what a build killed mid-way leaves
    killed.mkdir()
    (killed / "model.safetensors").write_text("half")
    building = tmp_path / "merged" / "d-4.tmp-1000"  # a build running right now holds its key's lock
    building.mkdir()
    import fcntl

    with open(tmp_path / "merged" / "d-4.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["cache", "clean"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("1 entries removed from " + str(tmp_path) + ", and 1 unfinished builds")
    assert not killed.exists() and building.exists()  # the orphan swept, the running build left alone
    assert [p.name for p in (tmp_path / "merged").iterdir() if p.is_dir()] == ["d-4.tmp-1000"]


def test_an_entry_is_hashed_once_per_process_until_a_file_changes(tmp_path, monkeypatch):
    target = tmp_path / "merged" / "x-1"
    publish(_builder([]), target)
    hashed = []
    original = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda p: hashed.append(p) or original(p))
    assert check_entry(target) is None and check_entry(target) is None
    assert hashed == []  # verified when it was published: not hashed again
    time.sleep(0.01)
    (target / "model.safetensors").write_text("changed")
    assert "does not match" in check_entry(target) and hashed
