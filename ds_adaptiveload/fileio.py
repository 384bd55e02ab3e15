"""Reading config files with errors that name the file (and line, for JSON) instead of a traceback."""
import json

from ds_adaptiveload.errors import UserError


def read_json_object(path, what: str) -> dict:
    """A JSON file whose top level is an object; `what` names it in errors ("DeepSpeed config")."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading BOM is accepted
            doc = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except (ValueError, RecursionError) as e:  # huge integers, deep nesting
        raise UserError(f"{path}: invalid JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object")
    return doc


def read_yaml(path, what: str):
    import yaml

    try:
        with open(path, "rb") as f:  # bytes: PyYAML detects a BOM and reports a bad byte as a YAMLError
            return yaml.safe_load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise UserError(f"{path}: invalid YAML (nested too deeply)") from None
