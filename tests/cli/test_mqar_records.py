"""mqar.runs.jsonl, the runs ``qkv experiment mqar`` kept (:class:`qkv.experiments.mqar_runs.Kept`):
every line ended, checksummed and of one qkv version; a damaged or implausible line is skipped
(its run trained again) and said once on stderr; the file is only ever appended to."""
import hashlib
import json
import random
import time

import pytest

import qkv
from qkv.experiments import mqar_runs
from qkv.experiments.mqar import MQARConfig
from qkv.experiments.mqar_runs import KEPT, Kept, mqar_experiment

SMALL = dict(mixers=("attention",), widths=(8,), pairs=(2,), seq_len=16, vocab_size=32, steps=2, batch=4,
             n_eval=4, n_val=4, val_every=2, lrs=(1e-3, 1e-2), seeds=(0, 1))


def _result(val=0.5, acc=0.25, steps=2) -> dict:
    """A result of the shape train_one returns."""
    return {"accuracy": [acc], "val_accuracy": val, "diverged": False, "diverged_at": None, "final_loss": 3.4,
            "seconds": 0.1, "params": 1832, "steps": steps}


def _forged(cfg, run, result, **fields) -> bytes:
    """A line whose checksum is right for what it says (the format the docstring of Kept gives)."""
    record = {"key": mqar_runs.config_key(cfg), "qkv": qkv.__version__, "run": run, "result": result, **fields}
    canonical = lambda r: json.dumps(r, sort_keys=True, separators=(",", ":"))  # noqa: E731
    return canonical({**record, "sha256": hashlib.sha256(canonical(record).encode()).hexdigest()}).encode()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """``(cfg, bytes, done)``: the kept file of a real tiny experiment (3 runs) and its runs read back."""
    cfg = MQARConfig(**SMALL)
    path = tmp_path_factory.mktemp("real") / KEPT
    mqar_experiment(cfg, kept=Kept(path, cfg))
    done = Kept(path, cfg).done
    assert len(done) == 3 and path.read_bytes().count(b"\n") == 3
    return cfg, path.read_bytes(), done


def test_a_line_cut_by_a_kill_is_ended_before_the_next_run_is_added(tmp_path, capsys):
    cfg, path = MQARConfig(**SMALL), tmp_path / KEPT
    k = Kept(path, cfg)
    k.add(("attention", 8, 1e-3, 0), _result())
    k.add(("attention", 8, 1e-2, 0), _result(0.7))
    whole = path.read_bytes()
    path.write_bytes(whole[:-40])                                       # the kill cut the second line
    Kept(path, cfg).add(("attention", 8, 1e-2, 0), _result(0.7))       # the resumed call trains it again
    assert path.read_bytes().startswith(whole[:-40])                   # appended, never rewritten
    again = Kept(path, cfg)
    assert again.done == {("attention", 8, 1e-3, 0): _result(), ("attention", 8, 1e-2, 0): _result(0.7)}
    assert again.skipped == {"not JSON (cut short or damaged)": 1}
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"qkv experiment mqar: 1 line(s) of {path} skipped, their runs trained again: 1 not JSON")


@pytest.mark.parametrize("result,why", [
    ({}, "result missing accuracy, diverged, diverged_at, final_loss, params, seconds, steps, val_accuracy"),
    ("x", "result not a dict"), (None, "result not a dict"),
    (_result(float("nan")), "val_accuracy not a float in [0, 1]"),
    (_result(5.0), "val_accuracy not a float in [0, 1]"),
    (_result(-0.1), "val_accuracy not a float in [0, 1]"),
    (_result("0.9"), "val_accuracy not a float in [0, 1]"),
    (_result(True), "val_accuracy not a float in [0, 1]"), (_result(1), "val_accuracy not a float in [0, 1]"),
    (_result(acc=float("inf")), "accuracy not 1 float(s) in [0, 1]"),
    ({**_result(), "accuracy": [0.5, 0.5]}, "accuracy not 1 float(s) in [0, 1]"),
    (_result(steps=3), "steps not a whole number in [0, 2]"),
    (_result(steps=2.0), "steps not a whole number in [0, 2]"),
    ({**_result(), "diverged": True}, "diverged not a bool with its diverged_at"),
    ({**_result(), "final_loss": float("nan")}, "final_loss not a finite float (NaN only before a first step)"),
    ({**_result(), "seconds": -1}, "seconds not a finite float >= 0"),
    ({**_result(), "params": 0}, "params not a whole number in [1, 2**63)"),
])
def test_an_implausible_result_is_skipped_and_named(tmp_path, capsys, result, why):
    cfg, path = MQARConfig(**SMALL), tmp_path / KEPT
    Kept(path, cfg).add(("attention", 8, 1e-3, 0), _result())
    Kept(path, cfg).add(("attention", 8, 1e-2, 0), result)             # checksummed: only plausibility rejects it
    k = Kept(path, cfg)
    assert list(k.done) == [("attention", 8, 1e-3, 0)] and k.skipped == {why: 1}
    assert capsys.readouterr().err.strip().endswith(f"trained again: 1 {why}")


