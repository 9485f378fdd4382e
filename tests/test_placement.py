"""Devices and number formats (``--device --dtype --quantize --compile``) on a tiny random
Llama: the flags' errors, bfloat16 batch invariance (speculative greedy output equals the
same engine's plain decoding, bit for bit), int8's error bound, the compiled step, and a
guard that no tensor of a step is created off the runtime's device. CUDA-marked tests run
only where a GPU is visible (``bench/gpu_smoke.sh``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import decoy_tree
from test_verifier_engine import hf_greedy, noisy_oracle
from transformers import AutoModelForCausalLM

from bench.verifier_cost import random_tree
from services.verifier.engine import EngineConfig
from services.verifier.executor import ForwardArgs
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer import int8, layers, linears, native
from specinfer.placement import Placement, PlacementError, resolve
from specinfer.tree import TokenTree, TreeBatch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def engine_in(model_dir: str, placement: Placement, **config):
    cfg = dict(max_context=128, slots=4, max_tree_nodes=24) | config
    return build_engine(model_dir, EngineConfig(**cfg), placement=placement)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 17, 9, 30)]


# --- flags ------------------------------------------------------------------------------

def test_auto_is_float32_on_the_cpu_and_bad_flags_name_themselves():
    if not torch.cuda.is_available():
        assert resolve() == Placement()  # the token-identical default
    assert resolve("cpu", "auto", "int8").dtype == torch.bfloat16
    for kwargs, flag in [({"device": "tpu"}, "--device"), ({"dtype": "fp8"}, "--dtype"),
                         ({"quantize": "int4"}, "--quantize"),
                         ({"device": "cpu", "dtype": "float16", "quantize": "int8"},
                          "--quantize"), ({"compile": "maybe"}, "--compile")]:
        with pytest.raises(PlacementError, match=flag):
            resolve(**kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(PlacementError, match="no CUDA GPU"):
            resolve("cuda")


def test_info_reports_the_format(tiny_llama):
    assert engine_in(tiny_llama, resolve("cpu", "bfloat16")).info()["dtype"] == "bfloat16"
    info = engine_in(tiny_llama, resolve("cpu", quantize="int8")).info()
    assert info["dtype"] == "int8-bfloat16" and info["device"] == "cpu"


# --- exactness per format ---------------------------------------------------------------

def test_float32_greedy_equals_transformers(tiny_llama, hf_model):
    engine = engine_in(tiny_llama, resolve("cpu", "float32"))
    for prompt, res in zip(prompts(), generate_local(engine, prompts(), 30,
                                                      trees=noisy_oracle(hf_model, 1)),
                           strict=True):
        assert res.token_ids == hf_greedy(hf_model, prompt, 30)


@pytest.mark.parametrize("placement,kernels", [
    (resolve("cpu", "bfloat16"), "native"), (resolve("cpu", quantize="int8"), "native"),
    (resolve("cpu", "bfloat16"), "torch"), (resolve("cpu", quantize="int8"), "torch")],
    ids=["bfloat16", "int8", "bfloat16-torch-ops", "int8-torch-ops"])
def test_speculation_equals_its_own_plain_decoding(tiny_llama, hf_model, placement, kernels,
                                                    monkeypatch):
    """Batch-invariant kernels: a row's bits do not depend on the rows beside it, so trees,
    batches and single-token steps agree exactly (and speculation really accepted); with
    our native kernels, and with torch's operators where they cannot be built."""
    if kernels == "torch":
        monkeypatch.setattr(native, "_loaded", True)
        monkeypatch.setattr(native, "_ops", None)
        monkeypatch.setattr(linears, "_bf16_kernel", None)  # chosen again, without them
        monkeypatch.setattr(int8, "_chosen", {})
    engine = engine_in(tiny_llama, placement)
    assert (engine.executor.runtime._native is None) == (kernels == "torch")
    plain = [r.token_ids for r in generate_local(engine, prompts(), 40)]
    single = [generate_local(engine, [p], 40)[0].token_ids for p in prompts()]
    spec = generate_local(engine, prompts(), 40, trees=noisy_oracle(hf_model, 1))
    assert [r.token_ids for r in spec] == plain == single
    assert sum(len(r.token_ids) - 1 for r in spec) > 1.5 * sum(r.steps for r in spec)


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
    runs = []
    for portable in (False, True):
        ops.attention_portable(portable)
        try:
            runs.append(_native_attention_case(ops, head_dim, torch.Generator().manual_seed(1)))
        finally:
            ops.attention_portable(False)
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
    if int8.chosen(torch.bfloat16) != "amx" and placement.quantize == "int8" or \
            bf16_kernel == "onednn" and linears.bfloat16_plan().k_part:
        assert runtime._native_loop is None  # torch's int8 kernel, or cut reductions
        pytest.skip("this CPU's kernels are not ones the native loop calls")
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
    widths on and off its 16 lanes, within bfloat16's rounding of torch's norm."""
    if native.library() is None:
        pytest.skip("the native kernels could not be built")
    gen = torch.Generator().manual_seed(0)
    for width in (576, 100):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter((torch.rand(width, generator=gen) + 0.5)
                                           .to(torch.bfloat16))
        module.variance_epsilon = 1e-5
        norm = layers.Norm(module, native.library())
        x = (torch.randn(40, width, generator=gen) * 4).to(torch.bfloat16)
        full = norm(x)
        assert all(torch.equal(norm(x[i : i + 1]), full[i : i + 1]) for i in range(40))
        assert torch.equal(norm(x.view(5, 8, width)), full.view(5, 8, width))
        ref = F.rms_norm(x.float(), (width,), module.weight.float(), 1e-5)
        assert (full.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_int8_engine_decodes_close_to_float32(tiny_llama, hf_model):
    """Weight-only int8 is not exact; its greedy text follows float32's for a while."""
    engine = engine_in(tiny_llama, resolve("cpu", quantize="int8"))
    agree = []
    for prompt, res in zip(prompts(), generate_local(engine, prompts(), 16), strict=True):
        ref = hf_greedy(hf_model, prompt, 16)
        agree.append(next((i for i, (a, b) in enumerate(zip(res.token_ids, ref,
                                                             strict=True)) if a != b), 16))
    assert sum(agree) >= 0.5 * 16 * len(agree), agree


