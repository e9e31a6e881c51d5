"""A JSON schema checked before the grammar engine sees it, with errors in the schema's own terms.

The engine compiles a schema into a grammar lazily, so some schemas it takes can never give a
whole answer: a required property that refers back to the schema itself (every answer would nest
without end) or a `$ref` that refers to itself. Decoding would force tokens without end or find
nothing to allow. These are found here, as are nesting too deep for the engine (or Python) to
walk and bounds that no value meets, and each is reported by the path of the property at fault.
"""

import json
from typing import Any, Dict, List, Optional, Tuple

from ..errors import DFlashError

# Nesting of the schema's JSON, in objects and arrays. Real schemas (agents' tools, extraction
# formats) stay within a few dozen levels; the engine walks a schema recursively and refuses a few
# hundred levels with its own error, and Python's json module a thousand with a RecursionError.
MAX_DEPTH = 100

# Pairs of keywords whose first may not exceed its second.
BOUNDS = (("minimum", "maximum"), ("exclusiveMinimum", "maximum"), ("minimum", "exclusiveMaximum"),
          ("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties")
ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "contains")


def parse(text: str, what: str = "The JSON schema") -> Any:
    """A schema's JSON text as a value, its nesting checked before Python's parser recurses into it."""
    if depth(text) > MAX_DEPTH:
        raise _too_deep(what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DFlashError(f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix it.") from None


def _too_deep(what: str) -> DFlashError:
    return DFlashError(f"{what} nests objects and arrays more than {MAX_DEPTH} levels deep; flatten it, or name "
                       "repeated parts in $defs and $ref them.")


def value_depth(value: Any) -> int:
    """How deep a JSON value's objects and arrays nest, walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, level = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:  # deeper is refused whatever lies below
                todo.extend((c, level + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (brackets inside strings not counted)."""
    deepest = level = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            level += 1
            deepest = max(deepest, level)
        elif c in "]}":
            level -= 1
    return deepest


def check(schema: Any, what: str = "The JSON schema") -> None:
    """Refuse (DFlashError) a schema nested too deep, one whose `$ref`s do not resolve or loop, one
    with bounds no value meets, and one that no finite JSON value satisfies; `what` names it in the
    message (e.g. "The parameters of tool 'search'")."""
    if isinstance(schema, bool):
        if not schema:
            raise DFlashError(f"{what} is `false`, which no value satisfies; give an object schema.")
        return
    if not isinstance(schema, dict):
        raise DFlashError(f"{what} must be a JSON object (got {type(schema).__name__}).")
    if value_depth(schema) > MAX_DEPTH:
        raise _too_deep(what)
    nodes = _walk(schema)
    for path, node in nodes:
        _check_bounds(node, path, what)
    finite = _finite(schema, nodes, what)
    if not finite[id(schema)]:
        raise DFlashError(f"{what} has no finite answer: {_why(schema, finite, what)}.")


def _walk(schema: dict) -> List[Tuple[str, dict]]:
    """Every subschema (object) with its path (the nesting is bounded: `value_depth`)."""
    out, todo = [], [("#", schema)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, dict):
            out.append((path, node))
            todo.extend((f"{path}/{key}", child) for key, child in _children(node))
    return out


def _children(node: dict):
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield f"{key}/{name}", child
    for key in ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                "additionalItems", "unevaluatedProperties", "unevaluatedItems"):
        if isinstance(node.get(key), (dict, bool)):
            yield key, node[key]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield f"{key}/{i}", child
    if isinstance(node.get("items"), list):  # draft-04 tuple items
        for i, child in enumerate(node["items"]):
            yield f"items/{i}", child


def _check_bounds(node: dict, path: str, what: str) -> None:
    for low, high in BOUNDS:
        a, b = node.get(low), node.get(high)
        if _number(a) and _number(b) and (a > b or (a == b and (low.startswith("exclusive")
                                                                or high.startswith("exclusive")))):
            raise DFlashError(f"{what} has {low} {a} above {high} {b} for {_where(path)}: no value meets both.")
    for key in ("enum", "anyOf", "oneOf"):
        if key in node and node[key] == []:
            raise DFlashError(f"{what} has an empty {key} for {_where(path)}: no value satisfies it.")
    kinds = node.get("type")
    known = {"object", "array", "string", "number", "integer", "boolean", "null"}
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in known:
            raise DFlashError(f"{what} has an unknown type {kind!r} for {_where(path)}; use one of "
                              f"{', '.join(sorted(known))}.")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _where(path: str) -> str:
    """A path for people: 'the schema itself', or 'property address.city' where it is one."""
    if path == "#":
        return "the schema itself"
    parts = path[2:].split("/")
    names = []
    for i in range(0, len(parts) - 1, 2):
        if parts[i] != "properties":
            return f"'{path}'"
        names.append(parts[i + 1])
    return f"property '{'.'.join(names)}'" if len(names) * 2 == len(parts) else f"'{path}'"


def _resolve(root: dict, ref: Any, what: str) -> Optional[dict]:
    """A local `$ref`'s schema ('#', '#/$defs/x', any JSON pointer into the schema); None for a
    reference the engine resolves itself (another document)."""
    if not isinstance(ref, str):
        raise DFlashError(f"{what} has a $ref that is not a string ({ref!r}).")
    if ref != "#" and not ref.startswith("#/"):
        return None  # another document, or an anchor ("#name"): the engine resolves it
    node: Any = root
    for part in (p for p in ref[1:].split("/") if p):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise DFlashError(f"{what} has a $ref {ref!r} that points at nothing in the schema.")
    if isinstance(node, bool):
        return {} if node else {"not": {}}
    if not isinstance(node, dict):
        raise DFlashError(f"{what} has a $ref {ref!r} that points at a {type(node).__name__}, not a schema.")
    return node


def _types(node: dict) -> List[str]:
    """The types a value of `node` may have, as the engine reads it (object keywords alone mean an
    object, array keywords an array)."""
    kinds = node.get("type")
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, list):
        return [k for k in kinds if isinstance(k, str)]
    if any(k in node for k in OBJECT_KEYWORDS):
        return ["object"]
    if any(k in node for k in ARRAY_KEYWORDS):
        return ["array"]
    return ["any"]


