"""--profile-steps A-B: how much of a training step the GPU is busy, from its kernel and copy timeline (CUPTI
through torch.profiler), written into the step log as gpu_busy_ms and gpu_busy_frac; the rest of the step's wall
time the GPU waits on the host (Python, launches, data, ZeRO's bookkeeping) or on other ranks."""
import json
import logging
import os
import warnings

log = logging.getLogger(__name__)

# Chrome-trace categories of work on the GPU itself (kernels and the copies and fills between launches).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def add_arguments(p) -> None:
    p.add_argument("--profile-steps", metavar="A-B", default=None,
                   help="on CUDA, record the GPU timeline of steps A to B (1-based, e.g. 4-6) and log the share of "
                        "each step's wall time the GPU is busy (gpu_busy_frac in the step log; traces in "
                        "OUTPUT/profile/)")


def parse_range(text):
    """'4-6' -> (4, 6); '5' -> (5, 5); None -> None. UserError naming the flag otherwise."""
    from ds_adaptiveload.errors import UserError

    if text is None:
        return None
    a, dash, b = str(text).partition("-")
    try:
        lo, hi = int(a), int(b if dash else a)
    except ValueError:
        lo = hi = 0
    if lo < 1 or hi < lo:
        raise UserError(f"--profile-steps {text}: expected A-B with 1 <= A <= B (1-based step numbers), e.g. 4-6")
    return lo, hi


def union_ms(intervals) -> float:
    """Total length of the union of [start, end) intervals in microseconds, in ms: overlapping kernels (streams
    running side by side) count once."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def gpu_intervals(trace: dict) -> list:
    """[(start_us, end_us)] of the GPU's kernels, copies and fills in a Chrome trace (torch.profiler's export)."""
    return [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))) for ev in trace.get("traceEvents", ())
            if ev.get("ph") == "X" and ev.get("cat") in GPU_CATEGORIES]


class StepProfile:
    """Per step in the range: start() before the step's clock starts, stop() after it ends (both synchronized by
    the trainer). Does nothing outside the range, and nothing but one note on a device other than CUDA."""

    def __init__(self, args, device, output, rank):
        self.range = parse_range(getattr(args, "profile_steps", None))
        self.folder = os.path.join(output, "profile")
        self.rank, self.prof = rank, None
        if self.range and device.type != "cuda":
            if rank == 0:
                log.warning("--profile-steps: the GPU timeline needs CUDA; this run is on %s, so nothing is "
                            "recorded", device.type)
            self.range = None

    def start(self, step: int) -> None:
        """step: 0-based, as the trainer's loop counts."""
        if not self.range or not self.range[0] <= step + 1 <= self.range[1]:
            return
        from torch.profiler import ProfilerActivity, profile

        # GPU activity only: recording every CPU op would slow the host and inflate what is measured
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one window per step is the intent
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()

    def stop(self, step: int, step_s: float) -> dict:
        """The step's gpu_busy_ms and gpu_busy_frac (of step_s), its trace kept in OUTPUT/profile/; {} when not
        profiled."""
        if self.prof is None:
            return {}
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"step{step + 1}-rank{self.rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        busy = union_ms(gpu_intervals(trace))
        frac = busy / (step_s * 1000.0) if step_s > 0 else 0.0
        if self.rank == 0:
            log.info("step %d: GPU busy %.1f%% of %.0f ms (%.0f ms of kernels and copies); trace %s",
                     step + 1, 100 * frac, step_s * 1000, busy, path)
        return {"gpu_busy_ms": round(busy, 1), "gpu_busy_frac": round(frac, 4)}
