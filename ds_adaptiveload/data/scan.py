"""`python -m ds_adaptiveload manifest DIR --out manifest.jsonl`: walk a folder of videos and images, read
each file's metadata with PyAV and write one manifest line per file with the shape training will see.

Mapping rules (docs/dataset.md has the worked examples):
- time: the clip is resampled to --fps by nearest-frame sampling from t=0 (frames are repeated when the
  source is slower), so it offers floor(duration * fps) frames, duration = source frames / source fps;
  training takes the longest 4n+1 that fits and is <= --max-frames. Images give 1 frame.
- space: one bucket from BUCKET_TIERS: the tier nearest the source area (log scale) among tiers whose
  area is <= --max-area, then the bucket of that tier nearest the source aspect ratio (log scale).
  Training resizes to cover the bucket, keeping the aspect ratio, and center-crops.

Captions: a sidecar `<stem>.txt` next to each file (as musubi-tuner reads them), or --captions FILE (CSV
`path,caption` or JSONL `{path, caption}`); a file without one goes to the errors file unless
--allow-empty-caption.

Nothing is skipped without a word: symlinked folders are followed (each real folder once, so a link loop
ends), and an unreadable folder, a repeated folder, an empty file and an animated WebP (FFmpeg cannot
decode one) each get a line in the errors file.

The output is appended and flushed line by line, so a killed run resumes where it stopped: files whose
id is already in the output or in the errors file are skipped.
"""
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

VIDEO_EXTS = {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".mts", ".flv",
              ".wmv", ".gif", ".ogv", ".3gp"}
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}

# Spatial buckets, (height, width), all multiples of 16. One tier per resolution; the first bucket of a
# tier gives the tier's nominal area (480p and 720p are Wan 2.1's training sizes). Few shapes per tier
# keep micro-batches shape-uniform; the 240p tier exists for small sources and thumbnails.
BUCKET_TIERS = (
    ("240p", ((240, 416), (416, 240), (272, 368), (368, 272), (320, 320))),
    ("480p", ((480, 832), (832, 480), (544, 720), (720, 544), (624, 624))),
    ("720p", ((720, 1280), (1280, 720), (832, 1104), (1104, 832), (960, 960))),
)


@dataclass(frozen=True)
class MapConfig:
    """How a source file maps to the sample training sees."""
    fps: float = 16.0
    """Target frame rate (Wan 2.1 trains at 16). 0 keeps each video's own rate."""
    max_frames: int = 81
    """Longest clip in frames; must be 4n+1 (the VAE's 4x temporal stride plus the first frame)."""
    max_area: int = 480 * 832
    """Largest bucket area in pixels; tiers above it are not used (921600 allows 720p)."""


def longest_4n1(n: int) -> int:
    """Largest 4k+1 <= n, or 0 when n < 1."""
    return (n - 1) // 4 * 4 + 1 if n >= 1 else 0


def resampled_frames(src_frames: int, src_fps: float, fps: float) -> int:
    """Frames a clip of src_frames at src_fps offers at fps (nearest-frame sampling from t=0)."""
    if fps <= 0:
        return src_frames
    # The epsilon absorbs float error when the rates divide exactly (81 frames at 16 fps -> 81).
    return int(math.floor(src_frames * fps / src_fps + 1e-6))


def target_frames(src_frames: int, src_fps: float, cfg: MapConfig) -> int:
    """Frames training sees; 0 means the clip is too short for even one frame at cfg.fps."""
    return longest_4n1(min(resampled_frames(src_frames, src_fps, cfg.fps), cfg.max_frames))


def target_size(src_h: int, src_w: int, cfg: MapConfig) -> tuple:
    """(height, width) bucket for a source of src_h x src_w pixels; see BUCKET_TIERS."""
    tiers = [b for _, b in BUCKET_TIERS if b[0][0] * b[0][1] <= cfg.max_area]
    log_area = math.log(src_h * src_w)
    buckets = min(tiers, key=lambda b: abs(math.log(b[0][0] * b[0][1]) - log_area))
    log_ar = math.log(src_w / src_h)
    return min(buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - log_ar))


