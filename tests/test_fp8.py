"""FP8 linear layers (model/fp8.py, adaptive_load.fp8 / --fp8): which linears convert, the schema and flag, the
refusals (torchao missing, no CUDA, an old GPU, LoRA) naming the key or flag, the converted model against bf16 math
(torchao's emulated scaled GEMM on CPU), compiled regions over the fp8 layers, and the bf16-equivalent MFU label."""
import copy
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.model.fp8 import FP8_LINEARS, check_fp8, fp8_targets, is_fp8_target
from ds_adaptiveload.train.config import AdaptiveLoadConfig, fp8_from_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
# A packed micro-batch of three shape groups: the output projections then take a list of parts.
SHAPES = [(1, 4, 4), (1, 4, 4), (3, 4, 4), (2, 2, 6)]


def tiny_model():
    torch.manual_seed(0)
    model = WanModel(TINY)
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)  # Wan's head starts at zero: no signal would reach the blocks
    return model


# -- which linears -----------------------------------------------------------------------------------------------


def test_the_filter_picks_exactly_the_block_projections_and_ffn_linears():
    names = fp8_targets(tiny_model())
    expected = [f"blocks.{i}.{a}.{p}" for i in range(TINY.num_layers) for a in ("self_attn", "cross_attn")
                for p in "qkvo"]
    expected += [f"blocks.{i}.ffn.{j}" for i in range(TINY.num_layers) for j in (0, 2)]
    assert sorted(names) == sorted(expected) and len(names) == 10 * TINY.num_layers
    linears = [n for n, m in tiny_model().named_modules() if isinstance(m, torch.nn.Linear)]
    kept = sorted(set(linears) - set(names))  # the embeddings, time projection and head stay bf16
    assert kept == ["head.head", "text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
                    "time_projection.1"]
    assert is_fp8_target("module.blocks.3.ffn.2") and is_fp8_target("blocks.12.cross_attn.o")
    for name in ("blocks.0.self_attn.norm_q", "blocks.0.ffn.1", "blocks.0.ffn", "head.head", "blocks.0.self_attn",
                 "xblocks.0.ffn.0", "blocks.0.ffn.0.lora_A"):
        assert not is_fp8_target(name), name
    assert len(FP8_LINEARS) == 10


# -- schema and flag ---------------------------------------------------------------------------------------------


def test_schema_accepts_off_and_linear_and_refuses_the_rest():
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "ds.json").fp8 == "off"
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "fp8": "linear"}, "ds.json").fp8 == "linear"
    for bad in ("all", "fp8", True, None, "Linear"):
        with pytest.raises(UserError, match=r'ds.json: adaptive_load.fp8 must be "off" or "linear", got'):
            AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "fp8": bad}, "ds.json")
    with pytest.raises(UserError, match=r"adaptive_load.fp8 'linear' does not run with LoRA \(adaptive_load.lora"):
        AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "fp8": "linear", "lora": {"rank": 4}}, "ds.json")
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "fp8": "off", "lora": {"rank": 4}}, "ds.json").lora


def test_the_flag_wins_over_the_key_and_errors_name_the_flag():
    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "ds.json")
    assert fp8_from_flags(SimpleNamespace(fp8=None), al, "ds.json") is al
    assert fp8_from_flags(SimpleNamespace(fp8="linear"), al, "ds.json").fp8 == "linear"
    on = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "fp8": "linear"}, "ds.json")
    assert fp8_from_flags(SimpleNamespace(fp8="off"), on, "ds.json").fp8 == "off"
    lora = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "lora": {"rank": 4}}, "ds.json")
    with pytest.raises(UserError, match=r"^ds.json: --fp8 'linear' does not run with LoRA"):
        fp8_from_flags(SimpleNamespace(fp8="linear"), lora, "ds.json")
    # the key in the JSON, LoRA from --lora-rank (merged without validation): refused, naming the key
    merged = on.model_copy(update={"lora": lora.lora})
    with pytest.raises(UserError, match=r"^ds.json: adaptive_load.fp8 'linear' does not run with LoRA"):
        fp8_from_flags(SimpleNamespace(fp8=None), merged, "ds.json")


def test_train_flag_parses_and_refuses_unknown_values():
    from ds_adaptiveload.train_cli import parse_args

    base = ["--deepspeed_config", "ds.json", "--model-config", "m.yaml", "--synthetic", "--max-steps", "1"]
    assert parse_args(base).fp8 is None
    assert parse_args(base + ["--fp8", "linear"]).fp8 == "linear"
    with pytest.raises(UserError, match=r"--fp8: invalid choice: 'e5m2' \(choose from 'off', 'linear'\)"):
        parse_args(base + ["--fp8", "e5m2"])


# -- where it cannot run -----------------------------------------------------------------------------------------


