"""Reading config files with errors that name the file (and line, for JSON) instead of a traceback."""
import json

from ds_adaptiveload.errors import UserError


def read_json_object(path, what: str) -> dict:
    """A JSON file whose top level is an object; `what` names it in errors ("DeepSpeed config")."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object")
    return doc


def read_yaml(path, what: str):
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML ({e})") from None
