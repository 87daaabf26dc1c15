"""qkv.torch's recurrence operators (decay_attention, delta_rule, dplr, linear_scan): gradcheck
in float64 through every input and the final state, equality with the float64 step oracle
(qkv.recurrent.steps), opcheck, dtypes, errors and torch.compile."""
import numpy as np
import pytest

import qkv

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
qt = pytest.importorskip("qkv.torch")
from qkv.recurrent.decay import naive as decay_naive  # noqa: E402
from qkv.recurrent.delta import naive as delta_naive  # noqa: E402
from qkv.recurrent.generalized_delta import naive as dplr_naive  # noqa: E402
from qkv.recurrent.scan import naive as scan_naive  # noqa: E402
from qkv.torch import recurrent_ops as ro  # noqa: E402

DT = torch.float64
B, H, T, DK, DV = 2, 2, 5, 3, 2


def rand(*shape, seed=0, dtype=DT, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def decays(*shape, seed=0, dtype=DT, grad=True):
    """A log decay in [-1, -0.05]: finite and <= 0."""
    t = -0.05 - 0.95 * torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def inputs(name, per_channel=False, gated=True):
    """The tensor inputs of recurrence ``name`` (the initial state last), float64, requiring grad."""
    if name == "linear_scan":
        return [rand(B, T, DK, seed=1), decays(B, T, DK, seed=2), rand(B, DK, seed=3)]
    q, k, v = rand(B, H, T, DK, seed=1), rand(B, H, T, DK, seed=2), rand(B, H, T, DV, seed=3)
    s0 = rand(B, H, DK, DV, seed=4)
    g = decays(B, H, T, DK, seed=5) if per_channel else decays(B, H, T, seed=5)
    if name == "decay_attention":
        return [q, k, v, g, s0]
    if name == "delta_rule":
        k = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
        beta = torch.rand(B, H, T, generator=torch.Generator().manual_seed(6), dtype=DT).requires_grad_()
        return [q, k, v, beta, g if gated else None, s0]
    a = (0.3 * rand(B, H, T, DK, seed=7, grad=False)).requires_grad_()
    b = (0.3 * rand(B, H, T, DK, seed=8, grad=False)).requires_grad_()
    return [q, k, v, a, b, g, s0]


def call(name, *xs, **kw):
    *tensors, s0 = xs
    return getattr(qt, name)(*tensors, initial_state=s0, **kw)


CASES = {
    "decay_head": ("decay_attention", dict()),
    "decay_channel": ("decay_attention", dict(per_channel=True)),
    "delta_gated": ("delta_rule", dict()),
    "delta_ungated": ("delta_rule", dict(gated=False)),
    "dplr": ("dplr", dict(per_channel=True)),
    "scan": ("linear_scan", dict()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradcheck_through_output_and_final_state(case):
    name, kw = CASES[case]
    xs = inputs(name, **kw)
    grad_in = [x for x in xs if x is not None]

    def both(*given):
        it = iter(given)
        full = [None if x is None else next(it) for x in xs]
        out, state = call(name, *full, return_state=True)
        return out, state

    assert torch.autograd.gradcheck(both, grad_in)


@pytest.mark.parametrize("case", ["decay_head", "delta_gated", "dplr", "scan"])
def test_gradcheck_only_the_state_or_only_the_output(case):
    name, kw = CASES[case]
    xs = [x for x in inputs(name, **kw)]
    assert torch.autograd.gradcheck(lambda *xs: call(name, *xs, return_state=True)[1], xs)
    *rest, _ = xs   # no initial state: zeros, its gradient slot None
    assert torch.autograd.gradcheck(lambda *xs: call(name, *xs, None), rest)


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v, beta, g, s0 = (x.detach() for x in inputs("delta_rule"))
    s0.requires_grad_()
    out = qt.delta_rule(q, k, v, beta, g, initial_state=s0)
    assert out.requires_grad
    out.sum().backward()
    assert s0.grad is not None and s0.grad.shape == s0.shape
    assert all(x.grad is None for x in (q, k, v, beta, g))
    with torch.no_grad():
        assert not qt.delta_rule(q, k, v, beta, g, initial_state=s0).requires_grad


ORACLE = {"decay_attention": (decay_naive.decay_forward, decay_naive.decay_backward), "delta_rule": (delta_naive.delta_forward, delta_naive.delta_backward),
          "dplr": (dplr_naive.dplr_forward, dplr_naive.dplr_backward), "linear_scan": (scan_naive.scan_forward, scan_naive.scan_backward)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_equals_the_step_oracle(case):
    name, kw = CASES[case]
    xs = inputs(name, **kw)
    out, state = call(name, *xs, scale=0.7, return_state=True) if name != "linear_scan" else \
        call(name, *xs, return_state=True)
    dout, dstate = rand(*out.shape, seed=11, grad=False), rand(*state.shape, seed=12, grad=False)
    ((out * dout).sum() + (state * dstate).sum()).backward()
    forward, backward = ORACLE[name]
    *arrays, s0 = [None if x is None else x.detach().numpy() for x in xs]
    opts = {} if name == "linear_scan" else dict(scale=0.7)
    o_ref, s_ref = forward(*arrays, initial_state=s0, **opts)
    grads = backward(dout.numpy(), dstate.numpy(), *arrays, initial_state=s0, **opts)
    np.testing.assert_allclose(out.detach().numpy(), o_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(state.detach().numpy(), s_ref, rtol=0, atol=1e-12)
    for x, g in zip(xs, grads):
        if x is None:
            assert g is None
        else:
            np.testing.assert_allclose(x.grad.numpy(), g, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_opcheck_each_operator():
    for case in ("decay_head", "delta_ungated", "dplr", "scan"):
        name, kw = CASES[case]
        xs = [None if x is None else x.detach().float() for x in inputs(name, **kw)]
        r = ro.RECURRENCES[name]
        opts = (0.5, None) if r.options else ()
        fwd, bwd = ro.OPERATORS[name]
        with torch.no_grad():
            out, state = fwd(*xs, *opts)
        grad_xs = [None if x is None else x.clone().requires_grad_() for x in xs]
        calls = [(fwd, (*grad_xs, *opts)), (bwd, (torch.randn_like(out), None, *xs[:-1], None, *opts))]
        for op, args in calls:
            result = torch.library.opcheck(op, args)
            assert set(result.values()) == {"SUCCESS"}, (name, result)


def test_the_unrecorded_call_runs_the_kernel_with_the_same_bits():
    xs = [x.detach() for x in inputs("decay_attention")]
    plain = qt.decay_attention(*xs[:4], initial_state=xs[4], return_state=True)
    recorded = ro.OPERATORS["decay_attention"][0](*xs, None, None)
    for a, b in zip(plain, recorded):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_dtypes(dtype):
    q, k, v, g, s0 = (x.detach().to(dtype).requires_grad_() for x in inputs("decay_attention"))
    out, state = qt.decay_attention(q, k, v, g, initial_state=s0, return_state=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    (out.float().sum() + state.sum()).backward()
    assert all(x.grad.dtype == dtype for x in (q, k, v, g, s0))
    ref = qt.decay_attention(*(x.detach().float() for x in (q, k, v, g)), initial_state=s0.detach().float())
    torch.testing.assert_close(out.detach().float(), ref, rtol=0, atol=float(torch.finfo(dtype).eps) * 8)
    h, hT = qt.linear_scan(q[:, 0].detach(), g[:, 0, :, None].detach().expand(-1, -1, DK), return_state=True)
    assert h.dtype == dtype and hT.dtype == torch.float32       # the compute dtype, as the other ops' states


@pytest.mark.parametrize("change, error, message", [
    (dict(q=torch.zeros(B, H, T, DK, device="meta")), qkv.ShapeError, "q must be a CPU tensor"),
    (dict(k=np.zeros((B, H, T, DK))), qkv.ShapeError, "k must be a torch.Tensor"),
    (dict(log_decay=torch.full((B, H, T), 0.5)), qkv.ShapeError, "log_decay must be finite and <= 0"),
    (dict(v=torch.zeros(B, H, T + 1, DV)), qkv.ShapeError, "v must have shape"),
    (dict(initial_state=torch.zeros(B, H, DV, DK)), qkv.ShapeError, "initial_state must have shape"),
    (dict(scale="big"), qkv.OptionError, "scale must be a finite real"),
    (dict(chunk_size=0), qkv.OptionError, "chunk_size must be an int >= 1"),
    (dict(return_state=1), qkv.OptionError, "return_state must be True or False"),
    (dict(causal=True), qkv.OptionError, "unknown keyword argument causal="),
])
@pytest.mark.parametrize("grad", [False, True], ids=["plain", "operator"])
def test_bad_input_raises_the_cores_error(change, error, message, grad):
    args = dict(q=torch.zeros(B, H, T, DK, requires_grad=grad), k=torch.zeros(B, H, T, DK), v=torch.zeros(B, H, T, DV),
                log_decay=torch.zeros(B, H, T))
    args.update(change)
    with pytest.raises(error, match=message):
        qt.decay_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("log_decay"), **args)


def test_scan_errors_name_the_scan_arguments():
    with pytest.raises(qkv.ShapeError, match="log_a must have x's shape"):
        qt.linear_scan(torch.zeros(1, 3, 2), torch.zeros(1, 3, 3))
    with pytest.raises(qkv.ShapeError, match="initial_state must be a torch.Tensor"):
        qt.linear_scan(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), initial_state=[0.0, 0.0])


@pytest.mark.slow
def test_torch_compile_fullgraph_equals_eager():
    q, k, v, g, s0 = (x.detach().float() for x in inputs("decay_attention"))

    def loss(q, k, v, g, s0):
        out, state = qt.decay_attention(q, k, v, g, initial_state=s0, return_state=True, scale=1.0)
        h = qt.linear_scan(out[:, 0], g[:, 0, :, None].expand(-1, -1, DV))
        return (out ** 2).sum() + state.sum() + h.sum()

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
        value = fn(*xs)
        value.backward()
        return [value.detach()] + [x.grad for x in xs]

    graphs = []

    def backend(gm, example_inputs):  # records the graph dynamo traced, then runs it eagerly
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    for a, b in zip(grads(loss), grads(compiled)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("decay_attention_fwd" in t for t in targets) == 1   # one node each
    assert sum("linear_scan_fwd" in t for t in targets) == 1


def test_values_of_mixed_dtypes_are_refused_as_torch_refuses_them():
    """bfloat16 q beside float32 k and v: torch's products and scaled_dot_product_attention refuse
    the mix, and so does each recurrence (it promoted to float32 silently); the gates may be
    wider, as transformers' models pass a float32 log decay beside bfloat16 values."""
    import qkv.torch as qt
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(qkv.ShapeError, match=r"k must have q's dtype torch.bfloat16 .*got torch.float32"):
        qt.decay_attention(q, k, v, -torch.rand(1, 2, 4))
    with pytest.raises(qkv.ShapeError, match=r"v must have q's dtype"):
        qt.delta_rule(q, k.bfloat16(), v, torch.rand(1, 2, 4))
    out = qt.delta_rule(q, k.bfloat16(), v.bfloat16(), torch.rand(1, 2, 4), -torch.rand(1, 2, 4))
    assert out.dtype == torch.bfloat16
