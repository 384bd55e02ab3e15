"""LoRA through peft (model/lora.py, adaptive_load.lora): the schema and flags, which weights train, the adapters'
gradients on packed micro-batches against the merged-weight gradient, and the forward against peft's own merge."""
import argparse
import json
import os

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.train import flow
from ds_adaptiveload.train.config import (DEFAULT_LORA_TARGETS, AdaptiveLoadConfig, LoraSettings, add_lora_flags,
                                          lora_from_flags)

peft = pytest.importorskip("peft")
from ds_adaptiveload.model.lora import (GeluLoraLinear, RowsLoraLinear, adapter_state, apply_lora,  # noqa: E402
                                        is_adapter, target_pattern)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_PATH = os.path.join(ROOT, "configs", "wan_tiny.yaml")
TINY = WanConfig.from_yaml(TINY_PATH)
# Shapes of one packed micro-batch: three groups (two runs of tokens), so the output projection takes a list.
SHAPES = [(1, 4, 4), (1, 4, 4), (3, 4, 4), (2, 2, 6)]


# -- schema and flags ------------------------------------------------------------------------------------------


def test_lora_section_defaults_and_checks():
    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "lora": {"rank": 8}}, "ds.json")
    assert (al.lora.rank, al.lora.alpha, al.lora.dropout, al.lora.scale) == (8, None, 0.0, 1.0)
    assert tuple(al.lora.targets) == DEFAULT_LORA_TARGETS
    assert al.lora.modules() == ("cross_attn.k", "cross_attn.o", "cross_attn.q", "cross_attn.v", "ffn.0", "ffn.2",
                                 "self_attn.k", "self_attn.o", "self_attn.q", "self_attn.v")
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "ds.json").lora is None
    for bad, says in (({"rank": 0}, "adaptive_load.lora.rank must be a positive integer, got 0"),
                      ({"rank": 4, "targets": ["q", "mlp"]}, "adaptive_load.lora.targets must be a non-empty list of q, k, v, o, "
                                                                "self_attn.q"),
                      ({"rank": 4, "dropout": 1.0}, "adaptive_load.lora.dropout must be a number in [0, 1)"),
                      ({"rank": 4, "ranks": 2}, "unknown key 'ranks' in adaptive_load.lora (did you mean "
                                                "adaptive_load.lora.rank?)"),
                      ({}, "adaptive_load.lora.rank is required")):
        with pytest.raises(UserError, match="ds.json: ") as e:
            AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "lora": bad}, "ds.json")
        assert says in str(e.value), str(e.value)


def _flags(*argv):
    p = argparse.ArgumentParser()
    add_lora_flags(p)
    return p.parse_args(list(argv))


def test_lora_flags_merge_over_the_json_section():
    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "lora": {"rank": 8, "dropout": 0.1}}, "ds.json")
    assert lora_from_flags(_flags(), al) is al  # no flag: the JSON as it is
    got = lora_from_flags(_flags("--lora-rank", "32", "--lora-targets", "self_attn,ffn.2", "--lora-alpha", "16"), al)
    assert (got.lora.rank, got.lora.alpha, got.lora.dropout, got.lora.targets) == (32, 16.0, 0.1,
                                                                                   ["self_attn", "ffn.2"])
    plain = AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "ds.json")
    assert lora_from_flags(_flags("--lora-rank", "4"), plain).lora.rank == 4
    with pytest.raises(UserError, match=r"--lora-rank is required"):
        lora_from_flags(_flags("--lora-alpha", "8"), plain)
    with pytest.raises(UserError, match=r"--lora-targets must be a non-empty list of q, k, v, o, .*, got 'qq'"):
        lora_from_flags(_flags("--lora-rank", "4", "--lora-targets", "qq"), plain)
    with pytest.raises(UserError, match=r"--lora-rank must be a positive integer, got -1"):
        lora_from_flags(_flags("--lora-rank", "-1"), al)


# -- which weights train -----------------------------------------------------------------------------------------


def lora_model(settings, seed=0, b_std=0.05):
    """The tiny WanModel with adapters; B drawn non-zero (it starts at zero), so every A gets a gradient too."""
    torch.manual_seed(seed)
    base = WanModel(TINY)
    torch.nn.init.normal_(base.head.head.weight, std=0.02)  # zero at init: no gradient would reach the blocks
    model = apply_lora(base, settings)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=b_std)
    return model