def _finite(root: dict, nodes: List[Tuple[str, dict]], what: str) -> Dict[int, bool]:
    """Whether each subschema has a finite value: the least fixed point, so that a schema only
    reaching itself through required parts has none."""
    value: Dict[int, bool] = {id(n): False for _, n in nodes}
    refs = {id(n): _resolve(root, n["$ref"], what) for _, n in nodes if "$ref" in n}

    def of(child) -> bool:
        if isinstance(child, bool):
            return child
        return value.get(id(child), True) if isinstance(child, dict) else True

    def finite(node: dict) -> bool:
        if "$ref" in node and refs[id(node)] is not None and not of(refs[id(node)]):
            return False
        if "allOf" in node and not all(of(c) for c in node["allOf"] or []):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and not any(of(c) for c in node[key]):
                return False
        if "enum" in node or "const" in node:
            return True
        return any(_kind_finite(node, kind, of) for kind in _types(node))

    for _ in range(len(nodes) + 1):  # each round settles at least one more node, or none is left
        changed = False
        for _, node in nodes:
            if not value[id(node)] and finite(node):
                value[id(node)] = changed = True
        if not changed:
            break
    return value


def _kind_finite(node: dict, kind: str, of) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        return all(of(props[name]) for name in node.get("required") or [] if isinstance(name, str) and name in props)
    if kind == "array":
        if not isinstance(node.get("minItems"), int) or node["minItems"] <= 0:
            return True
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        return all(of(c) for c in prefix[: node["minItems"]]) and (
            len(prefix) >= node["minItems"] or of(node.get("items", True)))
    return True


def _why(root: dict, finite: Dict[int, bool], what: str) -> str:
    """The chain of required properties and references from the root that comes back on itself, in words."""
    node, label, seen, chain = root, "the schema itself", {}, []
    while id(node) not in seen:
        seen[id(node)] = label
        ref = node.get("$ref")
        target = _resolve(root, ref, what) if ref is not None else None
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        name = next((n for n in node.get("required") or [] if isinstance(n, str) and isinstance(props.get(n), dict)
                     and not finite.get(id(props[n]), True)), None)
        if target is not None and not finite.get(id(target), True):
            chain.append(f"$ref {ref!r}")
            node, label = target, repr(ref)
        elif name is not None:
            chain.append(f"required property {name!r}")
            node, label = props[name], f"property {name!r}"
        elif _types(node) == ["array"] and isinstance(node.get("items"), dict) and not finite.get(id(node["items"]), True):
            chain.append(f"at least {node.get('minItems')} of its items")
            node, label = node["items"], f"the items of {label}"
        else:
            return f"{label} allows no value"
    return f"{' -> '.join(chain)} leads back to {seen[id(node)]}, so an answer would never end"
