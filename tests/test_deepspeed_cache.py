"""DeepSpeed's JIT ops are cached per build key (parallel/deepspeed/setup.py): two environments (two
install paths of deepspeed on one machine) each build once into their own folder and then reuse it,
instead of rebuilding each other's. DeepSpeed itself is faked: no compiler runs here."""

from pathlib import Path

import pytest

from shardwise.parallel.deepspeed import setup as ds


class FakeBuilder:
    """Builds like torch's JIT loader: ``TORCH_EXTENSIONS_DIR/<name>/<name>.so``, counting real builds."""

    builds: list[tuple[str, str]] = []

    def __init__(self, name: str) -> None:
        self.NAME = name

    def load(self, verbose: bool = False) -> None:
        import os

        folder = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / self.NAME
        if not (folder / f"{self.NAME}.so").exists():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{self.NAME}.so").write_bytes(b"\0")
            FakeBuilder.builds.append((os.environ["TORCH_EXTENSIONS_DIR"], self.NAME))


@pytest.fixture
def fake_deepspeed(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # Recorded first, so that teardown restores the caller's value or its absence: build_ops sets it
    # (prepare_environment), and a leaked one sent the later DeepSpeed tests' ranks to build every op
    # again in this test's folder (timed out after 420 s in a full run).
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")
    monkeypatch.setattr(ds, "_compatible_builders", lambda: [FakeBuilder("cpu_adam"), FakeBuilder("async_io")])
    FakeBuilder.builds = []
    install = {"path": "/venv-a/lib/python3.11/site-packages/deepspeed"}
    monkeypatch.setattr(ds, "deepspeed_identity", lambda: ("0.18.0", install["path"]))

    def switch(path: str) -> None:  # a new process of another environment
        install["path"] = path
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)

    switch(install["path"])
    return switch


def test_two_environments_keep_their_own_builds(fake_deepspeed, capsys):
    venv_a, venv_b = "/venv-a/lib/python3.11/site-packages/deepspeed", "/venv-b/lib/python3.11/site-packages/deepspeed"
    assert ds.build_ops() == ["cpu_adam", "async_io"]
    first = capsys.readouterr().err
    assert first.count("building DeepSpeed's") == 2 and "a first build takes minutes" in first
    dir_a = {d for d, _ in FakeBuilder.builds}
    fake_deepspeed(venv_b)
    ds.build_ops()
    second = capsys.readouterr().err
    # The other environment builds into its own folder, and says how long the last build took.
    assert second.count("building DeepSpeed's") == 2 and "its last build took" in second
    dir_b = {d for d, _ in FakeBuilder.builds} - dir_a
    assert len(dir_a) == len(dir_b) == 1 and dir_a != dir_b
    assert all(Path(d).parent == ds.extensions_root() for d in dir_a | dir_b)
    builds = len(FakeBuilder.builds)
    for venv in (venv_a, venv_b, venv_a):  # ping-pong: nobody rebuilds
        fake_deepspeed(venv)
        ds.build_ops()
        assert "building" not in capsys.readouterr().err
    assert len(FakeBuilder.builds) == builds == 4


def test_the_key_follows_what_a_build_depends_on(fake_deepspeed, monkeypatch):
    key = ds.extensions_key()
    assert ds.extensions_key() == key
    monkeypatch.setenv("CXXFLAGS", "-O3 -march=native")
    assert ds.extensions_key() != key
    monkeypatch.delenv("CXXFLAGS")
    monkeypatch.setattr(ds, "deepspeed_identity", lambda: ("0.18.1", "/venv-a/lib/python3.11/site-packages/deepspeed"))
    assert ds.extensions_key() != key


def test_an_install_reached_through_a_link_has_its_own_key(tmp_path, monkeypatch):
    """A worktree's ``.venv`` linked to another's reaches the same files under another spelling, and
    the JIT build writes that spelling into its compile command (ninja then rebuilds on every switch):
    the identity keeps the path as imported, symlinks not followed."""
    (tmp_path / "real" / "deepspeed").mkdir(parents=True)
    (tmp_path / "real" / "deepspeed" / "__init__.py").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.delitem(__import__("sys").modules, "deepspeed", raising=False)
    paths = []
    for root in ("real", "link"):
        with monkeypatch.context() as m:
            m.syspath_prepend(str(tmp_path / root))
            paths.append(ds.deepspeed_identity()[1])
    assert paths == [str(tmp_path / "real" / "deepspeed"), str(tmp_path / "link" / "deepspeed")]