def test_torchao_missing_names_the_flag_and_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao... raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"^--fp8 linear needs torchao's float8 training, which does not import "
                                        r"\(.*\): pip install 'torchao>=0.18' .*ds_adaptiveload\[fp8\]"):
        check_fp8("linear", torch.device("cpu"), "--fp8")
    from ds_adaptiveload.model.fp8 import convert_fp8

    with pytest.raises(UserError, match="pip install 'torchao>=0.18'"):
        convert_fp8(tiny_model())
    check_fp8("off", None, "--fp8")  # off needs nothing


def test_no_cuda_and_old_gpus_are_refused(monkeypatch):
    pytest.importorskip("torchao.float8")
    with pytest.raises(UserError, match=r"^run.json: adaptive_load.fp8 linear needs a CUDA GPU of compute capability "
                                        r"8.9 or newer .*the device is cpu; train with run.json: adaptive_load.fp8 off"):
        check_fp8("linear", torch.device("cpu"), "run.json: adaptive_load.fp8")
    with pytest.raises(UserError, match="no device"):
        check_fp8("linear", None, "--fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"^--fp8 linear needs compute capability 8.9 or newer; NVIDIA A100-SXM4-80GB "
                                        r"has 8.0; train with --fp8 off"):
        check_fp8("linear", torch.device("cuda", 0), "--fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8("linear", torch.device("cuda", 0), "--fp8")  # an H100 passes


def test_the_trainer_config_refuses_fp8_on_this_cpu(tmp_path):
    """read_config (agreed on by every rank): the flag or the key, named in the one error line."""
    pytest.importorskip("torchao.float8")
    from ds_adaptiveload.train.setup import read_config

    ds = json.load(open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")))
    ds["adaptive_load"]["fp8"] = "linear"
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json"), model_config="configs/wan_tiny.yaml",
                           fault=None, checkpoint_blocks=True, checkpoint_policy="full", compile_blocks=False,
                           compile_cache=None, resume=None, activation_offload=None, fp8=None)
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.fp8 linear needs a CUDA GPU"):
        read_config(args, 1, 0, torch.device("cpu"))
    args.fp8 = "linear"
    with pytest.raises(UserError, match=r"^--fp8 linear needs a CUDA GPU"):
        read_config(args, 1, 0, torch.device("cpu"))
    args.fp8 = "off"
    assert read_config(args, 1, 0, torch.device("cpu")).al.fp8 == "off"


# -- the converted model (torchao's emulated scaled GEMM on CPU) -------------------------------------------------


def packed_inputs():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(TINY.in_dim, *s, generator=g) for s in SHAPES]
    texts = [torch.randn(5 + i, TINY.text_dim, generator=g) for i in range(len(SHAPES))]
    return xs, torch.tensor([100.0, 400.0, 700.0, 900.0]), texts


def converted(model):
    from ds_adaptiveload.model.fp8 import convert_fp8, rowwise_config

    names = convert_fp8(model, config=rowwise_config(emulate=True))
    return model, names


