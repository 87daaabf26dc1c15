"""qkv.io.locate: a model named by folder, by Hugging Face id (hub cache first, a download
only where allowed) or not at all (the offline package, else the hub cache).

The id path is tested offline: the offline checkpoint is laid out as a hub cache in a
temporary folder (``models--ORG--NAME/snapshots/<hash>/...`` and ``refs/main``), with
HF_HUB_CACHE or HF_HOME pointing there.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the models extra (safetensors)")
pytest.importorskip("tokenizers", reason="needs the models extra (tokenizers)")
hub = pytest.importorskip("huggingface_hub", reason="needs the models extra (huggingface_hub)")

import qkv  # noqa: E402
from qkv.extras import MissingExtra  # noqa: E402
from qkv.io import locate  # noqa: E402
from qkv.models import CheckpointError, default_model_path, load_bert  # noqa: E402

ID = "sentence-transformers/all-MiniLM-L6-v2"
COMMIT = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"  # any 40 hex digits name a snapshot
TEXTS = ["The animal didn't cross the street because it was too tired.", "A man is playing a guitar."]


@pytest.fixture(scope="module")
def package_folder():
    try:
        return default_model_path()
    except MissingExtra as err:
        pytest.skip(f"the hub cache is laid out from the offline package: {err}")


@pytest.fixture(scope="module")
def reference(package_folder):
    return load_bert(package_folder).encode(TEXTS)


def lay_out_cache(cache, source, repo_id=ID):
    """``source``'s files as the hub cache holds a snapshot of ``repo_id`` (links, not copies)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    for f in source.rglob("*"):
        if f.is_file():
            (snap / f.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (snap / f.relative_to(source)).symlink_to(f)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Downloads off, and an empty hub cache at tmp_path/cache (HF_HOME away from the user's)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    return tmp_path / "cache"


def test_hub_id_from_the_cache(offline, package_folder, reference):
    snap = lay_out_cache(offline, package_folder)
    model = load_bert(ID)
    assert model.path == snap and model.name == ID
    # The same weights give the same vectors to float32 rounding (a padded batch and texts run
    # one a batch round differently, and the full suite has seen both within one test).
    np.testing.assert_allclose(model.encode(TEXTS), reference, rtol=1e-5, atol=1e-6)


def test_hub_id_from_hf_home(offline, monkeypatch, tmp_path, package_folder):
    monkeypatch.delenv("HF_HUB_CACHE")
    snap = lay_out_cache(tmp_path / "home" / "hub", package_folder)
    assert locate.model_folder(ID) == snap


def test_hub_id_offline_and_not_cached_names_the_id_and_the_cache(offline):
    with pytest.raises(CheckpointError) as err:
        load_bert(ID)
    message = str(err.value)
    assert ID in message and str(offline) in message and "HF_HUB_OFFLINE" in message


def test_cache_first_then_a_download_only_when_allowed(offline, monkeypatch, package_folder):
    """Not cached, downloads on: one download call, for the files the encoder reads only."""
    calls = []

    def fake_snapshot_download(repo_id, *, cache_dir, local_files_only=False, allow_patterns=None):
        calls.append((repo_id, cache_dir, local_files_only, allow_patterns))
        if local_files_only:
            raise hub.errors.LocalEntryNotFoundError("not in the cache")
        return str(lay_out_cache(offline, package_folder, repo_id))

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert locate.model_folder(ID).parent.parent.name == "models--sentence-transformers--all-MiniLM-L6-v2"
    assert [c[2] for c in calls] == [True, False]  # the cache first
    assert {c[1] for c in calls} == {str(offline)} and calls[1][3] == ["*.json", "model.safetensors"]
    calls.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: the cache only, never the network
    with pytest.raises(CheckpointError, match="other/model"):
        locate.model_folder("other/model")
    assert [c[2] for c in calls] == [True]


def test_a_failed_download_names_the_id_the_cache_and_the_reason(offline, monkeypatch):
    def unreachable(repo_id, *, cache_dir, local_files_only=False, allow_patterns=None):
        if local_files_only:
            raise hub.errors.LocalEntryNotFoundError("not in the cache")
        raise OSError("Network is unreachable")

    monkeypatch.setattr(hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(CheckpointError) as err:
        load_bert("someone/some-model")
    message = str(err.value)
    assert "'someone/some-model'" in message and str(offline) in message and "Network is unreachable" in message


def test_default_from_the_hub_cache_when_the_package_is_missing(offline, monkeypatch, package_folder):
    snap = lay_out_cache(offline, package_folder)
    real = locate.importlib.util.find_spec
    monkeypatch.setattr(locate.importlib.util, "find_spec",
                        lambda name, *a: None if name == locate.DEFAULT_PACKAGE else real(name, *a))
    assert locate.model_folder() == snap


def test_a_folder_wins_over_an_id_and_bad_names_are_clear(offline, tmp_path, monkeypatch, package_folder):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    lay_out_cache(offline, package_folder, "org/name")  # in the cache as an id, and ...
    (tmp_path / "org" / "name").symlink_to(package_folder)  # ... here as a folder: the folder wins
    assert locate.model_folder("org/name").resolve() == package_folder.resolve()
    with pytest.raises(CheckpointError, match="is not a folder"):
        locate.model_folder("./no/such/folder")
    with pytest.raises(qkv.ShapeError, match="folder path or a Hugging Face model id"):
        load_bert(42)


@pytest.mark.slow
def test_explain_takes_a_hub_id(offline, package_folder, tmp_path, capsys):
    from qkv.cli import main

    lay_out_cache(offline, package_folder)
    assert main(["explain", "--model", ID, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ID}: 6 layers × 12 heads")
    assert (tmp_path / "out" / "explain.html").is_file()