def check_config(cfg: MapConfig) -> None:
    from ds_adaptiveload.errors import UserError
    if cfg.fps < 0:
        raise UserError(f"--fps {cfg.fps}: must be >= 0 (0 keeps the source rate)")
    if cfg.max_frames < 1 or cfg.max_frames % 4 != 1:
        raise UserError(f"--max-frames {cfg.max_frames}: must be 4n+1 (1, 5, ..., 81)")
    smallest = min(b[0][0] * b[0][1] for _, b in BUCKET_TIERS)
    if cfg.max_area < smallest:
        raise UserError(f"--max-area {cfg.max_area}: below the smallest bucket tier ({smallest} px)")


class ProbeError(Exception):
    """A file that cannot be used; the message is the reason written to the errors file."""


def _err(e) -> str:
    return getattr(e, "strerror", None) or str(e)


def open_media(path: str):
    """av.open, ignoring undecodable metadata where this PyAV takes `metadata_errors` (PyAV 19 dropped it)."""
    import av
    try:
        return av.open(path, metadata_errors="ignore")
    except TypeError:
        return av.open(path)


def probe(path: str, kind: str, verify: str = "end") -> dict:
    """Metadata of one file without decoding every frame.

    Frame count, in order of preference (recorded as `frames_from`): the container's count
    (`container`), duration * average frame rate (`duration`), or decoding every frame (`decode`: when
    the container gives neither, or with verify='full').
    verify: 'first' decodes the first frame; 'end' also seeks to the last claimed frame and decodes up
    to it (one GOP), which catches files cut short after their headers; 'full' decodes every frame."""
    import av
    try:
        container = open_media(path)
    except av.error.FFmpegError as e:
        raise ProbeError(f"cannot open: {_err(e)}") from None
    with container:
        if not container.streams.video:
            raise ProbeError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        codec = stream.codec_context.name
        decoded = container.decode(stream)  # one generator: 'full' keeps counting from here
        try:
            first = next(decoded, None)
        except av.error.FFmpegError as e:
            raise ProbeError(f"cannot decode the first frame: {_err(e)}") from None
        if first is None:
            raise ProbeError("no decodable frame")
        width, height = first.width, first.height
        # Phone videos store a display rotation; training sees the rotated picture.
        if abs(getattr(first, "rotation", 0) or 0) in (90, 270):
            width, height = height, width
        if kind == "image":
            return dict(frames=1, fps=None, width=width, height=height, duration=None, codec=codec,
                        frames_from="image")

        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        if stream.duration is not None and stream.time_base:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / av.time_base
        else:
            duration = 0.0
        if stream.frames > 0:
            claimed, frames_from = stream.frames, "container"
        elif duration > 0 and fps > 0:
            claimed, frames_from = int(round(duration * fps)), "duration"
        else:
            claimed, frames_from = 0, "decode"

        frames = claimed
        try:
            if verify == "full" or frames_from == "decode":
                frames, frames_from = 1 + sum(1 for _ in decoded), "decode"
                # Containers round durations; a shortfall beyond that means lost data.
                if claimed and frames < 0.95 * claimed - 1:
                    raise ProbeError(f"truncated: the container claims {claimed} frames, {frames} decode")
            elif verify == "end" and fps > 0 and claimed > 1:
                t0 = first.time or 0.0
                want = t0 + (claimed - 1) / fps - 1.5 / fps  # tolerance for rounded durations
                stream_end = _decode_until(container, stream, want)
                if stream_end is not None:
                    raise ProbeError(f"truncated: the container claims {claimed} frames "
                                     f"({claimed / fps:.2f} s), decoding stops at {stream_end - t0:.2f} s")
        except av.error.FFmpegError as e:
            raise ProbeError(f"decode failed: {_err(e)}") from None
        if fps <= 0:
            if duration <= 0:
                raise ProbeError("frame rate unknown (no rate and no duration in the container)")
            fps = frames / duration
        if duration <= 0:
            duration = frames / fps
        return dict(frames=int(frames), fps=round(fps, 6), width=width, height=height,
                    duration=round(duration, 6), codec=codec, frames_from=frames_from)


