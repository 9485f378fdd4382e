"""The CPU kernels of the batch-invariant formats (bfloat16, int8) on their own: each
row's bits whatever rows come with it (oneDNN's and our AMX linears, int8's kernels and their
probes), the native attention (a tree node's row equals plain decoding's, vector and
portable loops agree, close to float64), the native RMSNorm (and residual sum) and SiLU
gate, and the native decoder loop (the Python loop's bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_placement import engine_in

from bench.trees import random_tree
from services.verifier.executor import ForwardArgs
from specinfer import int8, layers, linears, native
from specinfer.placement import resolve
from specinfer.tree import TokenTree, TreeBatch


def bf16_kernel_is(monkeypatch, kernel: str | None) -> None:
    """Have ``linears.build`` use this bfloat16 kernel (None: the process's choice); skip
    where it is ours and this CPU cannot run it."""
    if kernel == "amx" and linears.bfloat16_kernel() != "amx":
        pytest.skip("this CPU has no AMX bfloat16 (or the kernels could not be built)")
    if kernel is not None:
        monkeypatch.setattr(linears, "_bf16_kernel", kernel)


@pytest.mark.parametrize("placement,bf16_kernel", [
    (resolve("cpu", "bfloat16"), "amx"), (resolve("cpu", "bfloat16"), "onednn"),
    (resolve("cpu", quantize="int8"), None)], ids=["bfloat16-amx", "bfloat16-onednn", "int8"])
def test_rows_do_not_depend_on_the_batch(placement, bf16_kernel, monkeypatch):
    """The kernels themselves, at reduction lengths on both sides of INVARIANT_K and at
    row counts on both sides of AMX_ROWS (oneDNN's AMX kernels block rows in 32s)."""
    bf16_kernel_is(monkeypatch, bf16_kernel)
    gen = torch.Generator().manual_seed(0)
    for k in (64, 1536, 2304):
        module = torch.nn.Linear(k, 96, bias=False)
        module.weight.data = torch.randn(96, k, generator=gen) * 0.05
        linear = linears.build([module], placement)
        x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
        full = linear(x)
        assert all(torch.equal(linear(x[i : i + 1]), full[i : i + 1]) for i in range(70))
        assert all(torch.equal(linear(x[:m]), full[:m]) for m in (17, 32, 33, 64))
        ref = x.float() @ module.weight.T
        assert (full.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def int8_linear(out: int, k: int, gen: torch.Generator, act: torch.dtype, bias: bool = True):
    module = torch.nn.Linear(k, out, bias=bias)
    module.weight.data = torch.randn(out, k, generator=gen) * 0.05
    return module, linears.build([module], resolve("cpu", str(act).removeprefix("torch."),
                                                   "int8"))


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("name", int8.KERNELS)
def test_int8_kernels_rows_do_not_depend_on_the_batch(monkeypatch, act, name):
    """Every int8 kernel, at shapes off its tiles (37 outputs, a 100-long reduction) and
    on them, at row counts across its 16-row tiles: a row's bits are its bits alone, and
    within the quantization error of the float product."""
    if name == "amx" and (int8._wanted() != "amx" or native.library() is None):
        pytest.skip("this CPU has no AMX (or the kernels could not be built)")
    monkeypatch.setenv("SPECINFER_INT8_KERNEL", name)
    monkeypatch.setattr(int8, "_chosen", {})
    gen = torch.Generator().manual_seed(0)
    for out, k in ((37, 100), (96, 576), (64, 1536)):
        module, linear = int8_linear(out, k, gen, act)
        assert int8.chosen(act) == name
        x = torch.randn(40, k, generator=gen)
        full = linear(x.to(act))
        assert all(torch.equal(linear(x[i : i + 1].to(act)), full[i : i + 1]) for i in range(40))
        assert all(torch.equal(linear(x[:m].to(act)), full[:m]) for m in (2, 15, 16, 17, 33))
        ref = module(x)
        assert (full.float() - ref).abs().max() <= 0.02 * ref.abs().max(), (out, k)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_amx_int8_kernel_gives_the_references_bits(act):
    """The AMX kernel against its torch._int_mm reference, bit for bit, on rows with a
    zero row, an outlier and tiny values (the fixed point's edges)."""
    if int8._wanted() != "amx" or native.library() is None:
        pytest.skip("this CPU has no AMX (or the kernels could not be built)")
    gen = torch.Generator().manual_seed(1)
    for out, k in ((37, 100), (960, 576), (64, 1600)):
        q, scale = int8.quantize(torch.randn(out, k, generator=gen) * 0.05)
        x = torch.randn(21, k, generator=gen)
        x[3] = 0
        x[5, 7] = 3e4
        x[8] *= 1e-30
        x = x.to(act)
        got = torch.ops.specinfer.int8_amx_linear(x, int8.amx_tiles(q), scale, out)
        assert torch.equal(got, int8.reference(x, q, scale)), (out, k)
        assert not got[3].any()


def test_int8_probe_keeps_torchs_kernel_where_ours_disagrees(monkeypatch):
    """A kernel whose rows change with the batch (stood in for by ours, perturbed by the
    row count) fails the probe; the process then runs torch's."""
    if int8._wanted() != "amx" or native.library() is None:
        pytest.skip("this CPU has no AMX (or the kernels could not be built)")
    real = int8._build

    def batch_dependent(name, *args):
        run = real(name, *args)
        return lambda x: run(x) if x.shape[0] == 1 else run(x) * (1 + 2 ** -6)

    monkeypatch.setattr(int8, "_build", batch_dependent)
    monkeypatch.setattr(int8, "_chosen", {})
    assert int8.chosen(torch.bfloat16) == "torch"


def test_amx_kernels_give_float32_logits_unrounded():
    """The vocabulary head's float32 output (``float32``: our AMX kernels skip the rounding
    to bfloat16): rounded, it is the bfloat16 output bit for bit; each row alone gives the
    batch's bits; and it keeps what bfloat16 rounds away (it is not all bfloat16 values)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 576, generator=gen) * 0.05
    bias = torch.randn(200, generator=gen)
    x = (torch.randn(17, 576, generator=gen) * 3).to(torch.bfloat16)
    kernels = []
    if int8._wanted() == "amx" and native.library() is not None:
        kernels.append(int8.AmxLinear(*int8.quantize(weight), None))  # a head has no bias
    if linears.bfloat16_kernel() == "amx":
        kernels.append(linears.AmxBf16Linear(weight, bias))
    if not kernels:
        pytest.skip("this CPU has no AMX (or the kernels could not be built)")
    for kernel in kernels:
        wide = kernel.float32(x)
        assert wide.dtype == torch.float32
        assert torch.equal(wide.to(torch.bfloat16), kernel(x).to(torch.bfloat16))
        assert all(torch.equal(kernel.float32(x[i : i + 1]), wide[i : i + 1]) for i in range(17))
        assert not torch.equal(wide, wide.to(torch.bfloat16).float())


def test_bf16_probe_keeps_onednn_where_ours_disagrees(monkeypatch):
    """Our bfloat16 AMX kernel, perturbed by the row count, fails the probe; the process
    then runs oneDNN's kernels."""
    bf16_kernel_is(monkeypatch, "amx")
    real = linears.AmxBf16Linear.__call__

    def batch_dependent(self, x):
        out = real(self, x)
        return out if x.shape[0] == 1 else out * (1 + 2 ** -6)

    monkeypatch.setattr(linears.AmxBf16Linear, "__call__", batch_dependent)
    monkeypatch.setattr(linears, "_bf16_kernel", None)
    assert linears.bfloat16_kernel() == "onednn"


def with_portable_loops(run, *args):
    """``run(*args)`` with the native operators' vector loops, then with their portable
    loops (``portable_loops``, the operators' test switch): both results."""
    ops = native.library()
    results = []
    for portable in (False, True):
        ops.portable_loops(portable)
        try:
            results.append(run(*args))
        finally:
            ops.portable_loops(False)
    return results


def _native_attention_case(ops, head_dim: int, gen: torch.Generator):
    """One tree of 12 nodes after a 40-key prefix through the native attention in one
    call, and each node again as plain decoding computes it (its ancestors written one by
    one at consecutive positions of another slot, then the node alone): both outputs per
    node, and the float64 reference of the tree call's."""
    hq, hkv, prefix, ctx = 6, 2, 40, 64
    tree = random_tree(12, 100, gen)
    batch = TreeBatch.build([tree], [1], [prefix])
    n = batch.tokens.shape[1]
    # float32 projections: the output is not rounded to bfloat16, so no difference hides
    heads = torch.randn(1, n, hq + 2 * hkv, head_dim, generator=gen) * 2
    freqs = batch.position_ids[..., None].float() / (100 ** (torch.arange(head_dim) / head_dim))
    cos, sin = freqs.cos()[:, :, None], layers.signed(freqs.sin())[:, :, None]
    cache_k = torch.zeros(2, ctx, hkv, head_dim)
    cache_v = torch.zeros(2, ctx, hkv, head_dim)
    cache_k[0, :prefix] = torch.randn(prefix, hkv, head_dim, generator=gen)
    cache_v[0, :prefix] = torch.randn(prefix, hkv, head_dim, generator=gen)
    cache_k[1], cache_v[1] = cache_k[0], cache_v[0]
    visible = batch.visibility(prefix + n)
    at = torch.arange(prefix, prefix + n)[None]
    tree_out = ops.attention(heads, cos, sin, cache_k, cache_v, torch.zeros(1, n, dtype=torch.long),
                             at, torch.tensor([0]), prefix + n, visible, hq)
    keys, values = cache_k[0, :prefix + n].double(), cache_v[0, :prefix + n].double()
    x = heads.double()[0, :, :hq]
    q = x * cos[0].double() + torch.roll(x, head_dim // 2, -1) * sin[0].double()
    scores = torch.einsum("nhd,khd->nhk", q, keys.repeat_interleave(hq // hkv, 1)) \
        / head_dim ** 0.5
    scores = scores.masked_fill(~visible[0][:, None, :], float("-inf"))
    reference = torch.einsum("nhk,khd->nhd", scores.softmax(-1),
                             values.repeat_interleave(hq // hkv, 1)).reshape(n, -1)
    plain_out = []
    for node in range(n):
        path = [i for i in range(n) if batch.ancestors[0, node, i]]  # root .. node
        for depth, i in enumerate(path):
            pos = torch.tensor([[prefix + depth]])
            out = ops.attention(heads[:, i : i + 1], cos[:, i : i + 1], sin[:, i : i + 1],
                                cache_k, cache_v, torch.tensor([[1]]), pos, torch.tensor([1]),
                                prefix + depth + 1, None, hq)
        plain_out.append(out[0, 0])
    return tree_out[0], torch.stack(plain_out), reference


@pytest.mark.parametrize("head_dim", [64, 48])  # 64: AVX-512 where the CPU has it
def test_native_attention_rows_stand_alone_and_stay_close(head_dim):
    """The batch-invariant formats' native attention: a tree node's output is, bit for bit,
    what plain decoding computes for it (same keys, other cache positions, other batch),
    the vector and portable loops agree bit for bit, and both stay within float32's
    rounding of float64 attention."""
    ops = native.library()
    if ops is None:
        pytest.skip("the native kernels could not be built")
    runs = with_portable_loops(lambda: _native_attention_case(
        ops, head_dim, torch.Generator().manual_seed(1)))
    (tree_out, plain_out, reference), portable_run = runs
    assert torch.equal(tree_out, plain_out)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], portable_run, strict=True))
    error = (tree_out.double() - reference).abs().max() / reference.abs().max()
    assert float(error) <= 1e-5, float(error)


@pytest.mark.parametrize("placement,bf16_kernel", [
    (resolve("cpu", "bfloat16"), "amx"), (resolve("cpu", "bfloat16"), "onednn"),
    (resolve("cpu", quantize="int8"), None)], ids=["bfloat16-amx", "bfloat16-onednn", "int8"])
def test_native_decoder_loop_gives_the_python_loops_bits(tiny_llama, placement, bf16_kernel,
                                                          monkeypatch):
    """The layers in one native call: the same logits and KV cache as the runtime's Python
    loop over the same operators, bit for bit, for a plain row, a tree, two trees of
    different lengths in one batch (packed), and a plain row beside a tree in one pass;
    with each kind of linear the loop calls."""
    if native.library() is None:
        pytest.skip("the native kernels could not be built")
    bf16_kernel_is(monkeypatch, bf16_kernel)
    engine = engine_in(tiny_llama, placement)
    runtime, executor = engine.executor.runtime, engine.executor
    if int8.chosen(torch.bfloat16) != "amx" and placement.quantize == "int8":
        assert runtime._native_loop is None  # torch's int8 kernel
        pytest.skip("this CPU's int8 kernel is not one the native loop calls")
    # (oneDNN's reductions cut at bfloat16_plan's k_part, on CPUs without AMX, leave this
    # model's 64- and 128-long ones whole: one packed call each, which the loop runs.)
    gen = torch.Generator().manual_seed(0)
    trees = [TokenTree()] + [random_tree(n, 128, gen) for n in (15, 6)]

    def forwards():
        runtime.cache.k.zero_()
        runtime.cache.v.zero_()
        outs = []
        for batch, slots, prefix in (([trees[0]], [0], [9]), ([trees[1]], [0], [10]),
                                     ([trees[1], trees[2]], [1, 2], [12, 5])):
            tb = TreeBatch.build(batch, [3] * len(batch), prefix)
            visible = None if tb.tokens.shape[1] == 1 else \
                tb.visibility(max(prefix) + tb.tokens.shape[1])
            outs.append(executor.forward(ForwardArgs(
                tb.tokens, tb.position_ids, torch.tensor(slots), tb.prefix_lens, visible)))
        parts = []
        for tree, slot, prefix in ((trees[0], 3, 7), (trees[2], 0, 30)):
            tb = TreeBatch.build([tree], [5], [prefix])
            visible = tb.visibility(prefix + tb.tokens.shape[1])
            parts.append((runtime.embed(tb.tokens), tb.position_ids, torch.tensor([slot]),
                          tb.prefix_lens, visible, visible.shape[-1], None))
        outs += runtime.segments_forward(parts)
        return outs, runtime.cache.k.clone(), runtime.cache.v.clone()

    assert runtime._native_loop is not None
    native_run = forwards()
    runtime._native_loop = None
    python_run = forwards()
    assert all(torch.equal(a, b) for a, b in zip(native_run[0], python_run[0], strict=True))
    assert torch.equal(native_run[1], python_run[1]) and torch.equal(native_run[2], python_run[2])


def test_native_rms_norm_rows_stand_alone_and_stay_close_to_torchs():
    """The bfloat16 formats' native RMSNorm: a row's bits whatever rows come with it, at
    widths on and off its 16 lanes, within bfloat16's rounding of torch's norm; the fused
    residual sum + norm gives torch's bfloat16 add and the norm's bits; AVX-512 and the
    portable loops agree bit for bit."""
    ops = native.library()
    if ops is None:
        pytest.skip("the native kernels could not be built")
    gen = torch.Generator().manual_seed(0)
    for width in (576, 100):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter((torch.rand(width, generator=gen) + 0.5)
                                           .to(torch.bfloat16))
        module.variance_epsilon = 1e-5
        norm = layers.Norm(module, ops)
        x = (torch.randn(40, width, generator=gen) * 4).to(torch.bfloat16)
        full = norm(x)
        assert all(torch.equal(norm(x[i : i + 1]), full[i : i + 1]) for i in range(40))
        assert torch.equal(norm(x.view(5, 8, width)), full.view(5, 8, width))
        ref = F.rms_norm(x.float(), (width,), module.weight.float(), 1e-5)
        assert (full.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
        delta = (torch.randn(40, width, generator=gen) * 2).to(torch.bfloat16)
        vector, portable = with_portable_loops(lambda n, a, b: (n(a), *ops.add_rms_norm(
            a, b, n.native_weight, 1e-5)), norm, x, delta)
        assert all(torch.equal(a, b) for a, b in zip(vector, portable, strict=True))
        assert torch.equal(vector[1], x + delta) and torch.equal(vector[2], norm(x + delta))


def test_native_silu_mul_rows_stand_alone_and_stay_close():
    """The batch-invariant formats' SiLU(gate) * up: each element on its own (a row alone
    or in a batch, the same bits), AVX-512 and the portable loop bit for bit, within
    bfloat16's rounding of float64's (and float32's within 1e-6), at widths on and off the
    16 lanes, across the exp's range (large negative gates included)."""
    ops = native.library()
    if ops is None:
        pytest.skip("the native kernels could not be built")
    gen = torch.Generator().manual_seed(0)
    for width, dtype in ((1536, torch.bfloat16), (100, torch.bfloat16), (40, torch.float32)):
        gate_up = torch.randn(24, 2 * width, generator=gen) * 6
        gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, -200.0, 1e-30, -1e-30, 3.0])
        gate_up = gate_up.to(dtype)
        vector, portable = with_portable_loops(ops.silu_mul, gate_up)
        assert torch.equal(vector, portable)
        assert all(torch.equal(ops.silu_mul(gate_up[i : i + 1]), vector[i : i + 1])
                   for i in range(24))
        gate, up = gate_up.double().chunk(2, -1)
        want = F.silu(gate) * up
        tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        assert ((vector.double() - want).abs() <= tol * want.abs() + 1e-30).all()


def test_bfloat16_rows_run_alone_where_no_batching_rule_holds(monkeypatch):
    """On a CPU whose kernels give a row other bits in a batch than alone under both rules
    (AMX's 32-row pieces, AVX-512's 1024-long reductions), the probe falls back to one row
    per call: slow, still exact. Stands in for such a CPU: oneDNN's op, perturbed by the
    row count."""
    real = torch.ops.mkldnn._linear_pointwise

    def batch_dependent(x, *args):
        out = real(x, *args)
        return out if x.shape[0] == 1 else out * (1 + 2 ** -6)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", batch_dependent)
    monkeypatch.setattr(linears, "_plan", None)
    bf16_kernel_is(monkeypatch, "onednn")
    assert linears.bfloat16_plan() == linears.Plan(0, 1)
    module = torch.nn.Linear(1536, 64, bias=False)
    linear = linears.build([module], resolve("cpu", "bfloat16"))
    x = torch.randn(9, 1536).to(torch.bfloat16)
    full = linear(x)
    assert all(torch.equal(linear(x[i : i + 1]), full[i : i + 1]) for i in range(9))