def test_only_the_adapters_train_and_the_custom_layers_wrap_o_and_ffn2():
    s = LoraSettings(rank=4)
    model = lora_model(s)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == TINY.lora_params(4, s.modules())
    block = model.blocks[1]
    assert isinstance(block.self_attn.o, RowsLoraLinear) and isinstance(block.cross_attn.o, RowsLoraLinear)
    assert isinstance(block.ffn[2], GeluLoraLinear)
    assert type(block.ffn[0]).__name__ == "Linear" and hasattr(block.ffn[0], "lora_A")  # peft's own
    only_q = apply_lora(WanModel(TINY), LoraSettings(rank=2, targets=["self_attn.q", "ffn.0"]))
    adapted = {n.rsplit(".lora_A.", 1)[0] for n, _ in only_q.named_parameters() if ".lora_A." in n}
    assert adapted == {f"blocks.{i}.{m}" for i in range(TINY.num_layers) for m in ("self_attn.q", "ffn.0")}
    assert target_pattern(LoraSettings(rank=2, targets=["ffn.2"])) == r"blocks\.\d+\.(ffn\.2)"
    head = apply_lora(WanModel(TINY), LoraSettings(rank=2, targets=["head"]))
    assert [n for n, p in head.named_parameters() if p.requires_grad] == ["head.head.lora_A.default.weight",
                                                                          "head.head.lora_B.default.weight"]
    assert TINY.lora_params(2, ["head"]) == 2 * (TINY.dim + TINY.out_dim * 4)


# -- gradients -----------------------------------------------------------------------------------------------------


def packed_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x0s = [torch.randn(TINY.in_dim, *s, generator=g) for s in SHAPES]
    texts = [torch.randn(5 + i, TINY.text_dim, generator=g) for i in range(len(SHAPES))]
    eps = [torch.randn_like(x) for x in x0s]
    t = torch.rand(len(SHAPES), generator=g)
    return x0s, texts, eps, t


def merged_reference(model, settings):
    """A plain WanModel whose adapted weights are W + scale * B A (every weight trainable), and the adapters' names."""
    ref = WanModel(TINY)
    state, pairs = {}, []
    for name, p in model.state_dict().items():
        if is_adapter(name):
            continue
        state[name.replace(".base_layer.", ".")] = p
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            mod = name.split(".lora_A.")[0]
            a, b = p.detach(), model.get_parameter(name.replace(".lora_A.", ".lora_B.")).detach()
            state[mod + ".weight"] = state[mod + ".weight"] + settings.scale * b @ a
            pairs.append(mod)
    ref.load_state_dict(state)
    return ref, pairs


@pytest.mark.parametrize("alpha", [None, 8.0])
def test_adapter_grads_on_a_packed_micro_batch_equal_the_merged_weights_gradient(alpha):
    """dL/dB = s dL/dW' A^T and dL/dA = s B^T dL/dW' for W' = W + s B A: the packed LoRA forward (lists into the output
    projections, gelu(h) into the FFN's second) against the merged model run one sample at a time, unpacked. A wrong
    adapter input (h for gelu(h), one group for the list) is off by far more than the tolerance."""
    torch.set_default_dtype(torch.float64)
    try:
        s = LoraSettings(rank=3, alpha=alpha)
        model = lora_model(s)
        x0s, texts, eps, t = packed_inputs()
        flow.packed_flow_matching_loss(model, x0s, texts, eps, t).sum().backward()
        ref, pairs = merged_reference(model, s)
        total = sum(flow.flow_matching_loss(ref, x[None], c[None], e[None], ti[None]).sum()
                    for x, c, e, ti in zip(x0s, texts, eps, t))
        total.backward()
        assert len(pairs) == TINY.num_layers * 10
        for mod in pairs:
            dw = ref.get_parameter(mod + ".weight").grad
            a = model.get_parameter(mod + ".lora_A.default.weight")
            b = model.get_parameter(mod + ".lora_B.default.weight")
            assert dw.abs().max() > 0, mod
            # the norms compute in fp32 (as Wan's), so float64 inputs agree to about 1e-7 of the largest entry
            for got, want in ((b.grad, s.scale * dw @ a.detach().T), (a.grad, s.scale * b.detach().T @ dw)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()), msg=mod)
        assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))
    finally:
        torch.set_default_dtype(torch.float32)