def _decode_until(container, stream, t: float):
    """Seek to the keyframe before time t (seconds) and decode up to t. None when a frame at or after
    t decodes, else the time of the last frame decoded (the stream ends early)."""
    import av
    container.seek(max(0, int(t / stream.time_base)), stream=stream, backward=True)
    last = 0.0
    try:
        for frame in container.decode(stream):
            if frame.time is None:
                continue
            if frame.time >= t:
                return None
            last = frame.time
    except av.error.EOFError:  # some decoders report the drained end as an error
        pass
    return last


@dataclass(frozen=True)
class Task:
    """One file for a worker."""
    path: str
    id: str
    kind: str
    cfg: MapConfig
    verify: str
    captions: str = "sidecar"
    """'sidecar': read <stem>.txt next to the file; 'file': `caption` comes from --captions FILE."""
    caption: str = None
    allow_empty: bool = False


def _animated_webp(path: str) -> bool:
    """RIFF/WEBP with a VP8X chunk whose animation flag (bit 1) is set."""
    with open(path, "rb") as f:
        head = f.read(21)
    return len(head) == 21 and head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8X" and bool(head[20] & 2)


def find_caption(task: Task) -> str:
    """The caption of a file, '' when it has none and empty ones are allowed; else ProbeError."""
    if task.captions == "file":
        text, why = task.caption, "no line for it in --captions" if task.caption is None else "empty in --captions"
    else:
        side = os.path.splitext(task.path)[0] + ".txt"
        name = os.path.basename(side)
        try:
            with open(side, encoding="utf-8") as f:
                text, why = f.read(), f"{name} is empty"
        except FileNotFoundError:
            text, why = None, f"no sidecar {name}"
        except UnicodeDecodeError:
            raise ProbeError(f"caption {name} is not UTF-8 text") from None
    text = (text or "").strip()
    if not text and not task.allow_empty:
        raise ProbeError(f"no caption ({why}); write one, or pass --allow-empty-caption")
    return text


def scan_one(task: Task):
    """Worker: Task -> ('ok', manifest record) or ('error', entry). Never raises, so one bad file cannot
    stop the run."""
    path, sid, kind, cfg, verify = task.path, task.id, task.kind, task.cfg, task.verify
    try:
        if os.path.getsize(path) == 0:
            raise ProbeError("empty file (0 bytes)")
        if path.lower().endswith(".webp") and _animated_webp(path):
            raise ProbeError("animated WebP is not supported (FFmpeg cannot decode it); convert it to a "
                             "video, e.g. with Pillow or libwebp's anim_dump")
        src = probe(path, kind, verify)
        if kind == "image":
            frames = 1
        else:
            frames = target_frames(src["frames"], src["fps"], cfg)
            if frames < 1:
                raise ProbeError(f"too short: {src['frames']} frames at {src['fps']:g} fps give no frame "
                                 f"at {cfg.fps:g} fps")
        height, width = target_size(src["height"], src["width"], cfg)
        fps = None if kind == "image" else (cfg.fps or src["fps"])
        caption = find_caption(task)
        return "ok", dict(id=sid, frames=frames, height=height, width=width, fps=fps, kind=kind,
                          path=path, caption=caption, source=src)
    except ProbeError as e:
        reason = str(e)
    except Exception as e:  # a decoder or OS error specific to this file: record it, keep going
        reason = f"{type(e).__name__}: {e}"
    return "error", dict(id=sid, path=path, reason=reason)


def find_media(root: str):
    """(media, problems): sorted (path, id, kind) of media files under root, id being the POSIX path
    relative to root, and {id, path, reason} for each folder that was not scanned. Hidden files and
    folders are skipped, so are files without a media extension. Symlinked folders are followed; each
    real folder is scanned once (the first path in sorted order), which also ends a link loop."""
    found, problems = [], []

    def rel(path):
        return os.path.relpath(path, root).replace(os.sep, "/")

    def unreadable(e):
        problems.append(dict(id=rel(e.filename), path=e.filename, reason=f"cannot read folder: {_err(e)}"))

    st = os.stat(root)
    seen = {(st.st_dev, st.st_ino): "."}  # real folder -> the id it is scanned under
    for d, dirs, files in os.walk(root, onerror=unreadable, followlinks=True):
        keep = []
        for x in sorted(x for x in dirs if not x.startswith(".")):
            path = os.path.join(d, x)
            try:
                st = os.stat(path)
            except OSError as e:  # a link whose target vanished between listing and stat
                problems.append(dict(id=rel(path), path=path, reason=f"cannot read folder: {_err(e)}"))
                continue
            first = seen.setdefault((st.st_dev, st.st_ino), rel(path))
            if first != rel(path):
                problems.append(dict(id=rel(path), path=path, reason=f"symlinked folder already scanned as "
                                     f"{first!r} (links to {os.path.realpath(path)}); skipped"))
                continue
            keep.append(x)
        dirs[:] = keep
        for name in files:
            ext = os.path.splitext(name)[1].lower()
            kind = "video" if ext in VIDEO_EXTS else "image" if ext in IMAGE_EXTS else None
            if kind and not name.startswith("."):
                path = os.path.join(d, name)
                found.append((path, rel(path), kind))
    found.sort(key=lambda t: t[1])
    problems.sort(key=lambda p: p["id"])
    return found, problems