@pytest.mark.matrix  # --compile on is not the CPU's default (auto: eager); 22 s
def test_compiled_step_gives_the_eager_tokens(tmp_path):
    """On a one-layer model: dynamo unrolls the layer loop, so compile time grows with the
    layers (35 s for four here), and one layer exercises every op."""
    from conftest import save_tiny_llama

    one_layer = save_tiny_llama(tmp_path / "one-layer", layers=1)
    eager = engine_in(one_layer, resolve("cpu", compile="off"))
    compiled = engine_in(one_layer, resolve("cpu", compile="on"))
    assert compiled.executor.runtime._compiled is not None
    trees = noisy_oracle(AutoModelForCausalLM.from_pretrained(one_layer).eval(), 2)
    a = generate_local(eager, prompts(1)[:2], 12, trees=trees)
    b = generate_local(compiled, prompts(1)[:2], 12, trees=trees)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


# --- device placement -------------------------------------------------------------------

def step_inputs(vocab: int) -> list[ForwardArgs]:
    """A prefill chunk, a single decode row, and a batch of trees: host tensors, as the
    engine makes them."""
    gen = torch.Generator().manual_seed(0)
    chain = TreeBatch.build([TokenTree.chain(list(range(1, 20)))], [0], [0])
    trees = [decoy_tree([3, 4, 5], vocab, gen), decoy_tree([7, 8], vocab, gen)]
    batch = TreeBatch.build(trees, [1, 2], [20, 20])
    return [
        ForwardArgs(chain.tokens, chain.position_ids, torch.tensor([0]), torch.tensor([0]),
                    chain.visibility(20), last_only=True, features=True),
        ForwardArgs(torch.tensor([[5]]), torch.tensor([[20]]), torch.tensor([0]),
                    torch.tensor([20]), None),
        ForwardArgs(batch.tokens, batch.position_ids, torch.tensor([0, 1]), batch.prefix_lens,
                    batch.visibility(20 + batch.tokens.shape[1])),
    ]


def check_device(engine, device: torch.device) -> None:
    """Run steps with torch's default device set to ``meta``: a tensor the step creates
    without naming its device lands there and fails the step; everything it keeps must be
    on ``device``."""
    ex = engine.executor
    rt = ex.runtime
    assert rt.cache.k.device == device and rt.cache.v.device == device
    for args in step_inputs(rt.vocab_size):
        with torch.device("meta"):
            logits = ex.forward(args)
            ex.compact(0, [21, 22], [20, 21])
        assert logits.device == device and logits.dtype == torch.float32
        assert not logits.isnan().any()
        if args.features:
            assert ex.features.device == device


