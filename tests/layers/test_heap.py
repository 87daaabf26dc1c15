"""qkv.heap: freed arrays' pages stay mapped (fewer page faults a step), and no result changes."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from qkv.heap import keep_freed_memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="the thresholds are glibc's mallopt settings; other C libraries keep theirs")

# Allocates and frees what a training step does: arrays of a few MiB kept (and the temporaries of
# the expressions that make them), then all freed at the step's end.
CHURN = """
import json, resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from qkv.heap import keep_freed_memory
    assert keep_freed_memory()
a = np.random.default_rng(0).standard_normal((16, 256, 128)).astype(np.float32)
for _ in range(3):
    b = np.sqrt(np.exp(-np.abs(a)) + 1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):                       # a step: activations kept, then all freed
    saved = [np.sqrt(np.exp(-np.abs(a)) + 1) * a for _ in range(10)]
    del saved
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""

# A few MQAR training steps of a hybrid GPT (attention, Gated DeltaNet): the losses' and parameters' bits.
TRAIN = """
import hashlib, sys
import numpy as np
if sys.argv[1] == "keep":
    from qkv.heap import keep_freed_memory
    assert keep_freed_memory()
from qkv.experiments.mqar import MQARConfig
from qkv.experiments.mqar_data import mqar_batch
from qkv.models import GPT
from qkv.training.loop import Run, make_optimizer, train_step
cfg = MQARConfig()
tc = cfg.train_config("attention+gated_delta", 32, 3e-3, 0).resolved()
model = GPT(cfg.model_config("attention+gated_delta", 32, 0))
run = Run(tc, model, make_optimizer(model, tc), np.random.default_rng(1), None, {"kind": "mqar"})
h = hashlib.sha256()
for step in range(4):
    d = mqar_batch(run.rng, 8, 8, 64, cfg.vocab_size)
    h.update(np.float64(train_step(run, d["inputs"], d["targets"])).tobytes())
for name in sorted(model.params):
    h.update(model.params[name].tobytes())
print(h.hexdigest())
"""


def _run(code: str, mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@glibc
def test_freed_pages_stay_mapped():
    """Without the setting every step faults its arrays in again; with it, the heap keeps them."""
    plain, kept = json.loads(_run(CHURN, "plain")), json.loads(_run(CHURN, "keep"))
    assert plain > 20_000                     # 20 steps of over 20 MiB of fresh pages, 4 KiB a fault
    assert kept < plain / 10, (kept, plain)


@glibc
def test_training_gives_the_same_bits_with_the_setting():
    assert _run(TRAIN, "plain") == _run(TRAIN, "keep")


def test_it_says_whether_it_applied():
    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    script = "from qkv.heap import keep_freed_memory; print(keep_freed_memory())"
    assert _run(textwrap.dedent(script), "x") == str(on_glibc)
    assert keep_freed_memory.__doc__
