"""qkv.torch.hf_kernels.fla (fla's chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
chunk_kda, fused_recurrent_kda on qkv's delta rule) against transformers' own torch fallbacks
(Qwen3-Next's torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule, Kimi Linear's
chunk_kimi_delta_attention / recurrent_kimi_delta_attention) and fla's naive references:
float64 to 1e-9 of each array's largest true entry in outputs, final states and every
gradient; float32 within twice the fallback's own float32 error.

The fallbacks and fla's naive functions cast to float32 inside; :class:`Float64` (a torch
function mode) keeps float64 tensors float64 through those casts, so their own code runs in
float64 while it is active."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.torch import hf_kernels  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

TOL64 = 1e-9
FUNCS = {"chunk_gated_delta_rule": hf_kernels.chunk_gated_delta_rule,
         "fused_recurrent_gated_delta_rule": hf_kernels.fused_recurrent_gated_delta_rule,
         "chunk_kda": hf_kernels.chunk_kda, "fused_recurrent_kda": hf_kernels.fused_recurrent_kda}
KDA = ("chunk_kda", "fused_recurrent_kda")


class Float64(TorchFunctionMode):
    """float32 read as float64 (``dtype=``, ``.to``, ``.float()``) while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") in (torch.float32,):
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def _fallback(name):
    """transformers' torch fallback registered under fla's ``name``."""
    if name in KDA:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
        return {"chunk_kda": m.chunk_kimi_delta_attention, "fused_recurrent_kda": m.recurrent_kimi_delta_attention}[name]
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return {"chunk_gated_delta_rule": m.torch_chunk_gated_delta_rule,
            "fused_recurrent_gated_delta_rule": m.torch_recurrent_gated_delta_rule}[name]


def _fla_naive(op):
    """fla's ``ops/<op>/naive.py`` by path (``import fla.ops`` needs triton)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", op, "naive.py")
    mspec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def _inputs(name, B=2, T=37, H=2, HV=4, K=8, V=5, dtype=torch.float64, state=True, seed=0, steep=False):
    """fla's tensors for ``name`` (leaves that want gradients): q, k, v, g, beta, initial_state."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    g_shape = (B, T, HV, K) if name in KDA else (B, T, HV)
    g = -torch.rand(*g_shape, generator=gen, dtype=torch.float64)
    if steep:
        g[torch.rand(g.shape, generator=gen) < 0.2] = -30.0
    x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V), g=g,
             beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
             initial_state=rnd(B, HV, K, V) if state else None)
    return {n: None if t is None else t.to(dtype).requires_grad_() for n, t in x.items()}


def _weights(o, S, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            None if S is None else torch.randn(S.shape, generator=gen, dtype=torch.float64))


def _run(fn, x, **options):
    """``[o, S, dq, dk, dv, dg, dbeta, dS0]`` in float64 (a gradient None where no input)."""
    o, S = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
              output_final_state=True, **options)
    wo, wS = _weights(o, S)
    loss = (o.double() * wo).sum() + (S.double() * wS).sum()
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state") if x[n] is not None]
    grads = iter(torch.autograd.grad(loss, leaves))
    out = [o, S] + [None if x[n] is None else next(grads) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    return [None if t is None else t.detach().double() for t in out]


NAMES = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _assert_close(got, want, tol, what=""):
    for n, a, b in zip(NAMES, got, want):
        assert (a is None) == (b is None), (what, n)
        if b is not None:
            assert a.shape == b.shape, (what, n, a.shape, b.shape)
            assert _rel(a, b) <= tol, (what, n, _rel(a, b))


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "zeros"])
def test_float64_against_transformers_fallback(name, l2, state):
    """Outputs, final state and every gradient equal transformers' own fallback run in float64.
    (Kimi's fallbacks have no grouped value heads: HV = H there.)"""
    HV = 2 if name in KDA else 4
    x = _inputs(name, HV=HV, state=state, steep=True)
    got = _run(FUNCS[name], x, use_qk_l2norm_in_kernel=l2)
    with Float64():
        want = _run(_fallback(name), x, use_qk_l2norm_in_kernel=l2)
    _assert_close(got, want, TOL64, name)


@pytest.mark.parametrize("name", list(FUNCS))
def test_float32_within_twice_the_fallbacks_own_error(name):
    """float32 (the models' dtype): each output, state and gradient errs against the float64
    truth at most twice what transformers' float32 fallback errs (or a few float32 ulps)."""
    HV = 2 if name in KDA else 4
    x64 = _inputs(name, HV=HV, T=100, seed=4)
    x32 = {n: None if t is None else t.detach().float().requires_grad_() for n, t in x64.items()}
    truth = _run(FUNCS[name], x64, use_qk_l2norm_in_kernel=True)
    got = _run(FUNCS[name], x32, use_qk_l2norm_in_kernel=True)
    peer = _run(_fallback(name), x32, use_qk_l2norm_in_kernel=True)
    for n, a, p, w in zip(NAMES, got, peer, truth):
        budget = 2 * max(_rel(p, w), 4 * torch.finfo(torch.float32).eps)
        assert _rel(a, w) <= budget, (name, n, _rel(a, w), _rel(p, w))


