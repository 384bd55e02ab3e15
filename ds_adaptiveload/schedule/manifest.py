"""Manifest: JSONL, one sample per line with `id`, `frames`, `height`, `width`; other keys are kept.

Errors name the file and line so a user can fix a million-line manifest without bisecting it."""
import json
import unicodedata
from dataclasses import dataclass, field

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import Geometry

REQUIRED = ("id", "frames", "height", "width")
NAMES = ("shard", "latent_key", "text_key")
"""Optional keys of a training manifest (data/latents.py) that name a file or a tensor: non-empty strings."""
LATENT_DTYPES = ("fp32", "fp16", "bf16")
_INTS = {}


@dataclass(slots=True)
class Sample:
    id: str
    frames: int
    height: int
    width: int
    extra: dict = field(default_factory=dict)
    """Every other key of the manifest line (paths, captions, shard names), untouched."""
    line: int = 0
    """1-based line in the manifest, for error messages."""


def parse_line(text: str, path, lineno: int, geometry: Geometry) -> Sample:
    where = f"{path}:{lineno}"
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; nesting deeper than the stack
        raise UserError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}")
    sid = rec["id"]
    if not isinstance(sid, str) or not sid:
        raise UserError(f"{where}: id must be a non-empty string, got {sid!r}")
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in sid):
        # a newline or escape sequence in an id would forge or garble the one-line errors and logs that name it
        raise UserError(f"{where}: id {sid!r} holds a control character")
    for key in NAMES:
        if key in rec and (not isinstance(rec[key], str) or not rec[key]):
            raise UserError(f"{where}: sample {sid!r}: {key} must be a non-empty string, got {rec[key]!r}")
    if "latent_dtype" in rec and rec["latent_dtype"] not in LATENT_DTYPES:
        raise UserError(f"{where}: sample {sid!r}: latent_dtype must be one of {', '.join(LATENT_DTYPES)}, "
                        f"got {rec['latent_dtype']!r}")
    try:
        geometry.check(rec["frames"], rec["height"], rec["width"])
    except ValueError as e:
        raise UserError(f"{where}: sample {sid!r}: {e}") from None
    extra = {k: v for k, v in rec.items() if k not in REQUIRED}
    # Shared int objects per value: a 10M-line manifest has few distinct sizes (memory, see docs).
    f, h, w = (_INTS.setdefault(rec[k], rec[k]) for k in ("frames", "height", "width"))
    return Sample(sid, f, h, w, extra, lineno)


def load_manifest(path, geometry: Geometry = Geometry()) -> list:
    """Read and validate a manifest; duplicate ids are an error naming both lines."""
    samples, seen = [], {}
    try:
        f = open(path, "rb")  # bytes: a bad byte is reported with its line, not as a UnicodeDecodeError
    except OSError as e:
        raise UserError(f"manifest {path}: cannot read: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM (some editors write one)
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                                f"{e.start + 1} of the line)") from None
            if not text.strip():
                continue
            s = parse_line(text, path, lineno, geometry)
            if s.id in seen:
                raise UserError(f"{path}:{lineno}: duplicate id {s.id!r} (first on line {seen[s.id]})")
            seen[s.id] = lineno
            samples.append(s)
    if not samples:
        raise UserError(f"manifest {path}: no samples")
    return samples


def write_manifest(path, samples) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            rec = {"id": s.id, "frames": s.frames, "height": s.height, "width": s.width, **s.extra}
            f.write(json.dumps(rec) + "\n")
