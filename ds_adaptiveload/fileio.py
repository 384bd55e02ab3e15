"""Reading config files with errors that name the file (and line) instead of a traceback."""
import functools
import json

from ds_adaptiveload.errors import UserError


class _DuplicateKey(Exception):
    def __init__(self, key, first=None, line=None):
        super().__init__(key)
        self.key, self.first, self.line = key, first, line


def _unique_pairs(pairs) -> dict:
    """json's object_pairs_hook: a key given twice is refused (json keeps the last one silently; DeepSpeed refuses
    it when it reads the file itself)."""
    doc = {}
    for key, value in pairs:
        if key in doc:
            raise _DuplicateKey(key)
        doc[key] = value
    return doc


def read_json_object(path, what: str) -> dict:
    """A JSON file whose top level is an object; `what` names it in errors ("DeepSpeed config")."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading BOM is accepted
            doc = json.load(f, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as e:
        raise UserError(f"{path}: key {e.key!r} is given twice in one object") from None
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


@functools.cache
def _unique_key_loader():
    """yaml.SafeLoader refusing a mapping key given twice, which PyYAML resolves silently by keeping the last (a
    `dim:` written twice in a model config). A merge (`<<: *base`) may still override merged keys."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                    try:
                        if key in seen:
                            raise _DuplicateKey(key, seen[key], line)
                        seen[key] = line
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read_yaml(path, what: str):
    import yaml

    try:
        with open(path, "rb") as f:  # bytes: PyYAML detects a BOM and reports a bad byte as a YAMLError
            return yaml.load(f, Loader=_unique_key_loader())
    except _DuplicateKey as e:
        raise UserError(f"{path}:{e.line}: duplicate key {e.key!r} (first on line {e.first})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise UserError(f"{path}: invalid YAML (nested too deeply)") from None