def rel_err(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_conversion_swaps_the_intended_types_and_keeps_the_weights():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from ds_adaptiveload.model.fp8_layers import Float8GeluLinear, Float8RowsLinear

    model = tiny_model()
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    model, names = converted(model)
    assert sorted(names) == sorted(fp8_targets(tiny_model()))
    for n, m in model.named_modules():
        if n in names:
            want = (Float8RowsLinear if n.endswith(".o") else Float8GeluLinear if n.endswith("ffn.2") else Float8Linear)
            assert type(m) is want, n
            assert m.weight is weights[n]  # the same Parameter: optimizer and ZeRO see the original tensor
            assert m.config.pad_inner_dim  # a token count not a multiple of 16 (32,760) in the weight gradient
        elif isinstance(m, torch.nn.Linear):
            assert type(m) is torch.nn.Linear, n
    assert sorted(model.state_dict()) == sorted(tiny_model().state_dict())  # checkpoints keep their keys


def test_fp8_forward_and_gradients_follow_the_bf16_math():
    """Packed forward (lists into the output projections, gelu(h) into ffn.2) within fp8's error of the unconverted
    model, and every converted weight gets a gradient close to the reference's. A layer that dropped ffn.2's GELU
    or mis-merged the parts would be off by far more than e4m3's ~6% per element."""
    pytest.importorskip("torchao.float8")
    ref = tiny_model()
    model, names = converted(copy.deepcopy(ref))
    xs, t, texts = packed_inputs()
    out_ref, out = ref(xs, t, texts, flat=True), model(xs, t, texts, flat=True)
    assert 0 < rel_err(out, out_ref) < 0.08, rel_err(out, out_ref)
    out_ref.square().sum().backward()
    out.square().sum().backward()
    grads = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if n.rsplit(".", 1)[0] in names and n.endswith("weight"):
            assert rel_err(grads[n].grad, p.grad) < 0.15, (n, rel_err(grads[n].grad, p.grad))


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_checkpointed_fp8_blocks_recompute_the_same_step(policy):
    """Recompute in backward (every block checkpointed, whole or keeping the attention outputs) through torchao's
    float8 autograd function gives the open blocks' outputs and gradients exactly."""
    pytest.importorskip("torchao.float8")
    model, _ = converted(tiny_model())
    ckpt = copy.deepcopy(model)
    ckpt.set_checkpointing(True, policy=policy)
    xs, t, texts = packed_inputs()
    for m in (model, ckpt):
        m(xs, t, texts, flat=True).square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


def test_compiled_regions_bind_the_fp8_layers_and_match_eager():
    """compile_regions gives each fp8 layer a compiled forward (Float8RowsLinear: its GEMM, after the eager merge of
    the parts); each kind run once against its eager self (the blocks' other regions are tests/test_compile_regions'),
    and uncompile_blocks takes them back."""
    pytest.importorskip("torchao.float8")
    from ds_adaptiveload.model.compile import compile_regions, uncompile_blocks

    torch._dynamo.reset()
    model, _ = converted(tiny_model())
    layers = {n: m for n, m in model.named_modules() if is_fp8_target(n)}
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(2, 5, TINY.num_heads, TINY.dim // TINY.num_heads, generator=g),
             torch.randn(1, 7, TINY.num_heads, TINY.dim // TINY.num_heads, generator=g)]
    cases = (("blocks.0.self_attn.q", torch.randn(17, TINY.dim, generator=g)), ("blocks.1.self_attn.o", parts),
             ("blocks.0.ffn.2", torch.randn(17, TINY.ffn_dim, generator=g)))
    eager = [layers[name](x) for name, x in cases]
    compile_regions(model, backend="aot_eager")
    bound = {n: sorted({"forward", "project"} & set(m.__dict__)) for n, m in layers.items()}
    assert all(v == (["project"] if n.endswith(".o") else ["forward"]) for n, v in bound.items()), bound
    for (name, x), want in zip(cases, eager):
        torch.testing.assert_close(layers[name](x), want, rtol=1e-5, atol=1e-6)
    uncompile_blocks(model)
    assert not any({"forward", "project"} & set(m.__dict__) for m in layers.values())


def test_the_trainer_converts_the_model_it_built(monkeypatch):
    """Trainer.convert_fp8 (between the model's build and its compile): adaptive_load.fp8 linear converts the block
    linears (emulated GEMMs here), off leaves the model alone."""
    pytest.importorskip("torchao.float8")
    from ds_adaptiveload.model import fp8
    from ds_adaptiveload.train.trainer import Trainer

    real = fp8.rowwise_config
    monkeypatch.setattr(fp8, "rowwise_config", lambda emulate=False: real(emulate=True))
    model = tiny_model()
    Trainer.convert_fp8(SimpleNamespace(al=SimpleNamespace(fp8="off"), rank=0), model)
    assert not any(type(m).__module__.startswith("torchao") for m in model.modules())
    Trainer.convert_fp8(SimpleNamespace(al=SimpleNamespace(fp8="linear"), rank=0), model)
    converted_names = [n for n, m in model.named_modules() if type(m).__name__.startswith("Float8")]
    assert sorted(converted_names) == sorted(fp8_targets(tiny_model()))


@pytest.mark.cuda
def test_fp8_on_the_gpu_trains_a_step_in_bf16_with_compiled_regions():
    """On an 8.9+ GPU: real scaled GEMMs (torch._scaled_mm) inside compiled regions, a finite loss and gradients."""
    pytest.importorskip("torchao.float8")
    device = torch.device("cuda")
    check_fp8("linear", device, "--fp8")
    from ds_adaptiveload.model.compile import compile_regions
    from ds_adaptiveload.model.fp8 import convert_fp8

    model = tiny_model().to(device, torch.bfloat16)  # its widths are multiples of 16, as _scaled_mm needs
    convert_fp8(model)
    compile_regions(model)
    xs, t, texts = packed_inputs()
    out = model([x.to(device, torch.bfloat16) for x in xs], t.to(device),
                [c.to(device, torch.bfloat16) for c in texts], flat=True)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


# -- MFU label ---------------------------------------------------------------------------------------------------


def test_mfu_of_an_fp8_run_is_labelled_bf16_equivalent():
    from ds_adaptiveload.train.metrics import mfu_name, monitor_events

    assert mfu_name(False) == "mfu(%)" and mfu_name(True) == "mfu(%, bf16-equivalent)"
    assert mfu_name(True, "MFU") == "MFU (bf16-equivalent)"
    m = dict(loss=1.0, samples_per_s=1.0, tokens_per_s=1.0, step_ms=1.0, idle_fraction=0.0, pred_idle_fraction=0.0,
             mfu=0.5)
    assert ("mfu(%, bf16-equivalent)", 50.0, 3) in monitor_events(m, 3, 1e-4, fp8=True)
    assert ("mfu(%)", 50.0, 3) in monitor_events(m, 3, 1e-4)
