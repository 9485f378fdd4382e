"""Devices and number formats (``--device --dtype --quantize --compile``) on a tiny random
Llama: the flags' errors, bfloat16 batch invariance (speculative greedy output equals the
same engine's plain decoding, bit for bit), int8's error bound, the compiled step, and a
guard that no tensor of a step is created off the runtime's device (the kernels themselves:
``test_kernels.py``). CUDA-marked tests run
only where a GPU is visible (``bench/gpu_smoke.sh``)."""

from __future__ import annotations

import pytest
import torch
from test_verifier_engine import hf_greedy, noisy_oracle
from transformers import AutoModelForCausalLM

from bench.trees import decoy_tree
from services.verifier.engine import EngineConfig
from services.verifier.executor import ForwardArgs
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer import int8, linears, native
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

def run_gpu_code_on_the_cpu(monkeypatch) -> None:
    """From here on, the runtime's CUDA branch (the modules' own weights moved in place,
    torch's operators and SDPA in the placement's dtype, no native kernels, no batch
    invariance) runs on the CPU: what a GPU runs, but the kernels and graphs."""
    monkeypatch.setattr(Placement, "cuda", property(lambda self: True))


def test_the_gpu_code_path_computes_the_cpu_paths_logits(tiny_llama, hf_model, monkeypatch):
    """Prefill, a plain row and trees (masks, positions, KV writes) through the GPU's
    code: the CPU path's float32 logits within float32 rounding; and speculative greedy
    decoding there (KV compaction after every step) gives transformers' tokens."""
    cpu = engine_in(tiny_llama, resolve("cpu", "float32", compile="off"))
    want = [cpu.executor.forward(args) for args in step_inputs(cpu.executor.vocab_size)]
    run_gpu_code_on_the_cpu(monkeypatch)
    gpu = engine_in(tiny_llama, resolve("cpu", "float32", compile="off"))
    assert gpu.executor.runtime.attn_dtype == torch.float32 and gpu.executor.runtime._native \
        is None
    for args, b in zip(step_inputs(gpu.executor.vocab_size), want, strict=True):
        a = gpu.executor.forward(args)
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), args.tokens.shape
    check_device(gpu, torch.device("cpu"))
    for prompt, res in zip(prompts(), generate_local(gpu, prompts(), 20,
                                                      trees=noisy_oracle(hf_model, 4)),
                           strict=True):
        assert res.token_ids == hf_greedy(hf_model, prompt, 20)


def test_the_gpu_code_path_drafts_with_a_head_in_bfloat16(tiny_llama, tmp_path, monkeypatch):
    """The verifier's draft head in the GPU's format: its input linear moves with the
    placement (it was left in float32 on the host: a dtype or device error at the first
    draft)."""
    from specinfer.drafting import DraftPlan
    from specinfer.drafting.head import DraftHead
    from specinfer.models import load_model
    from specinfer.training.head import save_head

    save_head(DraftHead(load_model(tiny_llama), torch.arange(0, 128)), tmp_path / "head",
              tiny_llama, {})
    run_gpu_code_on_the_cpu(monkeypatch)
    engine = build_engine(tiny_llama, EngineConfig(max_context=128, slots=4,
                                                   max_tree_nodes=24),
                          head=str(tmp_path / "head"),
                          placement=resolve("cpu", "bfloat16", compile="off"))
    results = generate_local(engine, prompts(), 12, draft=DraftPlan(("head",), 8))
    assert all(len(r.token_ids) == 12 for r in results)


@cuda
def test_cuda_placement_and_float32_exactness(tiny_llama, hf_model):
    engine = engine_in(tiny_llama, resolve("cuda", "float32", compile="off"))
    check_device(engine, torch.device("cuda", torch.cuda.current_device()))
    for prompt, res in zip(prompts(), generate_local(engine, prompts(), 30,
                                                      trees=noisy_oracle(hf_model, 1)),
                           strict=True):
        assert res.token_ids == hf_greedy(hf_model, prompt, 30)


@cuda
def test_cuda_graphs_replay_the_eager_step(tiny_llama, hf_model):
    """float32: graphs give eager's tokens (trees and plain rows; this model's argmax gaps,
    >= 6e-4, dwarf float32's noise). bfloat16 on a GPU is not batch-invariant (a graph pads
    rows and keys, and cuBLAS picks kernels by shape; this model's bfloat16 logits tie):
    there, a step's logits within bfloat16's rounding of eager's, no NaN."""
    trees = noisy_oracle(hf_model, 1)
    runs = [generate_local(engine_in(tiny_llama, resolve("cuda", "float32", compile=c)),
                           prompts(), 24, trees=trees) for c in ("off", "on")]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    eager, graphs = (engine_in(tiny_llama, resolve("cuda", "bfloat16", compile=c))
                     for c in ("off", "on"))
    assert graphs.executor.runtime._graphs is not None
    for args in step_inputs(eager.executor.vocab_size):
        a, b = eager.executor.forward(args), graphs.executor.forward(args)
        assert not b.isnan().any()
        assert (a - b).abs().max() <= 0.03 * a.abs().max(), args.tokens.shape


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
