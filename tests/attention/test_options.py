"""One definition of the attention options (qkv.options.OPTIONS): every public entry point
takes each option of the kinds it serves, with the table's default, or says in
qkv.options.LACKS why it does not. A new row in the table fails here for every entry point
whose signature is written out and lacks it (the derived ones take it by themselves)."""
import inspect

import pytest

import qkv
from qkv import options as opts


def _keywords(*funcs) -> dict:
    """Keyword parameters (name -> default) of the functions together."""
    out = {}
    for fn in funcs:
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty:
                out[p.name] = p.default
    return out


def missing(funcs, kinds, lacking=None, table=None) -> list:
    """The options of ``kinds`` that the entry point neither takes (with the table's default)
    nor lists in ``LACKS[lacking]``."""
    table = opts.OPTIONS if table is None else table
    have = _keywords(*funcs)
    skip = opts.LACKS.get(lacking, {})
    wrong = []
    for o in table:
        if o.kind not in kinds or o.name in skip:
            continue
        if o.name not in have:
            wrong.append(f"{o.name} (not taken, no reason in LACKS[{lacking!r}])")
        elif have[o.name] != o.default and not (o.default is None and have[o.name] is None):
            wrong.append(f"{o.name} (default {have[o.name]!r}, the table's {o.default!r})")
    return wrong


ALL = ("mask", "problem", "output", "kernel")
BACKWARD = ("mask", "problem", "kernel")


def entry_points():
    from qkv import nn
    points = [
        ("qkv.attention", [qkv.attention], ALL, None),
        ("qkv.attention_backward", [qkv.attention_backward], BACKWARD, None),
        ("qkv.linear_attention", [qkv.linear_attention], ALL, "linear_attention"),
        ("qkv.linear_attention_backward", [qkv.linear_attention_backward], BACKWARD, "linear_attention"),
        ("qkv.nn.MultiHeadAttention", [nn.MultiHeadAttention.__init__, nn.MultiHeadAttention.forward],
         ("mask", "problem"), "layer"),
        ("qkv.nn.LatentAttention", [nn.LatentAttention.__init__, nn.LatentAttention.forward],
         ("mask", "problem"), "latent"),
        ("qkv.nn.SelfAttention", [nn.SelfAttention.__init__, nn.SelfAttention.forward],
         ("mask", "problem"), "self_attention"),
    ]
    try:
        from qkv import distributed as dist
        points += [("qkv.distributed.ring_attention", [dist.ring_attention], ALL, "ring_attention"),
                   ("qkv.distributed.ring_attention_backward", [dist.ring_attention_backward], BACKWARD,
                    "ring_attention")]
    except ImportError:  # pragma: no cover - qkv.distributed imports mpi4py lazily
        pass
    return points


@pytest.mark.parametrize("name,funcs,kinds,lacking", entry_points(), ids=[p[0] for p in entry_points()])
def test_every_entry_point_takes_every_option_or_says_why(name, funcs, kinds, lacking):
    assert missing(funcs, kinds, lacking) == [], name


def test_a_new_option_fails_every_written_out_entry_point_until_it_is_taken():
    """The check bites: a toy row in the table is missing from every entry point here (the
    derived signatures were made at import, before the row)."""
    toy = opts.Option("toy", None, "mask", "int", "a test's")
    table = opts.OPTIONS + (toy,)
    for name, funcs, kinds, lacking in entry_points():
        assert any(w.startswith("toy ") for w in missing(funcs, kinds, lacking, table)), name


def test_derived_signatures_follow_the_table():
    from qkv import api
    sig = inspect.signature(qkv.attention)
    assert list(sig.parameters)[3:] == [o.name for o in opts.OPTIONS]
    assert all(sig.parameters[o.name].default == o.default for o in opts.OPTIONS)
    assert api.FORWARD == tuple(o.name for o in opts.OPTIONS)
    assert "dlse" in inspect.signature(qkv.attention_backward).parameters


def test_torch_schema_covers_the_table():
    torch_options = pytest.importorskip("qkv.torch.options", reason="extra 'torch' not installed")
    assert set(torch_options.NAMES) | set(torch_options.RETURNS) == {o.name for o in opts.OPTIONS}


def test_lacks_names_only_real_options_with_reasons():
    for entry, reasons in opts.LACKS.items():
        for name, why in reasons.items():
            assert name in opts.BY_NAME and len(why) > 10, (entry, name)


def test_bind_fills_defaults_and_names_unknown_keywords():
    bound = opts.bind("attention", {"causal": True}, opts.names(*ALL))
    assert bound["causal"] is True and bound["method"] == "auto" and bound["window"] is None
    with pytest.raises(qkv.OptionError, match=r"attention got an unknown keyword argument is_causal= "
                                              r"\(qkv's name: causal=True"):
        opts.bind("attention", {"is_causal": True}, opts.names(*ALL))


def test_every_option_and_keyword_is_documented_in_the_docstrings():
    """qkv.attention's Args name every option of the table; attention_backward's its own
    keywords (softcap, dropout_p and dropout_seed had been left out)."""
    import re

    from qkv import api

    def args(fn):  # the names before the colon of each "Args:" entry
        return {name for line in re.findall(r"^ {8}([\w, .]+):", fn.__doc__, re.M) for name in line.split(", ")}

    assert set(api.FORWARD) <= args(qkv.attention), set(api.FORWARD) - args(qkv.attention)
    assert {"dlse", "return_dbias"} <= args(qkv.attention_backward)
