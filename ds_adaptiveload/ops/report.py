"""`python -m ds_adaptiveload report`: state of the fused op (prebuilt / JIT-able / unavailable) and versions,
in the spirit of ds_report. Imports torch/deepspeed inside run() only."""


def add_arguments(parser) -> None:
    """No options of its own (report_cli owns the command's arguments)."""
    return None


def _state() -> list[tuple[str, str]]:
    import torch

    rows = [("torch", f"{torch.__version__} (CUDA {torch.version.cuda})"),
            ("GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible")]
    try:
        import deepspeed

        rows.append(("deepspeed", deepspeed.__version__))
        from ds_adaptiveload.ops.builder import LNModulateBuilder, csrc_dir
    except Exception as err:  # noqa: BLE001
        rows.append(("ln_modulate", f"unavailable: cannot import the op builder ({err})"))
        return rows
    b = LNModulateBuilder()
    from torch.utils.cpp_extension import CUDA_HOME

    try:
        from deepspeed.ops.op_builder.builder import installed_cuda_version

        rows.append(("CUDA_HOME", f"{CUDA_HOME} (nvcc {'.'.join(map(str, installed_cuda_version()))})"))
    except Exception as err:  # noqa: BLE001
        rows.append(("CUDA_HOME", f"{CUDA_HOME} ({err})"))
    try:
        rows.append(("sources", str(csrc_dir())))
    except FileNotFoundError as err:
        rows.append(("sources", f"missing: {err}"))
    if b.prebuilt() is not None:
        state = "prebuilt (DS_BUILD_LN_MODULATE=1 install), will be used"
    elif b.is_compatible(verbose=False):
        try:
            archs = b.arch_list()
        except Exception as err:  # noqa: BLE001
            archs = f"? ({err})"
        state = f"JIT-able: built on first use for {archs} (~1-2 min, cached)"
        if not torch.cuda.is_available():
            state += "; no GPU visible, so the PyTorch implementation runs"
    else:
        state = f"unavailable: {b.error_log}; the PyTorch implementation runs"
    rows.append(("ln_modulate", state))
    return rows


def run(args) -> int:
    rows = _state()
    width = max(len(k) for k, _ in rows)
    print("ds_adaptiveload fused ops")
    for k, v in rows:
        print(f"  {k.ljust(width)} : {v}")
    return 0