@pytest.mark.parametrize("placement", [resolve("cpu", "float32"), resolve("cpu", "bfloat16"),
                                       resolve("cpu", quantize="int8")],
                         ids=["float32", "bfloat16", "int8"])
def test_no_step_tensor_is_created_off_the_device(tiny_llama, placement):
    check_device(engine_in(tiny_llama, placement), torch.device("cpu"))


# --- CUDA ---------------------------------------------------------------------------------

@cuda
def test_cuda_placement_and_float32_exactness(tiny_llama, hf_model):
    engine = engine_in(tiny_llama, resolve("cuda", "float32", compile="off"))
    check_device(engine, torch.device("cuda", torch.cuda.current_device()))
    for prompt, res in zip(prompts(), generate_local(engine, prompts(), 30,
                                                      trees=noisy_oracle(hf_model, 1)),
                           strict=True):
        assert res.token_ids == hf_greedy(hf_model, prompt, 30)


@cuda
def test_cuda_bfloat16_graphs_match_eager(tiny_llama, hf_model):
    eager = engine_in(tiny_llama, resolve("cuda", "bfloat16", compile="off"))
    graphs = engine_in(tiny_llama, resolve("cuda", "bfloat16", compile="on"))
    trees = noisy_oracle(hf_model, 1)
    a = generate_local(eager, prompts(), 24, trees=trees)
    b = generate_local(graphs, prompts(), 24, trees=trees)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_graph_buckets_and_padding_give_the_eager_tokens(tiny_llama, hf_model):
    """The CUDA-graph path's bucketed shapes, scratch-slot padding and whole-slot masks,
    run uncaptured on the CPU: the same tokens as the eager step."""
    from specinfer.graphs import GraphedLayers, buckets

    assert buckets(9) == [1, 2, 4, 8, 9] and buckets(1) == [1]
    eager = engine_in(tiny_llama, resolve("cpu", "float32"))
    padded = engine_in(tiny_llama, resolve("cpu", "float32"))
    rt = padded.executor.runtime
    rt._graphs = GraphedLayers(rt, 25)
    trees = noisy_oracle(hf_model, 3)
    a = generate_local(eager, prompts(2)[:3], 16, trees=trees)
    b = generate_local(padded, prompts(2)[:3], 16, trees=trees)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    c = generate_local(padded, prompts(2)[:3], 16)
    assert [r.token_ids for r in c] == [r.token_ids for r in a]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_tensor_parallel_matches_one_gpu(tiny_llama):
    """TP 2 over NCCL, one process per GPU: the tokens of one GPU in float32."""
    pytest.importorskip("deepspeed")
    placement = resolve("cuda", "float32", compile="off")
    one = engine_in(tiny_llama, placement)
    two = build_engine(tiny_llama, EngineConfig(max_context=128, slots=4, max_tree_nodes=24),
                       tp=2, placement=placement)
    try:
        a = generate_local(one, prompts(), 16)
        b = generate_local(two, prompts(), 16)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    finally:
        two.executor.close()


@pytest.mark.processes
@pytest.mark.parametrize("fmt", [["--dtype", "bfloat16"],
                                 pytest.param(["--quantize", "int8"], marks=pytest.mark.matrix)],
                         ids=["bfloat16", "int8"])
def test_the_stack_in_other_formats_speculates_exactly(tiny_chat_llm, fmt):
    """`specinfer up` passes the format to every model process: through the router, greedy
    output with speculation (SSM trees, forced) equals it without, and responses report
    the format."""
    from servers import service

    from specinfer.client import Client

    with service("up", "--llm", tiny_chat_llm, "--ssm", f"{tiny_chat_llm}#layers=1",
                 "--http-port", "0", "--max-context", "256", "--datastore", "none",
                 "--draft-head", "none", "--speculation", "always", *fmt) as (addr, _), \
            Client(addr) as c:
        for prompt in ("The quick brown fox", "1, 2, 3, 4,"):
            off = c.generate(prompt, max_tokens=20, speculation=False)
            on = c.generate(prompt, max_tokens=20)
            assert on.token_ids == off.token_ids
            assert on.stats.speculative_steps > 0
            assert on.dtype == ("bfloat16" if "bfloat16" in fmt else "int8-bfloat16")


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