def test_a_run_not_of_the_grid_or_of_another_qkv_version_is_not_reused(tmp_path, monkeypatch, capsys):
    cfg, path = MQARConfig(**SMALL), tmp_path / KEPT
    lines = [_forged(cfg, ("attention", 8, 1e-3, 5), _result()),        # a seed the grid has not
             _forged(cfg, ("attention", 8, 1e-3), _result()),
             _forged(cfg, ("attention", 8, 1e-3, 0), _result(), qkv="0.0.1")]
    path.write_bytes(b"\n".join(lines) + b"\n")
    k = Kept(path, cfg)
    assert k.done == {} and k.skipped == {"run not one of this grid's (mixer, width, lr, seed)": 2,
                                          f"of another qkv version than {qkv.__version__}": 1}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"qkv experiment mqar: 3 line(s) of {path} skipped")
    monkeypatch.setattr(qkv, "__version__", "9.9.9")                    # an upgraded qkv
    Kept(path, cfg).add(("attention", 8, 1e-3, 1), _result())
    monkeypatch.undo()
    assert Kept(path, cfg).done == {}


def test_an_edited_line_fails_its_checksum_and_a_forged_accuracy_cannot_choose_the_lr(tmp_path, monkeypatch):
    """An uninterrupted sweep chooses lr 1e-2; a kept line of lr 1e-3 edited to val_accuracy 1.0
    (or forged with its checksum to NaN or 5) is trained again, and the same lr is chosen."""
    fake = {1e-3: _result(0.2), 1e-2: _result(0.6)}
    trained = []
    monkeypatch.setattr(mqar_runs, "train_one", lambda cfg, m, w, lr, s: trained.append((lr, s)) or fake[lr])
    cfg = MQARConfig(**{**SMALL, "seeds": (0,)})
    assert mqar_experiment(cfg)["chosen_lr"] == {"attention@8": 1e-2}
    for i, line in enumerate([_forged(cfg, ("attention", 8, 1e-3, 0), _result(0.2)).replace(b'"val_accuracy":0.2',
                                                                                             b'"val_accuracy":1.0'),
                              _forged(cfg, ("attention", 8, 1e-3, 0), _result(float("nan"))),
                              _forged(cfg, ("attention", 8, 1e-3, 0), _result(5.0))]):
        path = tmp_path / f"{i}.jsonl"
        path.write_bytes(line + b"\n")
        trained.clear()
        assert mqar_experiment(cfg, kept=Kept(path, cfg))["chosen_lr"] == {"attention@8": 1e-2}
        assert trained == [(1e-3, 0), (1e-2, 0)]


