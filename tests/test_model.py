"""Wan 2.1 DiT: equivalence with diffusers' WanTransformer3DModel, key conversion, checkpoint I/O,
activation checkpointing, parameter / FLOP accounting and the sequence-parallel hook."""
import json
import os

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel, load_wan_checkpoint, save_wan_checkpoint
from ds_adaptiveload.model.convert import diffusers_config, from_diffusers, to_diffusers
from tests.launcher import master_port, spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "wan_tiny.yaml")


def tiny_cfg(**kw) -> WanConfig:
    return WanConfig(**{**WanConfig.from_yaml(TINY).to_dict(), **kw})


def perturbed_model(cfg, seed=0, **kw) -> WanModel:
    """Random init, then every parameter perturbed: the zero-initialised head and the modulation
    tables must not hide a wrong mapping."""
    torch.manual_seed(seed)
    m = WanModel(cfg, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def inputs(cfg, B=2, latent=(3, 8, 12), ctx_len=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg.in_dim, *latent, generator=g)
    t = torch.rand(B, generator=g) * 1000
    ctx = torch.randn(B, ctx_len or cfg.text_len, cfg.text_dim, generator=g)
    return x, t, ctx


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- equivalence with diffusers

@pytest.mark.parametrize("latent", [(3, 8, 12), (1, 6, 4)])
def test_matches_diffusers(latent):
    diffusers = pytest.importorskip("diffusers")
    cfg = tiny_cfg()
    m = perturbed_model(cfg).eval()
    ref = diffusers.WanTransformer3DModel(**diffusers_config(cfg)).eval()
    ref.load_state_dict(to_diffusers(m.state_dict()), strict=True)
    # A context shorter than text_len: ours zero-pads it; diffusers gets it padded, as Wan pipelines do.
    x, t, ctx = inputs(cfg, B=2, latent=latent, ctx_len=cfg.text_len - 7)
    padded = torch.nn.functional.pad(ctx, (0, 0, 0, 7))
    with torch.no_grad():
        y = m(x, t, ctx)
        y_ref = ref(x, t, padded, return_dict=False)[0]
    assert y.shape == (2, cfg.out_dim, *latent)
    assert rel_err(y, y_ref) <= 1e-5
    # Per-sample outputs differ (t and context reach every sample separately).
    assert rel_err(y[0], y[1]) > 0.1


def test_context_longer_than_text_len_is_truncated():
    cfg = tiny_cfg()
    m = perturbed_model(cfg).eval()
    x, t, ctx = inputs(cfg, B=1, latent=(1, 4, 4))
    long = torch.cat([ctx, torch.randn(1, 5, cfg.text_dim)], dim=1)
    with torch.no_grad():
        assert torch.equal(m(x, t, long), m(x, t, ctx))
        assert torch.equal(m(x, t, [ctx[0]]), m(x, t, ctx))  # list-of-tensors context


# ---------------------------------------------------------------- key conversion

def test_diffusers_key_roundtrip_is_identity():
    diffusers = pytest.importorskip("diffusers")
    cfg = tiny_cfg(num_layers=3)
    sd = WanModel(cfg).state_dict()
    d_sd = to_diffusers(sd)
    ref_keys = set(diffusers.WanTransformer3DModel(**diffusers_config(cfg)).state_dict())
    assert set(d_sd) == ref_keys
    back = from_diffusers(d_sd)
    assert list(back) == list(sd)
    assert all(back[k] is sd[k] for k in sd)


def test_original_wan_key_names():
    sd = WanModel(tiny_cfg()).state_dict()
    for key in ["patch_embedding.weight", "text_embedding.0.weight", "text_embedding.2.bias",
                "time_embedding.0.weight", "time_embedding.2.weight", "time_projection.1.weight",
                "blocks.1.self_attn.q.weight", "blocks.1.self_attn.o.bias", "blocks.1.self_attn.norm_q.weight",
                "blocks.1.self_attn.norm_k.weight", "blocks.1.norm3.weight", "blocks.1.norm3.bias",
                "blocks.1.cross_attn.k.weight", "blocks.1.cross_attn.norm_k.weight", "blocks.1.ffn.0.weight",
                "blocks.1.ffn.2.bias", "blocks.1.modulation", "head.head.weight", "head.modulation"]:
        assert key in sd, key
    assert sd["blocks.0.modulation"].shape == (1, 6, 128) and sd["head.modulation"].shape == (1, 2, 128)


def test_unknown_key_in_conversion_is_named():
    with pytest.raises(UserError, match="blocks.0.img_emb.proj"):
        to_diffusers({"blocks.0.img_emb.proj": 0})
    with pytest.raises(UserError, match="condition_embedder.image_embedder"):
        from_diffusers({"condition_embedder.image_embedder.ff.weight": 0})


# ---------------------------------------------------------------- activation checkpointing

def test_checkpointing_same_output_and_grads():
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    x, t, ctx = inputs(cfg)
    results = []
    for ckpt in (False, True):
        m.checkpoint_blocks = ckpt
        m.zero_grad()
        y = m(x, t, ctx)
        (y.square().mean()).backward()
        results.append((y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0, y1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)
    assert all(g.abs().sum() > 0 for g in g0.values())


# ---------------------------------------------------------------- accounting

@pytest.mark.parametrize("name", ["wan_tiny", "wan_1_3b", "wan_14b"])
def test_num_params_matches_model(name):
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", f"{name}.yaml"))
    with torch.device("meta"):
        m = WanModel(cfg)
    assert cfg.num_params() == sum(p.numel() for p in m.parameters())


def test_num_params_without_norms():
    cfg = tiny_cfg(qk_norm=False, cross_attn_norm=False)
    assert cfg.num_params() == sum(p.numel() for p in WanModel(cfg).parameters())


def test_flops_match_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny_cfg()
    m = WanModel(cfg)
    x, t, ctx = inputs(cfg, B=1, latent=(2, 6, 10))
    tokens = 2 * 3 * 5
    # The math SDPA backend runs attention as bmm, which the counter sees (the fused CPU kernel not).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd, torch.no_grad():
        m(x, t, ctx)
    assert cfg.flops_per_sample(tokens) == pytest.approx(3 * fwd.get_total_flops(), rel=1e-9)
    # Real backward is ~2x forward (the input-side grads of the first layers are skipped).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as both:
        m(x, t, ctx).sum().backward()
    assert cfg.flops_per_sample(tokens) == pytest.approx(both.get_total_flops(), rel=0.03)


# ---------------------------------------------------------------- checkpoint files

def test_safetensors_roundtrip_wan_and_diffusers_keys(tmp_path):
    cfg = tiny_cfg()
    src = perturbed_model(cfg, seed=3)
    for diffusers_fmt in (False, True):
        path = tmp_path / f"w{int(diffusers_fmt)}.safetensors"
        save_wan_checkpoint(src, path, diffusers=diffusers_fmt)
        dst = load_wan_checkpoint(WanModel(cfg), path)
        for k, v in src.state_dict().items():
            assert torch.equal(dst.state_dict()[k], v), k


def test_sharded_index_and_directory(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_cfg()
    src = perturbed_model(cfg, seed=4)
    sd = {"model.diffusion_model." + k: v.contiguous() for k, v in src.state_dict().items()}
    keys = list(sd)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / name))
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        dst = load_wan_checkpoint(WanModel(cfg), path)
        assert all(torch.equal(dst.state_dict()[k], v) for k, v in src.state_dict().items())


def test_bad_checkpoints_name_the_key(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_cfg()
    sd = {k: v.contiguous() for k, v in WanModel(cfg).state_dict().items()}

    bad = dict(sd, **{"blocks.0.self_attn.qq.weight": torch.zeros(2)})
    save_file(bad, str(tmp_path / "extra.safetensors"))
    with pytest.raises(UserError, match=r"extra\.safetensors.*blocks\.0\.self_attn\.qq\.weight"):
        load_wan_checkpoint(WanModel(cfg), tmp_path / "extra.safetensors")

    bad = dict(sd, **{"blocks.1.ffn.0.weight": torch.zeros(3, 128)})
    save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(UserError, match=r"blocks\.1\.ffn\.0\.weight.*\[3, 128\].*\[256, 128\]"):
        load_wan_checkpoint(WanModel(cfg), tmp_path / "shape.safetensors")

    missing = {k: v for k, v in sd.items() if k != "head.modulation"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(UserError, match="head.modulation"):
        load_wan_checkpoint(WanModel(cfg), tmp_path / "missing.safetensors")
    load_wan_checkpoint(WanModel(cfg), tmp_path / "missing.safetensors", strict=False)

    with pytest.raises(UserError, match="not found"):
        load_wan_checkpoint(WanModel(cfg), tmp_path / "nope.safetensors")


# ---------------------------------------------------------------- config

def test_config_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dim: 128\nnum_heads: 2\nffn_dim: 256\nnum_layers: 1\nhidden: 3\n")
    with pytest.raises(UserError, match=r"c\.yaml.*hidden"):
        WanConfig.from_yaml(p)
    with pytest.raises(UserError, match="not divisible"):
        WanConfig(dim=100, num_heads=3)
    with pytest.raises(UserError, match="head_dim"):
        WanConfig(dim=10, num_heads=2)
    assert WanConfig.from_yaml(TINY).rope_dims == (24, 20, 20)


def test_bad_input_shapes():
    cfg = tiny_cfg()
    m = WanModel(cfg)
    with pytest.raises(UserError, match="not divisible by patch"):
        m(torch.zeros(1, 16, 1, 5, 4), torch.zeros(1), torch.zeros(1, 4, cfg.text_dim))
    with pytest.raises(UserError, match="context"):
        m(torch.zeros(1, 16, 1, 4, 4), torch.zeros(1), torch.zeros(1, 4, cfg.text_dim + 1))


# ---------------------------------------------------------------- attention hook and sequence parallelism

def test_attention_hook_is_used():
    from ds_adaptiveload.model import sdpa_attention

    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    x, t, ctx = inputs(cfg)
    calls = []

    def core(q, k, v, **kw):
        calls.append((q.shape, kw))
        return sdpa_attention(q, k, v, **kw)

    with torch.no_grad():
        y0 = m(x, t, ctx)
        m.set_attention(core)
        y1 = m(x, t, ctx)
    assert torch.equal(y0, y1)
    assert calls == [((2, 3 * 4 * 6, cfg.num_heads, cfg.head_dim), {})] * cfg.num_layers
    assert not any("attn" in k for k in m.state_dict() if "self_attn" not in k and "cross_attn" not in k)


def _sp_worker(rank, world, port, result_path):
    """One SP rank: the sequence is sharded by the model; the attention core all-gathers k and v
    (gloo has no all-to-all, so this stands in for Ulysses; the model-side contract is the same)."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    from ds_adaptiveload.model import SeqShard, sdpa_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def gather_kv_attention(q, k, v, valid_len=None):
        k = torch.cat(dnn.all_gather(k.contiguous()), dim=1)
        v = torch.cat(dnn.all_gather(v.contiguous()), dim=1)
        return sdpa_attention(q, k, v, valid_len=valid_len)

    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    m.set_attention(gather_kv_attention)
    x, t, ctx = inputs(cfg, latent=(3, 6, 10))       # 45 tokens: padded to 46 for 2 ranks
    y = m(x, t, ctx, seq_shard=SeqShard(rank, world))
    y.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    for g in grads.values():                          # what DeepSpeed does over the SP group
        dist.all_reduce(g)
    if rank == 0:
        torch.save({"y": y.detach(), "grads": grads}, result_path)
    dist.destroy_process_group()


def test_sequence_parallel_matches_single_process(tmp_path):
    out = str(tmp_path / "sp.pt")
    spawn_ranks(_sp_worker, 2, master_port(), out)
    res = torch.load(out)

    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    x, t, ctx = inputs(cfg, latent=(3, 6, 10))
    y = m(x, t, ctx)
    y.square().mean().backward()
    assert rel_err(res["y"], y.detach()) < 1e-5
    for n, p in m.named_parameters():
        assert rel_err(res["grads"][n], p.grad) < 1e-4, n
