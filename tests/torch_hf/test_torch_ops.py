"""qkv.torch.attention: the custom operators against PyTorch SDPA in float64, gradcheck,
opcheck, torch.compile, dtypes, zero-copy and errors."""
import inspect

import numpy as np
import pytest

import qkv

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
F = torch.nn.functional
qt = pytest.importorskip("qkv.torch")
from qkv.torch import ops, options  # noqa: E402

DT = torch.float64


def rand(*shape, grad=True, dtype=DT, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 2**31)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def fwd_bwd(fn, q, k, v, seed=0):
    """out and the three gradients of sum(out * w) for a fixed random w."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


CASES = {
    # name: (Hq, Hkv, Tq, Tk, qkv options, SDPA options)
    "mask": (4, 4, 7, 9, "mask", "mask"),
    "causal": (4, 4, 9, 9, dict(causal=True), dict(is_causal=True)),
    "causal_tq_ne_tk": (4, 4, 5, 9, dict(causal=True), dict(is_causal=True)),
    "scale": (4, 4, 7, 9, dict(scale=0.3), dict(scale=0.3)),
    "gqa": (6, 2, 7, 9, dict(gqa=True, causal=True), dict(enable_gqa=True, is_causal=True)),
    "mqa": (4, 1, 9, 5, dict(gqa=True, scale=0.7), dict(enable_gqa=True, scale=0.7)),
    "mask_gqa_tq_ne_tk": (4, 2, 3, 11, "mask_gqa", "mask_gqa"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_forward_and_gradients_equal_sdpa(case):
    hq, hkv, tq, tk, qo, so = CASES[case]
    q, k, v = rand(2, hq, tq, 8), rand(2, hkv, tk, 8), rand(2, hkv, tk, 5)
    if isinstance(qo, str):
        mask = torch.rand(2, 1, tq, tk, generator=torch.Generator().manual_seed(1)) < 0.7
        mask[..., 0] = True  # SDPA gives NaN on a row with no key; qkv gives 0 (tested below)
        qo, so = dict(mask=mask, gqa=hq != hkv), dict(attn_mask=mask, enable_gqa=hq != hkv)
    ours = fwd_bwd(lambda q, k, v: qt.attention(q, k, v, **qo), q, k, v)
    theirs = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **so), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert a.shape == b.shape and a.dtype == DT, name
        assert (a - b).abs().max().item() <= 1e-9, name


GRADCHECK = {
    "window": dict(window=(2, 1)),
    "bottom_right": dict(causal="bottom_right"),
    "window_bottom_right_gqa": dict(window=3, causal="bottom_right", gqa=True),
    "kv_lengths": dict(kv_lengths=torch.tensor([9, 3])),
    "alibi": dict(alibi=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=DT), gqa=True),
    "flash_everything": dict(causal="bottom_right", window=(4, 0), kv_lengths=torch.tensor([7, 9]),
                             alibi=torch.tensor([0.5, 0.25, 0.1, 0.2], dtype=DT), gqa=True, method="flash"),
    "align_ragged_chunk": dict(causal=True, align="bottom_right", chunk=4, kv_lengths=torch.tensor([6, 9]),
                               q_lengths=torch.tensor([3, 4]), alibi=torch.rand(2, 4, dtype=DT), gqa=True),
    "window_right_bottom_right": dict(window=(1, 2), align="bottom_right", method="flash"),
}


@pytest.mark.parametrize("case", sorted(GRADCHECK))
def test_gradcheck(case):
    q, k, v = rand(2, 4, 4, 3), rand(2, 2, 9, 3), rand(2, 2, 9, 2)
    opts = GRADCHECK[case]
    if not opts.get("gqa"):
        q, k, v = rand(2, 2, 4, 3), rand(2, 2, 9, 3), rand(2, 2, 9, 2)
    assert torch.autograd.gradcheck(lambda q, k, v: qt.attention(q, k, v, **opts), (q, k, v))


def test_gradcheck_through_lse():
    # lse in the loss: its gradient rides on one more value column (see qkv.torch.ops)
    q, k, v = rand(2, 4, 4, 3), rand(2, 2, 6, 3), rand(2, 2, 6, 2)
    fn = lambda q, k, v: qt.attention(q, k, v, gqa=True, causal="bottom_right", return_lse=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.slow
def test_opcheck_both_operators():
    q, k, v = rand(2, 4, 5, 8, dtype=torch.float32), rand(2, 2, 7, 8, dtype=torch.float32), rand(2, 2, 7, 3, dtype=torch.float32)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.7
    args = options.encode(dict(mask=mask, causal="bottom_right", gqa=True))
    q_view = rand(2, 4, 8, 5, dtype=torch.float32).transpose(-1, -2)  # non-contiguous, requires grad
    empty = options.encode(dict(gqa=True, kv_lengths=torch.zeros(0, dtype=torch.int64)))
    with torch.no_grad():
        out, lse, _ = ops.fwd(q, k, v, *args, True)
    dout = torch.randn_like(out).transpose(-1, -2).contiguous().transpose(-1, -2)  # a strided dout
    calls = [
        (ops.fwd, (q, k, v, *args, True)),
        (ops.fwd, (q_view, k, v, *args, False)),
        (ops.fwd, (torch.zeros(0, 4, 5, 8, requires_grad=True), torch.zeros(0, 2, 7, 8), torch.zeros(0, 2, 7, 3),
                   *empty, False)),
        (ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, None, *args)),
        (ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), *args)),
        (ops.bwd, (torch.zeros(0, 4, 5, 3), torch.zeros(0, 4, 5, 8), torch.zeros(0, 2, 7, 8), torch.zeros(0, 2, 7, 3),
                   torch.zeros(0, 4, 5, 3), torch.zeros(0, 4, 5), None, *empty)),
        (ops.weights, (q.detach(), k.detach(), v.detach(), *args)),
        (ops.bwd_bias, (dout, q.detach(), k.detach(), v.detach(), out, lse, None,
                        *options.encode(dict(bias=torch.randn(4, 1, 7), causal=True, gqa=True)))),
    ]
    for op, call in calls:
        result = torch.library.opcheck(op, call)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.slow
def test_torch_compile_fullgraph_equals_eager():
    q, k, v = rand(2, 4, 6, 8, dtype=torch.float32), rand(2, 2, 9, 8, dtype=torch.float32), rand(2, 2, 9, 8, dtype=torch.float32)

    def loss(q, k, v):
        out, lse = qt.attention(q, k, v, gqa=True, causal="bottom_right", window=4, return_lse=True)
        return (out ** 2).sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    eager = fwd_bwd(lambda q, k, v: loss(q, k, v).reshape(1), q, k, v)
    comp = fwd_bwd(lambda q, k, v: compiled(q, k, v).reshape(1), q, k, v)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_computes_in_float32(dtype):
    q, k, v = rand(1, 2, 6, 8, dtype=dtype), rand(1, 2, 6, 8, dtype=dtype), rand(1, 2, 6, 8, dtype=dtype)
    out, lse = qt.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad.dtype == dtype and k.grad.dtype == dtype and v.grad.dtype == dtype
    # the float32 result of the same (rounded) inputs, cast once at the end
    ref = qt.attention(q.detach().float(), k.detach().float(), v.detach().float(), causal=True).to(dtype)
    assert torch.equal(out.detach(), ref)


def test_inputs_reach_numpy_without_a_copy(monkeypatch):
    seen = {}
    real = ops.np_attention

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, **kw)

    monkeypatch.setattr(ops, "np_attention", spy)
    q = torch.randn(2, 3, 5, 4)
    k = torch.randn(2, 3, 4, 5).transpose(-1, -2)  # strided: a view, still no copy
    v = torch.randn(2, 3, 5, 4)
    qt.attention(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert seen[name].__array_interface__["data"][0] == t.data_ptr(), name
    arr = np.arange(6.0).reshape(2, 3)
    assert options.from_numpy(arr).data_ptr() == arr.__array_interface__["data"][0]


def test_a_row_with_no_key_gives_zero_output_and_gradient():
    q, k, v = rand(1, 1, 3, 4), rand(1, 1, 5, 4), rand(1, 1, 5, 4)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    out, lse = qt.attention(q, k, v, mask=mask, return_lse=True)
    out.sum().backward()
    assert torch.all(out[0, 0, 1] == 0) and lse[0, 0, 1] == -torch.inf
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0, 0, 1] == 0)


def test_weights_match_qkv_and_arrays_are_accepted_as_options():
    q, k, v = rand(2, 4, 5, 6), rand(2, 2, 7, 6), rand(2, 2, 7, 6)
    lengths = np.array([7, 4])  # a NumPy array where a tensor is expected
    out, w = qt.attention(q, k, v, gqa=True, kv_lengths=lengths, return_weights=True)
    ref_out, ref_w = qkv.attention(*(x.detach().numpy() for x in (q, k, v)), gqa=True, kv_lengths=lengths,
                                   return_weights=True)
    np.testing.assert_allclose(out.detach().numpy(), ref_out, atol=1e-12)
    np.testing.assert_allclose(w.numpy(), ref_w, atol=1e-12)
    assert not w.requires_grad


def test_every_option_of_qkv_attention_is_forwarded():
    # a new keyword of qkv.attention needs one row in qkv.torch.options.OPTIONS
    assert set(options.NAMES) == set(options.accepted())
    params = inspect.signature(qt.attention).parameters
    assert {"return_lse", "return_weights"} <= set(params)


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.zeros(1, 2, 3, 4, device="meta")), "q must be a CPU tensor"),
    (dict(mask=torch.ones(3, 3, dtype=torch.bool, device="meta")), "mask must be a CPU tensor"),
    (dict(q=np.zeros((3, 4))), "q must be a torch.Tensor"),
    (dict(v=torch.zeros(1, 2, 3, 4, dtype=torch.float64)), "v must have q's dtype"),
    (dict(q=torch.zeros(1, 2, 3, 4, dtype=torch.int64)), "q must be a float16, bfloat16"),
    (dict(causal="sideways"), "causal must be"),
    (dict(window=(1, 2, 3)), "window must be"),
    (dict(scale="big"), "scale must be a finite real"),
    (dict(gqa=1), "gqa must be True or False"),
    (dict(method="fast"), "method must be .auto. or a registered kernel"),
    (dict(flavour=1), "unknown keyword argument flavour="),
    (dict(alibi=torch.ones(2, requires_grad=True)), "alibi must not require grad"),
    (dict(k=torch.zeros(1, 2, 3, 5)), "k must have the feature size D of q"),
    (dict(kv_lengths=torch.tensor([9])), "kv_lengths must lie in"),
])
def test_bad_inputs_raise_shape_error_naming_them(bad, message):
    args = dict(q=torch.zeros(1, 2, 3, 4), k=torch.zeros(1, 2, 3, 4), v=torch.zeros(1, 2, 3, 4))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(qkv.ShapeError, match=message):
        qt.attention(q, k, v, **args)


@pytest.mark.parametrize("case", ["align_ragged_chunk", "window_right_bottom_right"])
def test_alignment_options_equal_qkv_on_arrays(case):
    opts = GRADCHECK[case]
    q, k, v = rand(2, 4, 4, 3, grad=False), rand(2, 2, 9, 3, grad=False), rand(2, 2, 9, 2, grad=False)
    if not opts.get("gqa"):
        q, k, v = rand(2, 2, 4, 3, grad=False), rand(2, 2, 9, 3, grad=False), rand(2, 2, 9, 2, grad=False)
    out = qt.attention(q, k, v, **opts)
    as_np = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in opts.items()}
    np.testing.assert_allclose(out.numpy(), qkv.attention(q.numpy(), k.numpy(), v.numpy(), **as_np), atol=1e-14)


@pytest.mark.parametrize("torch_threads, t, want", [(2, 64, 1), (2, 4096, None), (1, 64, None)])
def test_pooled_kernels_stay_on_the_calling_thread_while_torchs_threads_spin(monkeypatch, torch_threads, t, want):
    """Below ops.TORCH_SERIAL_WORK entries, with torch on more than one thread, the forward,
    backward and weights kernels that run on Python threads get one (torch's OpenMP workers
    spin on after its operators and hold the other cores); past it, or with torch on one
    thread, the caller's setting stands (None here: the process default). The compiled row
    kernel's threads (numba's) are never limited by it."""
    from qkv import threads

    seen = []

    def spy(real):
        def call(*a, **kw):
            seen.append((threads._pooled.get(), threads.get_num_threads(), threads.get_num_threads(compiled=True)))
            return real(*a, **kw)
        return call

    monkeypatch.setattr(ops, "np_attention", spy(ops.np_attention))
    monkeypatch.setattr(ops, "np_attention_backward", spy(ops.np_attention_backward))
    monkeypatch.setattr(ops, "TORCH_SERIAL_WORK", 2 * 4 * 64 * 64)
    before, qkv_before = torch.get_num_threads(), qkv.get_num_threads()
    torch.set_num_threads(torch_threads)
    qkv.set_num_threads(3)
    try:
        q, k, v = (torch.randn(1, 2, t, 8, requires_grad=True) for _ in range(3))
        out = qt.attention(q, k, v, causal=True)
        out.sum().backward()
        qt.attention(q.detach(), k.detach(), v.detach(), return_weights=True)
    finally:
        torch.set_num_threads(before)
        qkv.set_num_threads(qkv_before)
    pooled = 3 if want is None else want
    assert len(seen) >= 3 and set(seen) == {(want, pooled, 3)}, seen   # forward, backward, weights (and its out)


def test_the_compiled_row_kernel_keeps_its_threads_inside_torch(monkeypatch):
    """With torch on two threads, a problem under ops.TORCH_SERIAL_WORK still runs the compiled
    row kernel on numba's threads (two here), forward and backward; the bits are those of one
    thread."""
    from qkv.kernels.rows import kernel as rows
    if rows._fused() is None:
        pytest.skip("the compiled row kernel needs the fast extra (numba)")
    import numba

    seen = []   # numba's thread count as the kernel takes BLAS's hold, just before it runs
    real = qkv.threads.hold_blas
    monkeypatch.setattr(qkv.threads, "hold_blas", lambda: seen.append(numba.get_num_threads()) or real())
    before, qkv_before = torch.get_num_threads(), qkv.get_num_threads()
    torch.set_num_threads(2)
    qkv.set_num_threads(2)
    try:
        q, k, v = (torch.randn(4, 4, 128, 16, requires_grad=True) for _ in range(3))   # 2^18 entries
        assert rows.SERIAL_WORK <= 4 * 4 * 128 * 128 <= ops.TORCH_SERIAL_WORK
        out = qt.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        threaded = (out.detach().clone(), q.grad.clone())
        seen_threaded = list(seen)
        q.grad = None
        with qkv.threads.kernel_threads(1):
            out1 = qt.attention(q, k, v, causal=True)
            out1.backward(torch.ones_like(out1))
    finally:
        torch.set_num_threads(before)
        qkv.set_num_threads(qkv_before)
    assert seen_threaded == [min(2, numba.config.NUMBA_NUM_THREADS)] * 2, seen_threaded   # forward, backward
    assert seen[len(seen_threaded):] == [1, 1], seen
    assert torch.equal(threaded[0], out1.detach()) and torch.equal(threaded[1], q.grad)


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (1, 4, 5, 7), (5, 7), (4, 1, 7)], ids=str)
@pytest.mark.parametrize("method", ["reference", "flash", "auto"])
def test_a_bias_that_requires_grad_gets_eagers_gradient(shape, method):
    """A learned bias (T5's relative positions): its gradient is dS summed over its broadcast
    axes, equal to autograd through eager attention, on every kernel; gradcheck holds."""
    q, k, v = rand(2, 4, 5, 3), rand(2, 2, 7, 3), rand(2, 2, 7, 2)
    bias = rand(*shape, seed=3)
    opts = dict(gqa=True, causal="bottom_right", softcap=2.0, method=method)
    out = qt.attention(q, k, v, bias=bias, **opts)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    ours = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    kx, vx = (x.repeat_interleave(2, dim=1) for x in (k, v))
    s = 2.0 * torch.tanh(q @ kx.transpose(-1, -2) / 3 ** 0.5 / 2.0) + bias
    s = s.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(2), float("-inf"))
    theirs = torch.autograd.grad(((torch.softmax(s, -1) @ vx) * w).sum(), (q, k, v, bias))
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max().item() <= 1e-12
    if method == "auto":
        assert torch.autograd.gradcheck(lambda q, bias: qt.attention(q, k, v, bias=bias, **opts), (q, bias))


def test_weights_beside_a_learned_bias_carry_no_gradient():
    q, k, v = (rand(1, 2, 4, 3, seed=i) for i in range(3))
    bias = rand(2, 4, 4, seed=3)
    out, weights = qt.attention(q, k, v, bias=bias, return_weights=True)
    assert not weights.requires_grad
    out.sum().backward()
    assert bias.grad.shape == bias.shape


def test_a_learned_bias_in_low_precision_gets_its_own_dtype_and_compiles():
    q, k, v = (rand(1, 2, 6, 8, dtype=torch.float32) for _ in range(3))
    for dtype in (torch.bfloat16, torch.float32):
        bias = rand(2, 6, 6, dtype=dtype, seed=5)
        qt.attention(q, k, v, bias=bias, causal=True).sum().backward()
        assert bias.grad.dtype == dtype and bias.grad.abs().max() > 0
    bias = rand(2, 6, 6, dtype=torch.float32, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, b: qt.attention(q, k, v, bias=b, causal=True).sum(), fullgraph=True,
                             backend="aot_eager")
    want = torch.autograd.grad(qt.attention(q, k, v, bias=bias, causal=True).sum(), (q, bias))
    got = torch.autograd.grad(compiled(q, bias), (q, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_casts_q_k_v_as_it_casts_sdpas(dtype):
    q, k = rand(1, 2, 5, 8, dtype=torch.float32), rand(1, 2, 5, 8, dtype=torch.float32)
    v = rand(1, 2, 5, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=dtype):
        out = qt.attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == dtype
    torch.testing.assert_close(out, qt.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    with torch.autocast("cpu", dtype=dtype):  # float64 is not cast by autocast, nor here
        assert qt.attention(q64, k64, v64).dtype == torch.float64


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_fullgraph_dropout_without_a_seed_draws_eagers_mask(backend):
    """With dropout_p and no dropout_seed the seed is drawn inside the graph (qkv::draw_seed):
    fullgraph=True traces it, and one torch.manual_seed gives the same output and gradients
    compiled and eager (inductor's own random numbers would not); each call draws anew."""
    q, k, v = (rand(1, 2, 6, 4, dtype=torch.float32, seed=i) for i in range(3))

    def loss(q, k, v):
        return (qt.attention(q, k, v, causal=True, dropout_p=0.5) ** 2).sum()

    def run(fn, seed):
        torch.manual_seed(seed)
        value = fn(q, k, v)
        return [value.detach()] + list(torch.autograd.grad(value, (q, k, v)))

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    eager, comp = run(loss, 1), run(compiled, 1)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(run(compiled, 2)[0], comp[0])  # another seed, another mask
    torch.manual_seed(1)
    first, second = compiled(q, k, v), compiled(q, k, v)
    assert not torch.equal(first, second)  # two calls, two draws



FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("other", ["k", "v"])
@pytest.mark.parametrize("other_dtype", FLOAT_DTYPES)
def test_mixed_dtypes_are_refused_where_sdpa_refuses_them(q_dtype, other, other_dtype):
    """q with another dtype of k or v (bfloat16 q, float32 k): qkv.torch.attention accepts
    exactly what torch's scaled_dot_product_attention accepts on the CPU (one dtype) and
    refuses the rest by name and both dtypes, never promoting."""
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0)).to(q_dtype)
    args = dict(k=q, v=q)
    args[other] = args[other].to(other_dtype)
    sdpa_ok = True
    try:
        torch.nn.functional.scaled_dot_product_attention(q, args["k"], args["v"])
    except RuntimeError:
        sdpa_ok = False
    assert sdpa_ok == (other_dtype == q_dtype)
    if sdpa_ok:
        assert qt.attention(q, args["k"], args["v"]).dtype == q_dtype
    else:
        with pytest.raises(qkv.ShapeError, match=rf"{other} must have q's dtype {q_dtype}; got {other_dtype}"):
            qt.attention(q, args["k"], args["v"])
