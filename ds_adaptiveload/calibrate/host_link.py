"""Host-link calibration: pinned host <-> device copy bandwidth, what activation offload moves block inputs over
(memory.host_link_bytes_per_s, schedule/offload.py). CUDA only; on the CPU there is no link to measure."""
import logging
import statistics

logger = logging.getLogger(__name__)

SIZES = (16 << 20, 64 << 20, 256 << 20)  # bytes: from a short clip's block input up to a 720p clip's (1.3B model)
REPEATS = 5  # timed copies per size and direction, after one untimed


def cuda_copy_seconds(device):
    """(direction, nbytes) -> seconds of one copy of nbytes between a pinned host buffer and `device`, direction
    "d2h" or "h2d", timed with CUDA events on the current stream (what the side stream's copies contend with)."""
    import torch

    buffers = {}

    def seconds(direction, nbytes):
        if nbytes not in buffers:
            buffers.clear()  # one size at a time: at most 2 x 256 MiB held
            buffers[nbytes] = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                               torch.empty(nbytes, dtype=torch.uint8, device=device))
        host, dev = buffers[nbytes]
        src, dst = (dev, host) if direction == "d2h" else (host, dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return seconds


def measure(copy_seconds, sizes=SIZES, repeats=REPEATS) -> dict:
    """{"bytes_per_s": the slower direction's median over sizes, "d2h"/"h2d": {size: median bytes/s}}: every size
    copied once untimed, then `repeats` timed copies each way; a block input goes out and comes back, so the
    slower direction is the link the model plans with."""
    out = {}
    for direction in ("d2h", "h2d"):
        rates = {}
        for size in sizes:
            copy_seconds(direction, size)  # warm-up: the first copy maps the buffer
            rates[size] = statistics.median(size / copy_seconds(direction, size) for _ in range(repeats))
        out[direction] = rates
    out["bytes_per_s"] = min(statistics.median(out[d].values()) for d in ("d2h", "h2d"))
    return out


def host_link_fields(device, copy_seconds=None):
    """What calibrate writes of the host link: {"memory": {"host_link_bytes_per_s": ...}, "fit": the per-size
    medians} on CUDA; on another device nothing measured ({"memory": {}, "fit": "skipped: ..."}), said in a log
    line, and the planner keeps its default (schedule/offload.DEFAULT_HOST_LINK_BYTES_PER_S)."""
    if device.type != "cuda":
        note = f"skipped: no pinned host memory link to measure on {device.type}"
        logger.info(f"host link: {note}; the profile leaves memory.host_link_bytes_per_s out (the planner's default)")
        return {"memory": {}, "fit": note}
    got = measure(copy_seconds or cuda_copy_seconds(device))
    bps = float(f"{got['bytes_per_s']:.4g}")
    logger.info(f"host link: {bps / 1e9:.1f} GB/s pinned host <-> device (the slower direction's median)")
    fit = {d: {f"{s >> 20}MiB": round(r / 1e9, 2) for s, r in got[d].items()} for d in ("d2h", "h2d")}
    return {"memory": {"host_link_bytes_per_s": bps}, "fit": {"gb_per_s": fit, "repeats": REPEATS}}
