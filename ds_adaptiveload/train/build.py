"""Building the Wan DiT for a DeepSpeed config: under ZeRO-3 inside deepspeed.zero.Init, so that every
parameter is partitioned over the ranks as its module is constructed (a 14B model never exists as one fp32
copy per rank), with Wan's initialisation applied to the partitioned parameters.

Under zero.Init a module's parameters are partitioned when its __init__ returns, so WanModel.__init__'s own
init_weights() would meet empty partitions. It is deferred, then run as init_partitioned_weights: the same
draws in the same order as init_weights, one module's parameters gathered at a time, drawn in fp32 on the CPU
and copied in (rank 0's values are what every rank keeps). With zero.Init on the CPU (the 2-rank test) the
result equals WanModel(cfg) built unpartitioned with the same seed; on CUDA, construction draws its default
inits from the device's generator, so the weights follow Wan's distributions but are not bit-equal to a CPU
build of the same seed.
"""
import contextlib

import torch
from torch import nn

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.model.wan import WanBlock, WanModel
from ds_adaptiveload.train.config import zero_stage


@contextlib.contextmanager
def _deferred_init_weights():
    """WanModel.__init__ without its init_weights() call (restored on exit)."""
    original = WanModel.init_weights
    WanModel.init_weights = lambda self: None
    try:
        yield
    finally:
        WanModel.init_weights = original


def _init_module(module: nn.Module, fn) -> None:
    """fn(name -> fp32 CPU copy of the module's own parameters), in place; written back on every rank."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    params = dict(module.named_parameters(recurse=False))
    with GatheredParameters(list(params.values()), modifier_rank=0):
        full = {n: p.detach().float().cpu().clone() for n, p in params.items()}
        fn(full)
        for n, p in params.items():
            p.data.copy_(full[n].to(p.dtype))


@torch.no_grad()
def init_partitioned_weights(model: WanModel) -> None:
    """WanModel.init_weights for partitioned parameters (module docstring); keep the order of its draws."""
    def xavier_zero(w):
        nn.init.xavier_uniform_(w["weight"])
        nn.init.zeros_(w["bias"])

    for m in model.modules():
        if isinstance(m, nn.Linear):
            _init_module(m, xavier_zero)
    _init_module(model.patch_embedding, lambda w: (nn.init.xavier_uniform_(w["weight"].flatten(1)),
                                                   nn.init.zeros_(w["bias"])))
    for seq in (model.text_embedding, model.time_embedding):
        for m in seq:
            if isinstance(m, nn.Linear):
                _init_module(m, lambda w: nn.init.normal_(w["weight"], std=0.02))
    _init_module(model.head.head, lambda w: nn.init.zeros_(w["weight"]))


def build_model(model_cfg: WanConfig, ds_cfg: dict, checkpoint_blocks=False, seed=None, leaf_blocks=None,
                init_weights=True, **model_kw) -> WanModel:
    """WanModel for `ds_cfg` (the DeepSpeed dict, adaptive_load removed). ZeRO-3: constructed inside
    deepspeed.zero.Init(config_dict_or_path=ds_cfg), parameters partitioned at construction.

    seed: torch.manual_seed before construction (None: the caller seeded). leaf_blocks: make WanBlock a
    ZeRO-3 leaf module (deepspeed.utils.set_z3_leaf_modules: one gather per block instead of one per
    linear, and no hooks inside a compiled block); None = on under ZeRO-3. init_weights=False: leave the weights as
    constructed (--init-from overwrites every one; under ZeRO-3 this saves a gather per module). Other keywords go
    to WanModel."""
    if not isinstance(model_cfg, WanConfig):
        raise UserError(f"build_model: model_cfg must be a WanConfig, got {type(model_cfg).__name__}")
    stage = zero_stage(ds_cfg)
    if leaf_blocks and stage != 3:
        raise UserError(f"build_model: leaf_blocks needs zero_optimization.stage 3, the config has {stage}")
    if seed is not None:
        torch.manual_seed(seed)
    if stage != 3:
        with _deferred_init_weights() if not init_weights else contextlib.nullcontext():
            return WanModel(model_cfg, checkpoint_blocks=checkpoint_blocks, **model_kw)
    import deepspeed

    with _deferred_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = WanModel(model_cfg, checkpoint_blocks=checkpoint_blocks, **model_kw)
    if init_weights:
        init_partitioned_weights(model)
    if leaf_blocks is None or leaf_blocks:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [WanBlock])
    return model