@pytest.mark.parametrize("name", list(FUNCS))
def test_float64_against_fla_naive(name):
    """fla's own naive references (run in float64): recurrent and chunked, GDN and KDA."""
    kda = name in KDA
    mod = _fla_naive("kda" if kda else "gated_delta_rule")
    HV = 4 if kda else 2                                   # fla's naive GDN has no grouped value heads
    x = _inputs(name, HV=HV, T=32, steep=True)
    got = _run(FUNCS[name], x, scale=0.3)
    fwd = name.startswith("fused")

    def naive(q, k, v, g, beta, initial_state, output_final_state, scale):
        if kda and fwd:
            return mod.naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
        if kda:
            return mod.naive_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size=16)
        if fwd:
            return mod.naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state)
        return mod.naive_chunk_gated_delta_rule(q, k, v, g, beta, 16, scale, initial_state, output_final_state)
    with Float64():
        want = _run(naive, x, scale=0.3)
    want[0] = want[0].reshape(got[0].shape)
    _assert_close(got, want, TOL64, name)


@pytest.mark.parametrize("name", list(FUNCS))
def test_packed_sequences_equal_each_run_alone(name):
    """cu_seqlens: the state resets at each boundary; each sequence (one of length 0) runs alone
    from its own initial state, in transformers' fallback (float64), outputs, states, gradients."""
    HV = 2 if name in KDA else 4
    lengths = [5, 0, 23, 9]
    x = _inputs(name, B=1, T=sum(lengths), HV=HV, seed=2)
    x["initial_state"] = torch.randn(len(lengths), HV, 8, 5, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 5, 28, 37], dtype=torch.int32)
    got = _run(FUNCS[name], x, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    outs, states = [], []
    with Float64():
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            part = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
            if b == a:
                o_i, S_i = part["v"], x["initial_state"][i:i + 1]
            else:
                o_i, S_i = _fallback(name)(part["q"], part["k"], part["v"], g=part["g"], beta=part["beta"],
                                           initial_state=x["initial_state"][i:i + 1], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
            outs.append(o_i)
            states.append(S_i)

    def joined(*args, **kwargs):
        return torch.cat(outs, dim=1), torch.cat(states, dim=0)
    want = _run(joined, x)
    _assert_close(got, want, TOL64, name)


@pytest.mark.parametrize("name", list(FUNCS))
def test_gates_computed_inside_and_the_state_v_first(name):
    """use_gate_in_kernel (A_log, dt_bias differentiable), use_beta_sigmoid_in_kernel with
    allow_neg_eigval, state_v_first: the same as computing them outside in torch."""
    kda = name in KDA
    x = _inputs(name, HV=2 if kda else 4, seed=6)
    HV, K = x["v"].shape[2], x["q"].shape[3]
    A_log = torch.randn(HV, dtype=torch.float64, requires_grad=True)
    dt_bias = torch.randn(HV * K if kda else HV, dtype=torch.float64, requires_grad=True)
    raw = torch.randn(x["g"].shape, dtype=torch.float64)
    logit = torch.randn(x["beta"].shape, dtype=torch.float64)
    fn = FUNCS[name]
    bias = dt_bias.reshape(HV, K) if kda else dt_bias
    scale = A_log.exp()[:, None] if kda else A_log.exp()
    g = -scale * torch.nn.functional.softplus(raw + bias)
    o_ref, S_ref = fn(x["q"], x["k"], x["v"], g=g, beta=2 * torch.sigmoid(logit), initial_state=x["initial_state"],
                      output_final_state=True)
    S0t = x["initial_state"].transpose(-1, -2)
    o, S = fn(x["q"], x["k"], x["v"], g=raw, beta=logit, initial_state=S0t, output_final_state=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True)
    assert _rel(o, o_ref) <= 1e-12 and _rel(S.transpose(-1, -2), S_ref) <= 1e-12
    w = torch.randn(o.shape, dtype=torch.float64)
    ref = torch.autograd.grad((o_ref * w).sum(), [A_log, dt_bias])
    got = torch.autograd.grad((o * w).sum(), [A_log, dt_bias])
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-12


def test_bfloat16_inputs_give_bfloat16_outputs_and_a_float32_state():
    x = _inputs("chunk_gated_delta_rule", dtype=torch.bfloat16, state=False)
    o, S = hf_kernels.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"].float(), x["beta"],
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o.float().sum().backward()
    assert x["q"].grad.dtype == torch.bfloat16 and torch.isfinite(x["g"].grad).all()


def test_output_final_state_false_returns_none():
    x = _inputs("chunk_kda", HV=2)
    o, S = hf_kernels.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert S is None and o.shape == x["v"].shape


@pytest.mark.parametrize("call, message", [
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, cp_context=object()), "cp_context"),
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, head_first=True), "head_first"),
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, chunk_size=128), "chunk_size must be one of"),
    (lambda x: hf_kernels.fused_recurrent_gated_delta_rule(**x, gv=torch.zeros(2, 37, 4, 5)), "gv="),
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, allow_neg_eigval=True), "allow_neg_eigval=True requires"),
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 37])), "batch size must be 1"),
    (lambda x: hf_kernels.chunk_gated_delta_rule(**x, use_gate_in_kernel=True), "needs A_log"),
])
def test_variants_not_computed_are_refused_by_name(call, message):
    x = _inputs("chunk_gated_delta_rule", state=False)
    with pytest.raises(qkv.ShapeError, match=message):
        call(x)


