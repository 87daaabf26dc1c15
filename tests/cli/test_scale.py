"""qkv experiment scale: the texts' §7 claims, measured."""
import json
import re

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.experiments.scale import jacobian_norm, scale_experiment


def test_jacobian_norm_is_the_frobenius_norm_of_the_softmax_jacobian():
    p = qkv.softmax(np.random.default_rng(0).standard_normal((5, 7)) * 3)
    for row, got in zip(p, jacobian_norm(p)):
        jac = np.diag(row) - np.outer(row, row)
        assert got == pytest.approx(np.linalg.norm(jac), rel=1e-10)
    assert jacobian_norm(np.array([0.0, 1.0, 0.0])) == 0.0


def test_variance_grows_like_dk_and_scaling_keeps_the_softmax_alive():
    rows = {r["d_k"]: r for r in scale_experiment((4, 64, 1024), n_keys=16, n_samples=256, seed=1)}
    for d, r in rows.items():
        assert r["var_raw"] / d == pytest.approx(1.0, rel=0.15)
        assert r["var_scaled"] == pytest.approx(1.0, rel=0.15)
    assert rows[4]["max_w_raw"] < rows[64]["max_w_raw"] < rows[1024]["max_w_raw"]  # saturation
    assert rows[1024]["saturated_raw"] > 0.5 and rows[1024]["saturated_scaled"] == 0.0
    assert rows[1024]["jac_raw"] < 0.01 * rows[1024]["jac_scaled"]  # the gradient vanishes
    assert rows[4]["jac_scaled"] == pytest.approx(rows[1024]["jac_scaled"], rel=0.2)  # scaled: unchanged


def test_the_command_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["experiment", "scale", "--d-k", "2", "32", "--keys", "8", "--samples", "64",
                 "--out", str(tmp_path)]) == 0
    assert "| 32 |" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "scale.json").read_text())["rows"]) == 2
    assert (tmp_path / "scale.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["experiment", "scale", "--d-k", "0"]) == 2


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    assert main(["experiment", "scale", "--d-k", "2", "--out", str(tmp_path / "file")]) == 2
    assert "--out must be a folder" in capsys.readouterr().err


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_each_experiment_has_its_own_help_and_options(capsys):
    """`qkv experiment NAME --help` shows NAME's options only; another's option is refused."""
    own = {"scale": {"--d-k", "--keys", "--samples", "--seed", "--out"},
           "complexity": {"--quick", "--seed", "--out", "--no-progress", "--memory-limit", "--threads", "--clock"},
           "recall": {"--quick", "--seed", "--out", "--no-progress"}}
    helps = {name: _help(capsys, "experiment", name) for name in own}
    for name, text in helps.items():
        assert text.startswith(f"usage: qkv experiment {name} "), text
        shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
        assert shown == own[name] | {"--help"}, (name, shown ^ (own[name] | {"--help"}))
    assert len(set(helps.values())) == 3
    listing = _help(capsys, "experiment")
    assert all(name in listing for name in own)
    with pytest.raises(SystemExit) as done:
        main(["experiment", "scale", "--memory-limit", "10"])  # complexity's option
    assert done.value.code == 2
    assert "unrecognized arguments: --memory-limit" in capsys.readouterr().err