def load_captions(path: str, root: str) -> dict:
    """--captions FILE -> {sample id: caption}. CSV with a header row naming `path` and `caption`, or JSONL
    of {"path", "caption"}; path is relative to the scanned folder (the sample id) or absolute."""
    import csv

    from ds_adaptiveload.errors import UserError
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".csv", ".jsonl", ".json"):
        raise UserError(f"--captions {path}: expected a .csv or .jsonl file")
    try:
        f = open(path, encoding="utf-8", newline="")
    except OSError as e:
        raise UserError(f"--captions {path}: cannot read: {_err(e)}") from None
    out, first_line = {}, {}
    with f:
        if ext == ".csv":
            reader = csv.DictReader(f)
            missing = {"path", "caption"} - set(reader.fieldnames or ())
            if missing:
                raise UserError(f"{path}:1: the header needs the column(s) {', '.join(sorted(missing))}")
            rows = ((reader.line_num, r) for r in reader)
        else:
            rows = ((n, _json_row(line, path, n)) for n, line in enumerate(f, 1) if line.strip())
        for lineno, r in rows:
            if not isinstance(r.get("path"), str) or not isinstance(r.get("caption"), str):
                raise UserError(f"{path}:{lineno}: needs a string `path` and a string `caption`")
            p = r["path"]
            sid = os.path.relpath(p, root).replace(os.sep, "/") if os.path.isabs(p) else p.replace(os.sep, "/")
            if sid in out:
                raise UserError(f"{path}:{lineno}: second caption for {sid!r} (first on line {first_line[sid]})")
            out[sid], first_line[sid] = r["caption"], lineno
    return out


def _json_row(line, path, lineno):
    from ds_adaptiveload.errors import UserError
    try:
        r = json.loads(line)
    except ValueError as e:
        raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
    if not isinstance(r, dict):
        raise UserError(f"{path}:{lineno}: expected a JSON object")
    return r


def _read_ids(path: str) -> set:
    """Ids already in a JSONL file. A torn last line (the run was killed mid-write) is cut off."""
    from ds_adaptiveload.errors import UserError
    ids = set()
    if not os.path.exists(path):
        return ids
    with open(path, "rb+") as f:
        data = f.read()
        good = 0  # byte offset after the last complete, parseable line
        for lineno, line in enumerate(data.splitlines(keepends=True), 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline at the end")
                sid = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError) as e:
                if good + len(line) == len(data):
                    f.truncate(good)  # torn last line: drop it, that file is scanned again
                    break
                raise UserError(f"{path}:{lineno}: not a manifest line ({e}); use a new --out") from None
            ids.add(sid)
            good += len(line)
    return ids