def test_kda_refusals_and_shapes_named():
    x = _inputs("chunk_kda", HV=2, state=False)
    with pytest.raises(qkv.OptionError, match="return_intermediate_states"):
        hf_kernels.chunk_kda(**x, return_intermediate_states=True)
    with pytest.raises(qkv.OptionError, match="a write strength a value channel"):
        hf_kernels.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], torch.rand(2, 37, 2, 5))
    with pytest.raises(qkv.ShapeError, match=r"g must have shape \(B, T, HV, K\) = \(2, 37, 2, 8\); got \(2, 37, 2\)"):
        hf_kernels.chunk_kda(x["q"], x["k"], x["v"], x["g"][..., 0], x["beta"])
    with pytest.raises(qkv.ShapeError, match=r"initial_state must have shape \(N, HV, K, V\) = \(2, 2, 8, 5\)"):
        hf_kernels.chunk_kda(**dict(x, initial_state=torch.zeros(1, 2, 8, 5)))
    with pytest.raises(qkv.OptionError, match=r"lower_bound must be in fla's safe range"):
        hf_kernels.chunk_kda(**x, use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0)


@pytest.mark.parametrize("name, path", [("chunk_gated_delta_rule", "gated_delta_rule/chunk.py"),
                                        ("fused_recurrent_gated_delta_rule", "gated_delta_rule/fused_recurrent.py"),
                                        ("chunk_kda", "kda/chunk.py"), ("fused_recurrent_kda", "kda/fused_recurrent.py")])
