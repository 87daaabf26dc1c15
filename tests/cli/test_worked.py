"""The texts' worked examples, recomputed: hand math written out here, not copied from qkv."""
import math
import subprocess
import sys

import numpy as np
import pytest

from qkv.experiments import worked as demo
from qkv.cli import main


def hand_softmax(row):
    e = [math.exp(x) for x in row]
    return [x / sum(e) for x in e]


def test_three_token_example_by_hand():
    t = demo.three_tokens()
    r = 1 / math.sqrt(2)
    scaled = [[r, 0, r], [0, r, r], [r, r, 2 * r]]
    weights = [hand_softmax(row) for row in scaled]
    x = [[1, 0], [0, 1], [1, 1]]
    out = [[sum(w[j] * x[j][c] for j in range(3)) for c in range(2)] for w in weights]
    np.testing.assert_allclose(t["scores"], [[1, 0, 1], [0, 1, 1], [1, 1, 2]])
    np.testing.assert_allclose(t["scaled"], scaled, rtol=1e-15)
    np.testing.assert_allclose(t["weights"], weights, rtol=1e-14)
    np.testing.assert_allclose(t["output"], out, rtol=1e-14)
    # rows 0 and 1 agree with the text; row 2 does not (0.288/0.424 in the text)
    np.testing.assert_allclose(t["weights"][:2], demo.THREE_TOKENS_PRINTED["weights"][:2], atol=5e-4)
    assert abs(t["weights"][2, 2] - 0.5035) < 1e-4


def test_soft_lookup_by_hand():
    s = demo.soft_lookup()
    scores = [1.0, 0.9 + 0.1 * 0.05, 0.05]
    w = hand_softmax(scores)
    np.testing.assert_allclose(s["scores"], scores, rtol=1e-15)
    np.testing.assert_allclose(s["weights"], w, rtol=1e-14)
    np.testing.assert_allclose(s["output"], [10 * w[0] + 9 * w[1], w[1] + 10 * w[2]], rtol=1e-14)
    w2 = hand_softmax([x / math.sqrt(2) for x in scores])
    np.testing.assert_allclose(s["weights_scaled"], w2, rtol=1e-14)


def test_scaling_shows_saturation_without_sqrt_dk():
    sc = demo.scaling(d_k=512)
    assert 0.8 * math.sqrt(512) < sc["score_std"] < 1.2 * math.sqrt(512)
    assert 0.8 < sc["score_std_scaled"] < 1.2
    assert sc["weights_unscaled"].max() > 0.99 > sc["weights_scaled"].max()
    assert sc["jacobian_unscaled"] < 1e-3 * sc["jacobian_scaled"]


def test_demo_command_prints_the_steps_and_flags_the_texts_misprints(capsys):
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    for step in ("Step A", "Step B", "Step C", "Step D", "Soft dictionary lookup", "d_k = 512"):
        assert step in text
    assert "the text prints 0.288 at (2, 0); the math gives 0.2483" in text
    assert "the text prints 0.712 at (2, 0); the math gives 0.7517" in text
    assert "the text prints 8.62 at 0; the math gives 7.920" in text
    assert "[0.802 0.599]" in text  # rows the text got right are shown as they are


def test_demo_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the viz extra: pip install -e '.[viz]'")
    path = tmp_path / "weights.png"
    assert main(["demo", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_demo_plot_to_a_path_it_cannot_write_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "--plot", str(tmp_path / "missing" / "w.png")]) == 2
    assert main(["demo", "--plot", str(tmp_path / "w.txt")]) == 2
    captured = capsys.readouterr()
    assert "--plot must be in an existing folder" in captured.err and "--plot must end in" in captured.err
    assert captured.out == ""  # refused before the report, not after it


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from qkv.cli import main\n"
        f"sys.exit(main(['demo', '--plot', r'{tmp_path / 'x.png'}']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "pip install -e '.[viz]'" in proc.stderr and "matplotlib" in proc.stderr


def test_qkv_command_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "qkv", "demo"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Step D" in proc.stdout