def add_arguments(parser):
    parser.add_argument("dir", help="folder with videos and images (searched recursively)")
    parser.add_argument("--out", required=True, help="manifest to write (JSONL); appended to when it exists")
    parser.add_argument("--fps", type=float, default=16.0, help="target frame rate (default 16, as Wan "
                        "2.1); 0 keeps each video's rate")
    parser.add_argument("--max-frames", type=int, default=81, help="longest clip, 4n+1 (default 81)")
    parser.add_argument("--max-area", type=int, default=480 * 832,
                        help="largest bucket area in pixels (default 399360 = 480x832; 921600 allows 720p)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="probe processes (default: all cores)")
    parser.add_argument("--verify", choices=("first", "end", "full"), default="end",
                        help="first: decode the first frame; end (default): also seek to the last frame "
                        "and decode it, catching files cut short; full: decode and count every frame")
    parser.add_argument("--captions", help="CSV (path,caption) or JSONL ({path, caption}) of captions, path "
                        "relative to DIR or absolute; default: a sidecar <stem>.txt next to each file")
    parser.add_argument("--allow-empty-caption", action="store_true",
                        help="keep files without a caption (caption \"\") instead of listing them as errors")


def run(args) -> int:
    from tqdm import tqdm

    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.schedule.geometry import Geometry

    cfg = MapConfig(fps=args.fps, max_frames=args.max_frames, max_area=args.max_area)
    check_config(cfg)
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be >= 1")
    if not os.path.isdir(args.dir):
        raise UserError(f"{args.dir}: not a folder")
    root = os.path.abspath(args.dir)
    out, errors_path, params_path = args.out, args.out + ".errors.jsonl", args.out + ".scan.json"

    # Resuming with other mapping settings would mix two mappings in one manifest.
    params = dict(root=root, verify=args.verify, **asdict(cfg))
    if os.path.exists(params_path):
        with open(params_path) as f:
            old = json.load(f)
        # --verify only changes how strictly files are checked, not the mapping: allowed to differ.
        diff = {k: (old.get(k), v) for k, v in params.items() if old.get(k) != v and k != "verify"}
        if diff and os.path.exists(out):
            raise UserError(f"{out} was written with other settings ({params_path}): " + ", ".join(
                f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()) + "; use a new --out")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(params_path, "w") as f:
        json.dump(params, f, indent=1)

    done = _read_ids(out) | _read_ids(errors_path)
    captions = load_captions(args.captions, root) if args.captions else None
    media, problems = find_media(root)
    todo = [Task(p, sid, kind, cfg, args.verify, "file" if captions is not None else "sidecar",
                 captions.get(sid) if captions is not None else None, args.allow_empty_caption)
            for p, sid, kind in media if sid not in done]
    geometry = Geometry()
    n_ok = n_err = 0
    t0 = time.perf_counter()
    with open(out, "a") as fout, open(errors_path, "a") as ferr:
        for p in problems:  # folders not scanned: listed first, once
            if p["id"] not in done:
                ferr.write(json.dumps(p) + "\n")
                n_err += 1
        ferr.flush()
        pool = None
        if args.workers > 1 and len(todo) > 1:
            import multiprocessing
            # spawn, not fork: a forked worker inherits the locks of the caller's other threads and its signal
            # handlers, and one that ignored pool.terminate's SIGTERM hung a test run in pool.join for 20 min
            # (2026-12-07, the pytest process had run cli.main). A fresh interpreter imports only this module;
            # `python -m ds_adaptiveload` is not re-run (multiprocessing skips a package's __main__), and a
            # script that calls run() needs the usual `if __name__ == "__main__":` guard.
            pool = multiprocessing.get_context("spawn").Pool(min(args.workers, len(todo)))
            # Ordered results: the manifest (and so every plan index) is the same however many workers.
            chunk = max(1, min(16, len(todo) // (args.workers * 8)))
            results = pool.imap(scan_one, todo, chunksize=chunk)
        else:
            results = map(scan_one, todo)
        try:
            for status, rec in tqdm(results, total=len(todo), unit="file", desc="scan", disable=None):
                if status == "ok":
                    try:
                        geometry.check(rec["frames"], rec["height"], rec["width"])
                    except ValueError as e:  # a mapping bug, not the file's fault; keep the file listed
                        status, rec = "error", dict(id=rec["id"], path=rec["path"], reason=f"geometry: {e}")
                f = fout if status == "ok" else ferr
                f.write(json.dumps(rec) + "\n")
                f.flush()
                n_ok += status == "ok"
                n_err += status != "ok"
        finally:
            if pool is not None:
                pool.terminate()
    dt = time.perf_counter() - t0
    rate = len(todo) / dt if dt > 0 and todo else 0.0
    print(f"{out}: {n_ok} new samples, {n_err} errors ({errors_path}), {len(media) - len(todo)} already "
          f"done, {len(todo)} files in {dt:.1f} s ({rate:.1f} files/s)", file=sys.stderr)
    return 0