def test_forward_equals_peft_merged_weights():
    """Our layers add what peft's own merge adds to the weight (get_delta_weight): merged and unmerged forwards agree,
    packed, with dropout off."""
    from peft.tuners.lora import LoraLayer

    model = lora_model(LoraSettings(rank=4, alpha=6.0)).eval()
    x0s, texts, _, t = packed_inputs(2)
    with torch.no_grad():
        before = model(x0s, t * 1000, texts, flat=True)
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.merge()
        after = model(x0s, t * 1000, texts, flat=True)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert before.abs().max() > 0


def test_gelu_adapter_with_dropout_takes_the_plain_path():
    """With dropout the FFN's adapter sees dropout(gelu(h)); in eval (no dropout) it equals the fused path's output."""
    torch.manual_seed(0)
    s = LoraSettings(rank=4, dropout=0.5, targets=["ffn.2"])
    model = lora_model(s).eval()
    layer = model.blocks[0].ffn[2]
    h = torch.randn(7, TINY.ffn_dim)
    fused = lora_model(LoraSettings(rank=4, targets=["ffn.2"])).blocks[0].ffn[2]
    with torch.no_grad():
        torch.testing.assert_close(layer(h), fused(h))
    model.train()
    with torch.no_grad():
        assert not torch.allclose(layer(h), fused(h))  # dropout acts on the adapter's input


def test_read_config_takes_the_lora_flags_and_an_ema_with_them(tmp_path):
    """--lora-rank reaches the run's settings and its profile's memory (the base's state bytes gone); an EMA of the
    of the adapters goes with them."""
    from types import SimpleNamespace

    from ds_adaptiveload.train.setup import read_config

    ds = json.load(open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json"), model_config="configs/wan_tiny.yaml",
                           fault=None, checkpoint_blocks=False, checkpoint_policy="full", compile_blocks=False,
                           compile_cache=None, resume=None, lora_rank=4, lora_alpha=None, lora_dropout=None,
                           lora_targets=["q", "ffn"])
    c = read_config(args, 1, 0)
    assert (c.al.lora.rank, c.al.lora.targets) == (4, ["q", "ffn"])
    ds["adaptive_load"]["ema_decay"] = 0.99
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert read_config(args, 1, 0).al.ema_decay == 0.99


def test_ema_of_a_lora_run_averages_the_adapters_only(tmp_path, monkeypatch):
    """train/ema.EMA over a LoRA model keeps the adapters alone and equals the hand-computed average after N updates;
    `export --ema` reads it with the base from the checkpoint's weights (export_cli.load_weights)."""
    from types import SimpleNamespace

    from ds_adaptiveload import export_cli
    from ds_adaptiveload.model import export
    from ds_adaptiveload.train.ema import EMA

    decay, model = 0.6, lora_model(LoraSettings(rank=2, targets=["q", "ffn"]))
    ema = EMA(SimpleNamespace(module=model, zero_optimization_stage=lambda: 0), decay, 0)
    adapters = adapter_state(model)
    assert set(ema.shadow) == set(adapters) and adapters
    want = {n: p.detach().float().clone() for n, p in adapters.items()}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        with torch.no_grad():
            for n, p in adapters.items():
                p.add_(torch.randn(p.shape, generator=g))
                want[n] = decay * want[n] + (1 - decay) * p.float()
        ema.update()
    for n, t in ema.shadow.items():
        torch.testing.assert_close(t.view(want[n].shape), want[n], rtol=1e-6, atol=1e-6)
    folder = tmp_path / "ckpt" / "global_step4"
    folder.mkdir(parents=True)
    ema.save(str(folder))
    averaged = export.read_ema(str(tmp_path / "ckpt"), "global_step4", TINY)
    assert export_cli.lora_ema_only(averaged) and set(averaged) == set(adapters)
    (folder / "adaptive_load.json").write_text(json.dumps({"lora": {"rank": 2, "alpha": None}}))
    monkeypatch.setattr(export, "read_weights", lambda *a: {**base, **{n: p * 0 for n, p in adapters.items()}})
    args = SimpleNamespace(checkpoint=str(tmp_path / "ckpt"), tag="global_step4", model_config=TINY_PATH, ema=True,
                           format="lora-diffusers", merge=False)
    _, _, weights = export_cli.load_weights(args)
    for n in adapters:
        torch.testing.assert_close(weights[n], want[n], rtol=1e-6, atol=1e-6)
