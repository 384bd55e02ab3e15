"""Decode one manifest sample's pixels with PyAV exactly as `manifest` mapped it (scan.py's rules): frames
resampled to the sample's fps by nearest-frame sampling from t = 0, the first `frames` of them, each
resized to cover the bucket (aspect ratio kept) and center-cropped to height x width.

Source frames are addressed by decode order at the source rate the manifest recorded (`source.fps`), the
rule the manifest counted frames with; variable-frame-rate files are treated as constant-rate.
"""
import math

import numpy as np


class DecodeError(Exception):
    """A sample whose pixels cannot be produced; the message is the reason for the errors file."""


def source_indices(frames: int, fps, src_fps) -> list:
    """Source frame index of each output frame: the nearest source frame to t = i / fps."""
    if not fps or not src_fps:
        return list(range(frames))
    step = src_fps / fps
    return [int(math.floor(i * step + 0.5)) for i in range(frames)]


def cover_size(src_h: int, src_w: int, h: int, w: int) -> tuple:
    """(height, width) of the resize that covers h x w keeping the source aspect ratio."""
    scale = max(h / src_h, w / src_w)
    return max(h, round(src_h * scale)), max(w, round(src_w * scale))


def _to_rgb(frame, h: int, w: int) -> np.ndarray:
    """One decoded frame -> uint8 [h, w, 3]: display rotation applied, resized to cover, center-cropped."""
    rot = int(round((getattr(frame, "rotation", 0) or 0) / 90)) % 4  # counter-clockwise quarter turns
    src_h, src_w = (frame.width, frame.height) if rot % 2 else (frame.height, frame.width)
    ch, cw = cover_size(src_h, src_w, h, w)
    rh, rw = (cw, ch) if rot % 2 else (ch, cw)  # resize in the stored orientation, rotate after
    a = frame.reformat(width=rw, height=rh, format="rgb24", interpolation="BICUBIC").to_ndarray()
    if rot:
        a = np.rot90(a, k=rot)
    top, left = (ch - h) // 2, (cw - w) // 2
    return np.ascontiguousarray(a[top:top + h, left:left + w])


def decode_sample(rec: dict) -> np.ndarray:
    """uint8 [frames, height, width, 3] of a manifest line (needs path, frames, height, width; fps and
    source.fps for videos)."""
    import av

    from ds_adaptiveload.data.scan import open_media

    frames, h, w = rec["frames"], rec["height"], rec["width"]
    src_fps = (rec.get("source") or {}).get("fps")
    want = source_indices(frames, rec.get("fps"), src_fps) if rec.get("kind") != "image" else [0]
    last = want[-1]
    out = [None] * len(want)
    pos, decoded = 0, 0  # next output frame to fill (`want` is non-decreasing), source frames decoded
    broken = ""
    try:
        container = open_media(rec["path"])
    except (av.error.FFmpegError, OSError) as e:
        raise DecodeError(f"cannot open: {getattr(e, 'strerror', None) or e}") from None
    with container:
        if not container.streams.video:
            raise DecodeError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for j, frame in enumerate(container.decode(stream)):
                decoded = j + 1
                if j == want[pos]:
                    rgb = _to_rgb(frame, h, w)
                    while pos < len(want) and want[pos] == j:
                        out[pos] = rgb
                        pos += 1
                if pos == len(want):
                    break
        except av.error.FFmpegError as e:  # mid-stream: keep what decoded, judged below
            broken = f" (decoding stopped: {e})"
    if pos < len(want):
        # Containers round their frame counts (scan --verify end allows 1.5 frames); repeat the last
        # decoded frame over such a gap, fail on a longer one.
        if pos == 0 or last + 1 - decoded > 2:
            raise DecodeError(f"decodes {decoded} source frames, the manifest's {frames} frames at "
                              f"{rec.get('fps')} fps need {last + 1}{broken}")
        out[pos:] = [out[pos - 1]] * (len(want) - pos)
    return np.stack(out)


def to_model_input(pixels: np.ndarray):
    """uint8 [F, H, W, 3] -> float32 tensor [3, F, H, W] in [-1, 1] (what the Wan VAE encodes)."""
    import torch

    x = torch.from_numpy(pixels).permute(3, 0, 1, 2).float()
    return x.div_(127.5).sub_(1.0)