def test_results_that_are_not_a_dict_of_train_one_are_trained_again_not_a_traceback(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(mqar_runs, "train_one", lambda cfg, m, w, lr, s: trained.append((lr, s)) or _result())
    cfg, path = MQARConfig(**SMALL), tmp_path / KEPT
    k = Kept(path, cfg)
    for run, bad in [(("attention", 8, 1e-3, 0), {}), (("attention", 8, 1e-2, 0), "x"),
                     (("attention", 8, 1e-3, 1), [])]:
        k.add(run, bad)
    rec = mqar_experiment(cfg, kept=Kept(path, cfg))
    assert trained == [(1e-3, 0), (1e-2, 0), (1e-3, 1)] and len(rec["runs"]) == 3


def test_an_older_line_without_checksum_or_version_is_trained_again(tmp_path, capsys):
    cfg, path = MQARConfig(**SMALL), tmp_path / KEPT
    old = {"key": mqar_runs.config_key(cfg), "run": ["attention", 8, 1e-3, 0], "result": _result()}
    path.write_text(json.dumps(old) + "\n")
    assert Kept(path, cfg).done == {}
    assert "1 without a checksum" in capsys.readouterr().err


# The fuzzer: a real kept file, one line damaged in every way below; after each, Kept reads it
# without a traceback in under 2 s, the good lines' runs are taken, the damaged line's run is
# missing (to be trained again) unless the damage left its meaning whole, it is said in one line on
# stderr, and adding that run again appends a line that reads back.

def _junk(cfg, run, result) -> list[bytes]:
    """Whole lines in place of a good one: forged fields, numbers, types, nesting, length."""
    forged = [dict(val_accuracy=v) for v in (1e308, -1e308, float("inf"), float("-inf"), float("nan"), 10**30, 2)]
    forged += [dict(accuracy=v) for v in ([float("nan")], [1e999], 0.5, [[0.5]], [], None, [0.5] * 1000)]
    forged += [dict(steps=v) for v in (10**40, -1, None, "2", True)] + [dict(steps=-(10**400)), dict(seconds=1e999)]
    forged += [{k: 10**400} for k in ("val_accuracy", "seconds", "final_loss", "params")] + [dict(accuracy=[10**400])]
    forged += [dict(diverged="no"), dict(diverged_at=7), dict(final_loss="low"), dict(params=-5), dict(params=1.5)]
    lines = [_forged(cfg, run, {**result, **f}) for f in forged]
    lines += [_forged(cfg, r, result) for r in ([run[0], run[1], run[2]], [run[0], "8", run[2], run[3]],
                                                [run[0], run[1], 1e999, run[3]], [7, run[1], run[2], run[3]],
                                                [run[0], run[1], run[2], 10**50], "run", None)]
    lines += [_forged(cfg, run, r) for r in ({}, "x", None, [], 1, 0.5, True, [result], {"result": result})]
    lines += [_forged(cfg, run, result, qkv=v) for v in ("0.0.1", None, 0.1, "")]
    good = _forged(cfg, run, result)
    lines += [good.replace(b'"qkv"', b'"qkv2"'), good.replace(b'"sha256"', b'"sha"'), good[:-1] + b',"x":1}',
              good.replace(b'"sha256":"', b'"sha256":"0'), b"[" * 100_000 + b"]" * 100_000,
              b'{"a":' * 100_000 + b"1" + b"}" * 100_000, good[:-1] + b',"deep":' + b"[" * 3000 + b"]" * 3000 + b"}",
              b'{"key":"' + b"x" * 2_000_000 + b'"}', b"1" * 100_000, b"9" * 5000 + b"e9999", b"NaN", b"null",
              b"\xff\xfe" + good, good.replace(b'"run"', b'"r\xc3\x28n"'), b"\x00" * 1000, good.replace(b":", b"\t:"),
              good + b"\r", good + b" trailing", b'{"sha256":"' + b"0" * 64 + b'"}']
    return lines


def _damaged(cfg, whole: bytes, rng: random.Random, every_offset: bool, flips: int) -> list[tuple]:
    """``(index of the damaged line, file, whether anything is left of that line)`` for each case."""
    lines = whole.rstrip(b"\n").split(b"\n")
    last = len(lines) - 1
    head = b"\n".join(lines[:-1]) + b"\n"
    cuts = range(len(lines[-1]) + 1) if every_offset else sorted(rng.sample(range(len(lines[-1]) + 1), 40))
    cases = [(last, head + lines[-1][:n], n > 0) for n in cuts]                # a kill: no newline after the cut
    for _ in range(flips):
        i = rng.randrange(len(lines))
        line = bytearray(lines[i])
        for _ in range(rng.choice((1, 1, 2, 8))):
            line[rng.randrange(len(line))] ^= rng.randrange(1, 256)
        cases.append((i, b"\n".join(lines[:i] + [bytes(line)] + lines[i + 1:]) + b"\n", True))
    for i in (0, last):
        run = json.loads(lines[i])["run"]
        result = json.loads(lines[i])["result"]
        for junk in _junk(cfg, run, result):
            cases.append((i, b"\n".join(lines[:i] + [junk] + lines[i + 1:]) + b"\n", True))
    return cases


def _fuzz(real, tmp_path, capsys, every_offset: bool, flips: int, seed: int):
    cfg, whole, done = real
    order = list(done)                                                  # the lines' runs, in file order
    rng, path = random.Random(seed), tmp_path / KEPT
    cases, lost = _damaged(cfg, whole, rng, every_offset, flips), 0
    for n, (i, data, left) in enumerate(cases):
        path.write_bytes(data)
        capsys.readouterr()
        start = time.perf_counter()
        k = Kept(path, cfg)
        seconds = time.perf_counter() - start
        err = capsys.readouterr().err.splitlines()
        what = f"case {n} (line {i}): {data[-200:]!r}"
        assert seconds < 2, what
        assert path.read_bytes() == data, what                          # reading never writes
        assert {r: done[r] for r in order if r != order[i]} == {r: v for r, v in k.done.items() if r != order[i]}, what
        if order[i] in k.done:                                                    # what the damage left means the same
            assert k.done[order[i]] == done[order[i]], what
        else:                                                           # trained again: its line appended, read back
            lost += 1
            k.add(order[i], done[order[i]])
            after = path.read_bytes()
            assert after.startswith(data) and after.endswith(b"\n"), what
            assert Kept(path, cfg).done == done, what
            assert err or not left, what                                # a line lost is a line said
        assert len(err) <= 1 and bool(err) == bool(k.skipped), what
        if k.skipped:
            assert err[0].startswith(f"qkv experiment mqar: {sum(k.skipped.values())} line(s) of {path} skipped"), what
    return len(cases), lost


def test_a_fuzzed_kept_file_never_costs_a_good_run_nor_keeps_a_bad_one(real, tmp_path, capsys):
    cases, lost = _fuzz(real, tmp_path, capsys, every_offset=True, flips=120, seed=0)
    assert cases > 300 and lost >= cases - 10       # kept: the whole line unended, tabs in it, a flip of e to E


@pytest.mark.slow
def test_a_fuzzed_kept_file_at_length(real, tmp_path, capsys):
    cases, lost = _fuzz(real, tmp_path, capsys, every_offset=True, flips=5000, seed=1)
    assert cases > 5000 and lost >= cases - 50
