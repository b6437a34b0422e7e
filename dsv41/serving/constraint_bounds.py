"""How large and how deep a constraint may be before anything compiles it.

llguidance compiles by recursion: each level of a JSON schema (through ``$ref`` too), of a grammar's
rule chain or of a group in a regex takes stack, and a few thousand levels overflow a thread's
8 MiB (SIGSEGV: ``tests/test_hostile_grammars.py`` compiles a 2,500-deep ``$ref`` chain of objects). So a constraint's
depth is measured here, by loops that never recurse, and one past ``MAX_DEPTH`` levels is refused,
as is one past ``MAX_BYTES``: a real schema or grammar is a few kilobytes and a few dozen levels.
These bounds catch the shapes foreseen; llguidance reads more than is measured here (a ``$ref`` to
an ``$anchor`` or an ``$id`` is not followed), and what passes them is compiled first in a process
of its own (``grammar_check``), where a crash costs one request.

Depth counts what a compiler descends through: a JSON schema's arrays and objects, a ``$ref`` as
a step into its target (a reference back into a schema being compiled, recursion that JSON Schema
allows, adds nothing: the compiler reuses the rule it is making); a grammar's rules, each one step
deeper than the rule naming it, plus its groups' nesting and its ``%json`` schemas' depth; a
regex's groups. Each ``measure`` returns the deepest path it finds.
"""
from __future__ import annotations

import json
import re
from urllib.parse import unquote

MAX_BYTES = 128 << 10       # a constraint's text (a schema as compact JSON, a grammar, a regex)
MAX_DEPTH = 128             # levels, as counted above

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_\-]*)(?:\.-?\d+)?\s*(?:::=|:)", re.M)


class TooLarge(ValueError):
    """A constraint past a bound (the message says which)."""


def check(kind: str, text: str) -> None:
    """Raises TooLarge for a constraint (``structured``'s kind and text) past either bound."""
    size = len(text.encode())
    if size > MAX_BYTES:
        raise TooLarge(f"{size} bytes is over the limit of {MAX_BYTES} bytes a constraint may have")
    within(depth_of(kind, text))


def depth_of(kind: str, text: str) -> int:
    return {"json": schema_depth, "regex": regex_depth, "grammar": grammar_depth, "lark": grammar_depth}.get(
        kind, text_depth)(text)


def within(depth: int) -> None:
    """Raises TooLarge for a depth past MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise TooLarge(f"nested {depth} levels deep, over the limit of {MAX_DEPTH} levels a constraint may have "
                       "(counting objects, arrays, $ref steps, rules and groups)")


def text_depth(text: str) -> int:
    """The nesting of JSON text's arrays and objects, its strings skipped (before json.loads, whose
    reader recurses)."""
    return max((depth for _, depth in _brackets(text)), default=0)


def _brackets(text: str, start: int = 0):
    """(index, depth after it) of each bracket of JSON text from start on, its strings skipped."""
    depth, quoted, escaped = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            yield j, depth
        elif ch in "]}":
            depth -= 1
            yield j, depth


def schema_depth(text: str) -> int:
    """A JSON schema's depth with each local ``$ref`` ("#", "#/a/b") a step into its target."""
    shallow = text_depth(text)
    if shallow > MAX_DEPTH:
        return shallow
    try:
        doc = json.loads(text)
    except ValueError:
        return shallow                   # not JSON: the compiler says so

    def children(node):
        values = node.values() if isinstance(node, dict) else node
        out = [v for v in values if isinstance(v, (dict, list))]
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _pointer(doc, ref) if isinstance(ref, str) else None
        return out + ([target] if isinstance(target, (dict, list)) else [])

    return _longest([doc], children)


def _pointer(doc, ref: str):
    """The value a local JSON pointer names (None: not a pointer into this document, or nothing there)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = doc
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _longest(starts: list, children, key=id, weight=lambda node: 1) -> int:
    """The heaviest path down from any of starts (the sum of its nodes' weights), by a loop: a step
    back into a node on the path is cut (recursion the compiler meets once)."""
    height: dict = {}
    for start in starts:
        if key(start) in height:
            continue
        on_path = {key(start)}
        stack = [(start, iter(children(start)), 0)]
        while stack:
            node, todo, best = stack[-1]
            child = next(todo, None)
            if child is None:
                stack.pop()
                height[key(node)] = best + weight(node)
                on_path.discard(key(node))
                if stack:
                    parent, rest, above = stack[-1]
                    stack[-1] = (parent, rest, max(above, height[key(node)]))
            elif key(child) in height:
                stack[-1] = (node, todo, max(best, height[key(child)]))
            elif key(child) not in on_path:
                on_path.add(key(child))
                stack.append((child, iter(children(child)), 0))
    return max(height[key(start)] for start in starts)


def regex_depth(text: str) -> int:
    """A regex's group nesting, escapes and character classes skipped."""
    depth = deepest = 0
    escaped = in_class = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def grammar_depth(text: str) -> int:
    """A Lark or GBNF grammar's depth: the longest chain of rules naming rules, each rule weighing
    one level plus its deepest group and its deepest ``%json`` schema."""
    gbnf = "::=" in text
    starts = [(m.start(), m.end(), m.group(1)) for m in _RULE.finditer(text)]
    rules: dict[str, tuple[int, set[str]]] = {}
    for i, (_, body, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        weight, names = _body(text[body:end], gbnf)
        old = rules.get(name, (0, set()))
        rules[name] = (max(old[0], weight), old[1] | names)
    if not rules:
        return _body(text, gbnf)[0]
    return _longest(list(rules), lambda n: [m for m in rules[n][1] if m in rules], key=str,
                    weight=lambda n: rules[n][0])


def _body(body: str, gbnf: bool) -> tuple[int, set[str]]:
    """(1 + the deepest group or %json schema, the names it refers to) of one rule's text."""
    names: set[str] = set()
    depth = deepest = 0
    i, n = 0, len(body)
    while i < n:
        ch = body[i]
        if ch in "\"'":                                   # a literal
            i = _closing(body, i, ch)
        elif (ch == "#" and gbnf) or (ch == "/" and not gbnf and body.startswith("//", i)):   # a comment
            j = body.find("\n", i)
            i = n if j < 0 else j
        elif ch == "/" and not gbnf:                      # a regex
            i = _closing(body, i, "/")
        elif ch == "[" and gbnf:                          # a character class
            i = _closing(body, i, "]")
        elif ch == "<":                                   # a special token, <[id]> or <name>
            i = body.find(">", i) + 1 or n
        elif ch == "%":                                   # a directive; %json's schema is measured
            m = _NAME.match(body, i + 1)
            i = m.end() if m else i + 1
            if m and m.group() == "json":
                j = body.find("{", i)
                if j >= 0:
                    end = _json_end(body, j)
                    deepest = max(deepest, depth + schema_depth(body[j:end]))
                    i = end
        elif ch in "([" or (ch == "{" and not gbnf):
            depth += 1
            deepest = max(deepest, depth)
            i += 1
        elif ch in ")]" or (ch == "}" and not gbnf):
            depth -= 1
            i += 1
        elif m := _NAME.match(body, i):
            names.add(m.group())
            i = m.end()
        else:
            i += 1
    return 1 + deepest, names


def _closing(text: str, i: int, close: str) -> int:
    """The index after the literal, regex or class opening at i (a backslash escapes)."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == close:
            return j + 1
        if text[j] == "\n":
            return j
        j += 1
    return j


def _json_end(text: str, i: int) -> int:
    """The index after the JSON object opening at i (strings skipped)."""
    return next((j + 1 for j, depth in _brackets(text, i) if depth == 0), len(text))
