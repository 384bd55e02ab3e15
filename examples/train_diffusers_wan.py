"""Train diffusers' WanTransformer3DModel from your own DeepSpeed loop with the AdaptiveLoad scheduler.

    deepspeed --num_gpus 2 examples/train_diffusers_wan.py --steps 3 [--output DIR] [--resume] [--data MANIFEST]

CPU-sized: a 2-layer Wan transformer, synthetic latents (or a manifest from `encode` or `synthesize` with text_dim
64), ZeRO-3 over 2 ranks. Latents and text are cast to the engine's dtype, so bf16 shards (what `encode` writes)
train as fp32 ones do. One line per step; a checkpoint in OUTPUT/checkpoints at the end, which --resume continues
from. A failure ends as train_wan's do: one `error:` line and the same exit code on every rank (docs/reliability.md).
"""
import argparse
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

import ds_adaptiveload  # noqa: E402
from ds_adaptiveload.data.latents import LatentDataset, write_synthetic  # noqa: E402
from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402
from ds_adaptiveload.schedule.manifest import load_manifest  # noqa: E402
from ds_adaptiveload.schedule.mixes import make_mix  # noqa: E402
from ds_adaptiveload.train import failures  # noqa: E402
from ds_adaptiveload.train.ckpt_safe import install as load_weights_only  # noqa: E402
from ds_adaptiveload.train.engine import compute_dtype, init_distributed  # noqa: E402

MODEL = dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2, text_dim=64, freq_dim=64)
TEXT_LEN = 32
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,  # the scheduler sizes micro-batches; DeepSpeed counts them
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "data_efficiency": {"seed": 0, "data_sampling": {"adaptive_load": {
        "profile": os.path.join(ROOT, "configs/profiles/tiny-cpu.yaml"), "policy": "balanced",
        "loss_weighting": "bell", "lr_scaling_method": "linear", "lr_reference_batch_size": 16}}},
}


def flow_loss(model, latent, text, eps, t):
    """Per-sample flow-matching MSE [B] (fp32) as Wan trains: x_t = (1 - t) x0 + t eps, target eps - x0. The noise
    mix is computed in fp32 (eps is fp32), the model's input in the latent's dtype."""
    tb = t.view(-1, 1, 1, 1, 1)
    x0 = latent.float()
    pred = model(hidden_states=((1 - tb) * x0 + tb * eps).to(latent.dtype), timestep=t * 1000,
                 encoder_hidden_states=text, return_dict=False)[0]
    return (pred.float() - (eps - x0)).pow(2).flatten(1).mean(1)


def dump_grads(engine, path, indices):
    """Tests: parameters, accumulated gradients and every rank's samples of this step (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, indices)
    if dist.get_rank() == 0:
        torch.save({"params": params, "grads": grads, "indices": everyone}, path)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output", default="runs/diffusers_wan")
    p.add_argument("--data", help="manifest to train on (default: synthetic fp32 latents in OUTPUT/data)")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoints")
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--dump-grads", help=argparse.SUPPRESS)  # tests: the last step's gradient
    return p.parse_args()


def write_data(folder):
    if dist.get_rank() == 0:
        write_synthetic(folder, make_mix("tiny", 48, seed=0), text_dim=MODEL["text_dim"], max_text_len=TEXT_LEN,
                        dtype="fp32")


def load_data(args):
    """(samples, LatentDataset) of --data, or of the synthetic dataset rank 0 writes (agreed: also the barrier)."""
    manifest = args.data or os.path.join(args.output, "data", "manifest.jsonl")
    if not args.data:
        failures.agreed(write_data, os.path.dirname(manifest))
    samples = failures.agreed(load_manifest, manifest)
    return samples, LatentDataset(samples, manifest, Geometry(), TEXT_LEN, MODEL["text_dim"])


def train(args):
    init_distributed()  # deepspeed.init_distributed; on a CPU it also unlinks DeepSpeed's shm buffer (train/engine.py)
    failures.register_rank()  # a peer that finds this rank gone names it
    torch.set_num_threads(1)
    samples, dataset = load_data(args)

    torch.manual_seed(0)
    model = WanTransformer3DModel(**MODEL)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    dtype = compute_dtype(engine)  # bf16 shards into an fp32 engine, or the reverse: one dtype for the matmuls
    loader, lr_scheduler = ds_adaptiveload.get_dataloader_and_lr_scheduler(engine, dataset, samples)
    ckpt = os.path.join(args.output, "checkpoints")
    if args.resume:  # after the call above, so that DeepSpeed restores the wrapped LR schedule too
        load_weights_only(engine)  # DeepSpeed's files read with torch.load(weights_only=True): no code runs
        _, client = engine.load_checkpoint(ckpt)
        loader.load_state_dict(client["loader"])

    for step, batches in zip(range(engine.global_steps + 1, args.steps + 1), loader):
        lr = lr_scheduler.get_lr()[0]  # scaled by this step's sample count
        loss_sum = torch.zeros(())
        for g, mb in enumerate(batches):
            latent, text = mb.batch["latent"].to(dtype), mb.batch["text"].to(dtype)
            eps, t = mb.noise(latent)
            losses = flow_loss(engine, latent, text, eps, t)
            engine.backward(mb.loss(losses, t))
            if args.dump_grads and step == args.steps and g == len(batches) - 1:
                dump_grads(engine, args.dump_grads, [i for m in batches if not m.pad for i in m.indices])
            engine.step()
            loss_sum += 0.0 if mb.pad else losses.detach().sum()
        dist.all_reduce(loss_sum)
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss_sum) / batches.global_samples:.6f} "
                  f"samples {batches.global_samples} lr {lr:.6g}", flush=True)
    engine.save_checkpoint(ckpt, client_state={"loader": loader.state_dict()})  # the same on every rank
    loader.close()
    dist.barrier()


def main():
    import signal

    args = parse_args()
    signal.signal(signal.SIGTERM, failures.on_sigterm)
    try:
        train(args)
        code = 0
    except (Exception, failures.Terminated) as e:  # bad input, a lost peer, SIGTERM: one line; else re-raised
        code = failures.report(e)
    finally:
        failures.teardown()
    # All work is saved and the group is gone: leave without interpreter teardown, where one rank in a few still
    # aborted under the test suite ("terminate called without an active exception", 2026-12-01).
    failures.leave(code)


if __name__ == "__main__":
    main()
