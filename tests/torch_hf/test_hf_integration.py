"""Every hybrid family of the installed transformers (tests/hf_hybrid.py) on ``register_hf(recurrent=
True)`` against transformers' own CPU path, in every mode a trainer or a server runs it in: train
and eval mode, left and right padding, and packed by ``DataCollatorWithFlattening`` with each of
its options (``return_flash_attn_kwargs``, ``return_position_ids``, ``return_seq_idx``).

The rule (docs/torch.md, DESIGN's integration rule), float64, weights moved off their init (a
conv bias of 0 hides what padding does):

- where transformers' CPU path answers, qkv's answer is the same: the real tokens' logits and
  the loss to 1e-10;
- where it refuses (``ValueError: ... can't keep packed sequences apart without <package>``:
  packing reached its torch fallback), qkv refuses by name (a ``qkv.ShapeError``) or keeps the
  sequences apart, and then equals each sequence run alone on transformers' path (the answer of
  the packages that transformers' refusal stands for). That check needs attention layers that
  keep the sequences apart too: restarting ``position_ids`` (eager attention finds the
  sequences from them) or, for the families of :data:`VARLEN_ATTENTION`, qkv's attention with
  the collator's ``cu_seq_lens``; a case without them skips saying so.

By default a few cases that hold what was fixed; the whole grid is ``-m slow``.
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_hybrid as H  # noqa: E402
from recurrent_hf import float64, perturb, rel  # noqa: E402

import qkv  # noqa: E402
from qkv.torch import hf_recurrent, register_hf  # noqa: E402

TOL = 1e-10
LENGTHS = (7, 9)            # the packed sequences
PADDED = (13, 8)            # the padded batch's rows
# DataCollatorWithFlattening's options, by a short name: flash (cu_seq_lens_q/k, max_length_q/k),
# seq_idx, and whether position_ids (restarting at each sequence) come with them
COLLATE = {f"{name}{'' if pos else ', no position_ids'}": dict(return_flash_attn_kwargs="flash" in name,
                                                              return_seq_idx="seq_idx" in name,
                                                              return_position_ids=pos)
           for name, pos in itertools.product(("flash", "seq_idx", "flash+seq_idx", "position_ids"), (True, False))
           if not (name == "position_ids" and not pos)}
COLLATE["nothing"] = dict(return_position_ids=False)
LAYOUTS = ["left", "right"] + [f"packed: {name}" for name in COLLATE]
MODES = ["train", "eval"]
# families whose attention layers mix packed sequences under eager attention, whatever the
# position_ids: the each-alone check runs them on qkv's attention, which takes cu_seq_lens
VARLEN_ATTENTION = {
    "GraniteMoeHybrid": "its attention mask is plain causal (no packed sequences found from position_ids)",
    "GLM-5-Next": "its indexed attention's mask is plain causal (no packed sequences found from position_ids)",
}
# the default run: what the fixes of issue 62 hold (Mamba-2 mixers in training with padding;
# packing that reaches the recurrences half-way), one case each
DEFAULT = [
    ("Falcon-H1", "train", "left"), ("GraniteMoeHybrid", "train", "left"), ("NemotronH", "eval", "left"),
    ("Mamba-2", "train", "packed: flash+seq_idx"),
    ("Qwen3-Next", "train", "packed: flash"), ("Qwen3-Next", "eval", "packed: seq_idx"),
    ("Kimi Linear", "eval", "packed: flash"), ("Falcon-H1", "eval", "packed: flash"),
    ("Zamba", "eval", "packed: seq_idx"), ("LFM2", "train", "packed: flash"),
]
GRID = [c for c in itertools.product(H.FAMILIES, MODES, LAYOUTS) if c not in DEFAULT]


def models(family):
    """(transformers' model, the same weights for the hook), float64, every weight moved off its init."""
    ref = H.build(family, dtype=torch.float64)
    perturb(ref, 11)
    ours = H.build(family, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _ids(n, seed):
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed))


def padded(side):
    """A batch of two rows, the second padded on ``side``: (batch, [the real positions a row])."""
    T = max(PADDED)
    ids, mask, real = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long), []
    for r, n in enumerate(PADDED):
        span = slice(T - n, T) if side == "left" else slice(0, n)
        ids[r, span], mask[r, span] = _ids(n, 20 + r), 1
        real.append(span)
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels), real


def packed(options):
    """``DataCollatorWithFlattening(**options)`` over the sequences of :data:`LENGTHS`: (batch, sequences)."""
    from transformers import DataCollatorWithFlattening

    seqs = [_ids(n, 30 + i) for i, n in enumerate(LENGTHS)]
    batch = DataCollatorWithFlattening(**options)([{"input_ids": s.tolist()} for s in seqs])
    return dict(batch), seqs


def outcome(model, qkv_on, batch, mode):
    """``(logits, loss)`` of the model on transformers' path (``qkv_on`` False) or on the hook, or
    the ValueError it raised (qkv.ShapeError is one)."""
    model.train(mode == "train")
    try:
        with hf_recurrent.hf_recurrent_kernels(qkv_on), float64([H.modeling_module(model)]), \
                torch.set_grad_enabled(mode == "train"):
            out = model(**batch, use_cache=False)
    except ValueError as err:
        return err
    return out.logits.detach(), None if out.loss is None else out.loss.detach()