def test_signatures_are_flas(name, path):
    """Argument names, order and defaults as fla's installed source defines them (read with ast:
    ``import fla.ops`` needs triton)."""
    import ast
    import inspect

    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed")
    src = open(os.path.join(list(spec.submodule_search_locations)[0], "ops", path)).read()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)
    names = [a.arg for a in fn.args.args]
    defaults = [ast.literal_eval(d) for d in fn.args.defaults]
    want = list(zip(names, [inspect.Parameter.empty] * (len(names) - len(defaults)) + defaults))
    params = inspect.signature(FUNCS[name]).parameters
    got = [(p.name, p.default) for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert got == want
    assert fn.args.kwarg is not None and any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_fused_recurrent_decays_g_gk_and_none():
    """fused_recurrent_gated_delta_rule: g and gk together are the decay g + gk a key channel
    (chunk_kda's), no decay at all is DeltaNet's (g = 0), beta None is ones."""
    x = _inputs("chunk_kda", HV=2, seed=8)
    q, k, v, gk, beta, S0 = (x[n].detach() for n in ("q", "k", "v", "g", "beta", "initial_state"))
    g = -torch.rand(beta.shape, dtype=torch.float64)
    o, S = hf_kernels.fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta, initial_state=S0,
                                                       output_final_state=True)
    o_ref, S_ref = hf_kernels.chunk_kda(q, k, v, g[..., None] + gk, beta, initial_state=S0, output_final_state=True)
    assert _rel(o, o_ref) <= 1e-12 and _rel(S, S_ref) <= 1e-12
    o, S = hf_kernels.fused_recurrent_gated_delta_rule(q, k, v, initial_state=S0, output_final_state=True)
    o_ref, S_ref = hf_kernels.chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), torch.ones_like(beta),
                                                     initial_state=S0, output_final_state=True)
    assert _rel(o, o_ref) <= 1e-12 and _rel(S, S_ref) <= 1e-12


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("gate", ["head", "channel", None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("state", ["given", "v_first", None])
def test_a_decoding_step_without_autograd_equals_the_kernel(compiled, gate, dtype, state, monkeypatch):
    """One step under no_grad is a decoding step (qkv.torch.hf_kernels.decode: compiled, or torch
    products with the compiled passes off); it must equal qkv's chunked kernel, which the same
    call with autograd on takes: to 1e-12 of the largest entry in float64, to float32's error
    (judged against the float64 kernel) in float32, for every gate, grouped heads, l2norm, with
    and without a state, in either state layout."""
    from qkv import jit
    from qkv.torch import hf_kernels as K
    from qkv.torch.hf_kernels import decode
    if compiled and jit.load(jit.DELTA) is None:
        pytest.skip("the compiled passes are off (QKV_JIT=0 or numba missing)")
    if not compiled:
        monkeypatch.setattr(decode.jit, "load", lambda name: None)
    g_ = torch.Generator().manual_seed(3)
    B, H, HV, D, Dv = 3, 2, 4, 8, 6
    q, k = (4 * torch.randn(B, 1, H, D, generator=g_, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 1, HV, Dv, generator=g_, dtype=torch.float64)
    g = -3 * torch.rand(B, 1, HV, D, generator=g_, dtype=torch.float64)
    g = {"head": g[..., 0], "channel": g, None: None}[gate]
    beta = torch.rand(B, 1, HV, generator=g_, dtype=torch.float64)
    S0 = None if state is None else torch.randn(B, HV, D, Dv, generator=g_, dtype=torch.float64)
    if state == "v_first":
        S0 = S0.transpose(-1, -2).contiguous()
    fn = K.fused_recurrent_kda if gate == "channel" else K.fused_recurrent_gated_delta_rule
    kw = dict(g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              state_v_first=state == "v_first")
    o_ref, S_ref = fn(q.clone().requires_grad_(), k, v, **kw)
    cast = {n: (x.to(dtype) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    with torch.no_grad():
        o, S = fn(q.to(dtype), k.to(dtype), v.to(dtype), **cast)
    assert o.dtype == dtype and S.dtype == dtype and o.shape == o_ref.shape and S.shape == S_ref.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert _rel(o.double(), o_ref.detach()) <= tol and _rel(S.double(), S_ref.detach()) <= tol


@pytest.mark.parametrize("bad", ["beta nan", "beta inf", "g positive", "g nan"])
def test_a_decoding_step_refuses_the_gates_the_kernel_refuses(bad):
    """Under no_grad one step takes the decoding path; a gate qkv's kernel refuses (with autograd
    on) is refused there too, with the same message, never a silent NaN head."""
    import qkv
    from qkv.torch import hf_kernels as K
    g_ = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 1, 2, 8, generator=g_) for _ in range(2))
    v = torch.randn(1, 1, 4, 8, generator=g_)
    g, beta = -torch.rand(1, 1, 4, generator=g_), torch.rand(1, 1, 4, generator=g_)
    what, how = bad.split()
    (beta if what == "beta" else g)[0, 0, 1] = {"nan": float("nan"), "inf": float("inf"), "positive": 0.5}[how]
    match = "beta must be finite" if what == "beta" else "log_decay must be finite and <= 0"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(qkv.ShapeError, match=match):
            K.fused_recurrent_gated_delta_rule(q.clone().requires_grad_(grad), k, v, g=g, beta=beta,
                                               initial_state=torch.zeros(1, 4, 8, 8), output_final_state=True)


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("HV", [2, 6], ids=["HV=H", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_without_autograd_the_same_bits_as_with_it(name, l2, HV, dtype):
    """No gradient wanted: q and k are normalised in one pass into the kernel's layout
    (fla_args.kernel_heads; grouped value heads read their key head in the kernel), not by
    l2norm() then a copy: the same output and state, bit for bit,
    as the call that records a gradient, at scores of +-30 and more, packed or not."""
    x = _inputs(name, B=1, T=70, H=2, HV=HV, K=16, V=8, dtype=dtype, steep=True)
    x["q"] = (x["q"].detach() * 30).requires_grad_()
    for cu in (None, torch.tensor([0, 9, 40, 70])):
        if cu is not None:   # a start state a packed sequence
            x["initial_state"] = x["initial_state"].detach().repeat(3, 1, 1, 1).requires_grad_()
        with_grad = FUNCS[name](**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        with torch.no_grad():
            plain = FUNCS[name](**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        for got, want in zip(plain, with_grad):
            assert got.dtype == want.dtype and torch.equal(got, want.detach()), (cu, (got - want).abs().max())
