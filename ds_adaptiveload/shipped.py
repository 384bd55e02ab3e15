"""The configs and cost profiles shipped with the package: where they are, path look-up, and profile "auto".

An installed package holds them under ds_adaptiveload/configs (setup.py's package data); a checkout keeps them in
configs/ at the repository root. A relative path is looked up in the working directory first, then (for paths in a
DeepSpeed JSON) next to that JSON, then among the shipped files: "configs/ds_zero2_bf16.json" names the shipped
one outside a checkout too, and a profile may be named by its file name alone ("h100-wan1.3b-zero2")."""
import os
from pathlib import Path

from ds_adaptiveload.errors import UserError

PACKAGE = Path(__file__).resolve().parent


def root() -> Path:
    """The folder of the shipped configs: the package's copy when installed, else the checkout's configs/."""
    installed = PACKAGE / "configs"
    return installed if installed.is_dir() else PACKAGE.parent / "configs"


def profile_names() -> list:
    """The shipped profiles' names (file names without .yaml), sorted."""
    folder = root() / "profiles"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def candidates(path: str, near: str = None) -> list:
    """Where a relative `path` is looked for, in order: as given (the working directory), next to the file `near`,
    then in the shipped folder (a leading "configs/" dropped) and its profiles/, each also with ".yaml" added."""
    if os.path.isabs(path):
        return [path]
    out = [path]
    if near:
        out.append(os.path.join(os.path.dirname(os.path.abspath(near)), path))
    rel = path[len("configs/"):] if path.startswith("configs/") else path
    for folder in (root(), root() / "profiles"):
        out += [str(folder / rel), str(folder / (rel + ".yaml"))]
    return out


def find(path: str, near: str = None):
    """The first of candidates() that is a file, or None."""
    return next((c for c in candidates(path, near) if os.path.isfile(c)), None)


def resolve(path: str, what: str, near: str = None) -> str:
    """find(), or a UserError naming `what` (e.g. "--model-config") and the places looked in."""
    found = find(path, near)
    if found is None:
        names = ", ".join(profile_names())
        raise UserError(f"{what} {path!r} not found in the working directory{', next to ' + near if near else ''} "
                        f"or among the shipped configs ({root()}; shipped profiles: {names})")
    return found


def auto_profile(model, zero_stage: int, sp: int, gpu, source: str = "adaptive_load.profile") -> tuple:
    """(path, notes) of adaptive_load.profile "auto": the shipped profile measured for this model on this GPU
    (gpu: (name, capacity bytes), None on a CPU) under this ZeRO stage and Ulysses degree, else the closest one
    (schedule/profile.closest_profile), which the caller then moves to this run's memory (train/setup.py
    profile_for_run). model: a WanConfig or a mapping with its dim, ffn_dim, num_heads and num_layers."""
    from ds_adaptiveload.schedule.profile import MODEL_KEYS, CostProfile, closest_profile, describe

    if model is None:
        raise UserError(f"{source} \"auto\" picks a shipped profile by model, and this model is not a WanModel; "
                        f"set {source} to a cost profile YAML (python -m ds_adaptiveload calibrate writes one)")
    dims = {k: model[k] if isinstance(model, dict) else getattr(model, k) for k in MODEL_KEYS}
    paths = {name: str(root() / "profiles" / f"{name}.yaml") for name in profile_names()}
    profiles = {name: CostProfile.load(p) for name, p in paths.items()}
    device, capacity = gpu if gpu is not None else ("cpu", None)
    name, exact = closest_profile(profiles, dims, device, capacity, zero_stage, sp)
    shape = ", ".join(f"{k} {v}" for k, v in dims.items())
    if name is None:
        raise UserError(f"{source} \"auto\": no shipped profile was measured for this model ({shape}); "
                        f"calibrate one (python -m ds_adaptiveload calibrate, docs/calibration.md) and set {source} "
                        f"to its path")
    run = f"{device}, ZeRO-{zero_stage}, sp={sp}"
    if exact:
        return paths[name], [f"{source} auto: {name} (measured for this run: {run})"]
    return paths[name], [f"{source} auto: no shipped profile for {run}; using the closest, {name} "
                         f"({describe(profiles[name])}), moved to this run as the next lines say"]


def config_profile(json_path, model=None, gpu=None) -> str:
    """The profile a training run of the DeepSpeed JSON `json_path` plans with (before its memory is moved to the
    run): adaptive_load.profile resolved, "auto" for `model` (a WanConfig; default the shipped wan_1_3b.yaml) under
    the JSON's ZeRO stage and sp on `gpu` ((name, capacity); default: the current CUDA device where torch, already
    imported, sees one, else a CPU). For scripts that launch or mimic the trainer (bench/)."""
    import sys

    from ds_adaptiveload.train.config import load_ds_config, zero_stage

    ds, al = load_ds_config(resolve(str(json_path), "DeepSpeed config"))
    if al.profile != "auto":
        return al.resolve_profile(str(json_path))
    if model is None:
        from ds_adaptiveload.model.config import WanConfig

        model = WanConfig.from_yaml(resolve("configs/wan_1_3b.yaml", "model config"))
    torch = sys.modules.get("torch")
    if gpu is None and torch is not None and torch.cuda.is_available():
        from ds_adaptiveload.train.setup import gpu_of

        gpu = gpu_of(torch.device("cuda", torch.cuda.current_device()))
    return auto_profile(model, zero_stage(ds), ds.get("sequence_parallel_size", 1), gpu)[0]