def refused_by_transformers(err) -> bool:
    return not isinstance(err, qkv.ShapeError) and "can't keep packed sequences apart" in str(err)


def assert_same(got, want, real):
    """Real tokens' logits (``real``: a slice a batch row) and the loss to :data:`TOL`."""
    assert not isinstance(got, Exception), f"qkv refused where transformers answers: {got}"
    for r, span in enumerate(real):
        assert rel(got[0][r, span], want[0][r, span]) < TOL, f"row {r}: {rel(got[0][r, span], want[0][r, span]):.3g}"
    assert abs(got[1].item() - want[1].item()) < TOL * max(1.0, abs(want[1].item()))


def each_alone(ref, seqs, labels, mode):
    """transformers' CPU path on each sequence alone: the logits side by side (1, T, V) and the
    loss of the packed labels on them."""
    logits = []
    for s in seqs:
        got = outcome(ref, False, {"input_ids": s[None]}, mode)
        if isinstance(got, Exception):
            pytest.skip(f"transformers' path cannot run one sequence alone here: {got}")
        logits.append(got[0])
    logits = torch.cat(logits, dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    return logits, loss


def check(family, mode, layout):
    ref, ours = models(family)
    if layout in ("left", "right"):
        batch, real = padded(layout)
    else:
        options = COLLATE[layout.split(": ", 1)[1]]
        batch, seqs = packed(options)
        real = [slice(0, sum(LENGTHS))]
    want = outcome(ref, False, batch, mode)
    got = outcome(ours, True, batch, mode)
    if not isinstance(want, Exception):
        return assert_same(got, want, real)
    if not refused_by_transformers(want):
        pytest.skip(f"{family} cannot run {mode} mode, {layout}, on transformers' CPU path: {want}")
    if isinstance(got, qkv.ShapeError):
        assert "seq_idx" in str(got) or "cu_seqlens" in str(got), got
        return
    assert not isinstance(got, Exception), got
    if not options["return_position_ids"]:
        pytest.skip("transformers refuses, and without restarting position_ids the attention layers see one "
                    "sequence, so each sequence alone is no oracle")
    if family in VARLEN_ATTENTION:
        if "cu_seq_lens_q" not in batch:
            pytest.skip(f"transformers refuses, and {family}'s attention mixes packed sequences without "
                        f"cu_seq_lens: {VARLEN_ATTENTION[family]}")
        ours.set_attn_implementation(register_hf())
        got = outcome(ours, True, batch, mode)
    assert_same(got, each_alone(ref, seqs, batch["labels"], mode), real)


@pytest.mark.parametrize("family, mode, layout", DEFAULT)
def test_the_hook_answers_as_transformers_cpu_path(family, mode, layout):
    check(family, mode, layout)


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, layout", GRID)
def test_every_family_mode_and_layout_answers_as_transformers_cpu_path(family, mode, layout):
    check(family, mode, layout)


# --- the hook's packing rule for fla's functions, alone ------------------------------------------

def test_fla_functions_get_cu_seqlens_made_from_seq_idx():
    kw = hf_recurrent.fla_packing("chunk_gated_delta_rule", {"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2]])})
    assert kw["cu_seqlens"].tolist() == [0, 3, 5, 6]
    flash_only = hf_recurrent.fla_packing("chunk_kda", {"cu_seq_lens_q": torch.tensor([0, 3, 7])})
    assert "cu_seqlens" not in flash_only       # not renamed: transformers' path runs these rows unpacked too


def test_fla_packing_refusals_name_what_is_missing_or_disagrees():
    with pytest.raises(qkv.OptionError, match="cu_seqlens .* no seq_idx.*return_seq_idx=True"):
        hf_recurrent.fla_packing("chunk_gated_delta_rule", {"cu_seqlens": torch.tensor([0, 3, 6])})
    disagree = r"seq_idx and cu_seq_lens_q must mark the same .*\[0, 3, 6\].*\[0, 2, 6\]"
    with pytest.raises(qkv.ShapeError, match=disagree):
        hf_recurrent.fla_packing("chunk_kda", {"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]]),
                                               "cu_seq_lens_q": torch.tensor([0, 2, 6])})
    with pytest.raises(qkv.ShapeError, match=r"seq_idx must be an integer tensor \(1, T\).*\(2, 3\)"):
        hf_recurrent.fla_packing("chunk_kda", {"seq_idx": torch.zeros(2, 3, dtype=torch.int32)})


def test_the_fused_mamba2_function_answers_none_on_cpu_as_transformers():
    """mamba_split_conv1d_scan_combined is handed no attention mask; transformers' CPU version
    returns None and the mixer takes its unfused path (which masks padding): so does the hook's."""
    fn = hf_recurrent.qkv_function("mamba_split_conv1d_scan_combined")
    assert fn(torch.zeros(1, 4, 8), torch.zeros(8, 4), None, None, None, None, 8) is None
