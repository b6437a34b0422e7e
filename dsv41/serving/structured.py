"""Structured outputs: a request's constraint fields made into a compiled grammar (llguidance,
vLLM's ``guidance`` backend) that the engine masks each drawn row with (``engine.grammar``).

The fields, with vLLM's meaning: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
``tool_choice`` ``"required"`` or a named function (the DSML tool-call block the answer's parser
reads, each parameter's value constrained by its schema), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark or GBNF) and its newer
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). At
most one constraint a request. JSON is written compact (no whitespace between tokens, as vLLM's
``disable_any_whitespace``): a model cannot pad an answer with blank lines until its token limit.

Compiling runs where the request is checked (the server's check threads, off the event loop) and
is cached per constraint (``Compiler``).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

from dsv41.checkpoint.chat import VARIANTS
from dsv41.engine.grammar import Grammar, GrammarError, TokenTable

JSON_OPTIONS = {"whitespace_flexible": False}
CACHED = 256                      # compiled constraints kept (least recently used dropped)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
OUTPUTS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json"}


class Refused(ValueError):
    """A constraint field this server cannot serve: (field, message)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class Compiler:
    """Grammars over one tokenizer at the model's vocabulary width, compiled once per constraint."""

    def __init__(self, codec, vocab: int):
        self.codec, self.vocab = codec, vocab
        self._table: TokenTable | None = None
        self.cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def table(self) -> TokenTable:
        with self.lock:
            if self._table is None:          # made on first use: a server that serves none pays nothing
                self._table = TokenTable(self.codec.tokenizer, self.vocab, self.codec.eos_id)
            return self._table

    def grammar(self, kind: str, text: str, field: str) -> Grammar:
        """kind: json (a JSON schema's text), regex, choice (a JSON list's text), grammar, lark."""
        key = (kind, text)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        import llguidance
        try:
            if kind == "json":
                spec = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            else:
                spec = llguidance.grammar_from(kind, text)
            compiled = Grammar(self.table, spec, field)
        except (ValueError, GrammarError) as e:
            raise Refused(field, f"cannot be compiled: {str(e).strip()}") from None
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > CACHED:
                self.cache.popitem(last=False)
        return compiled


def _schema_text(value, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Refused(field, f"expected a JSON schema, found text that is not JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise Refused(field, f"expected a JSON schema (an object), found {type(value).__name__}")
    return json.dumps(value, sort_keys=True)


def _choices(value, field: str) -> str:
    if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        raise Refused(field, "expected a non-empty list of non-empty strings")
    return json.dumps(value)


def _text(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise Refused(field, "expected a non-empty string")
    return value


def _response_format(fmt) -> tuple[str, str] | None:
    if not isinstance(fmt, dict):
        raise Refused("response_format", f"expected an object, found {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise Refused("response_format", "json_schema needs {\"name\": ..., \"schema\": {...}}")
        return "json", _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise Refused("response_format", f"expected type \"text\", \"json_object\" or \"json_schema\", found {kind!r}")


def _structured_outputs(value) -> tuple[str, str, str]:
    if not isinstance(value, dict):
        raise Refused("structured_outputs", f"expected an object, found {type(value).__name__}")
    given = [k for k, v in value.items() if v is not None and v is not False]
    unknown = [k for k in given if k not in OUTPUTS]
    if unknown:
        raise Refused("structured_outputs", f"expected one of {', '.join(OUTPUTS)}, found {unknown[0]!r}")
    if len(given) != 1:
        raise Refused("structured_outputs", f"expected one constraint, found {len(given)}")
    name = given[0]
    field = f"structured_outputs.{name}"
    return (field, *_guided(name, value[name], field))


def _guided(name: str, value, field: str) -> tuple[str, str]:
    if name in ("guided_json", "json"):
        return "json", _schema_text(value, field)
    if name == "json_object":
        if value is not True:
            raise Refused(field, "expected true")
        return "json", json.dumps({"type": "object"})
    if name in ("guided_regex", "regex"):
        return "regex", _text(value, field)
    if name in ("guided_choice", "choice"):
        return "choice", _choices(value, field)
    return "grammar", _text(value, field)


def requested(body: dict) -> tuple[str, str, str] | None:
    """(field, kind, text) of the body's one constraint besides tool_choice, None without one."""
    found = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", *spec))
    for name in GUIDED:
        if body.get(name) is not None:
            found.append((name, *_guided(name, body[name], name)))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        raise Refused(found[1][0], f"one constraint a request, and {found[0][0]} is given too")
    return found[0] if found else None


# ---- tool calls --------------------------------------------------------------------------------------------

def _parameter(variant, dsml: str, name: str, schema: dict) -> str:
    """One DSML parameter line (Lark): a string's text as it is (its enum or pattern kept; free
    text without "<": a lexeme that could take the closing tag's "<" would run past it), any other
    value as JSON its schema constrains."""
    def tag(is_string: str) -> str:
        return f"\"<\" {dsml} \"{variant.parameter} name=\\\"{json.dumps(name)[1:-1]}\\\" string=\\\"{is_string}\\\">\""
    close = f"\"</\" {dsml} \"{variant.parameter}>\\n\""
    if isinstance(schema, dict) and schema.get("type") == "string" and not schema.get("format"):
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            value = "(" + " | ".join(json.dumps(e, ensure_ascii=False) for e in schema["enum"]) + ")"
        elif isinstance(schema.get("pattern"), str):    # matched whole: a subset of what the search allows
            value = "/" + schema["pattern"].replace("/", "\\/") + "/"
        else:
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            value = f"/[^<]{{{low},{'' if high is None else high}}}/"   # "<" begins the closing tag
        return f"{tag('true')} {value} {close}"
    sub = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else {"x-guidance": JSON_OPTIONS}
    return f"{tag('false')} %json {json.dumps(sub)} {close}"


def _parameters(params, where: str) -> dict:
    """A function's parameters held to what the call's grammar reads of them, as a response_format
    schema is held to its type (a 400 naming the field, never a failure of the server's own): an
    object schema (or none), its properties schemas, its required a list of their names, a string
    property's length bounds non-negative integers, its enum a list and its pattern a string (the
    rest of each schema llguidance compiles, and refuses with its message)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise Refused(where, f"expected a JSON schema (an object), found {_shown(params)}")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise Refused(f"{where}.properties", f"expected an object of property schemas, found {_shown(props)}")
    required = params.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise Refused(f"{where}.required", f"expected a list of property names, found {_shown(required)}")
    for name, schema in props.items():
        at = f"{where}.properties.{name}"
        if not isinstance(schema, (dict, bool)):
            raise Refused(at, f"expected a JSON schema (an object), found {_shown(schema)}")
        if not isinstance(schema, dict):
            continue
        for key in ("minLength", "maxLength"):
            value = schema.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise Refused(f"{at}.{key}", f"expected a non-negative integer, found {_shown(value)}")
        if "maxLength" in schema and schema["maxLength"] < schema.get("minLength", 0):
            raise Refused(f"{at}.maxLength", f"{schema['maxLength']} is below minLength {schema['minLength']}")
        for key, kind in (("enum", list), ("pattern", str)):
            if key in schema and not isinstance(schema[key], kind):
                raise Refused(f"{at}.{key}", f"expected a {kind.__name__}, found {_shown(schema[key])}")
    return params


def _shown(value) -> str:
    """A refused value: a number, true/false/null as written, anything longer by its type alone."""
    return json.dumps(value) if value is None or isinstance(value, (bool, int, float)) else type(value).__name__


def tool_grammar(tools: list, choice, chat_format: str, dsml_id: int) -> tuple[str, str]:
    """(field, Lark text) of the DSML block ``tool_choice`` asks for: "required", at least one
    call of the offered tools; a named function, exactly one call of it. dsml_id: the DSML
    control token (a Lark grammar names a special token by its id)."""
    dsml = f"<[{dsml_id}]>"
    if chat_format not in VARIANTS:
        raise Refused("tool_choice", f"forcing a call needs the DeepSeek tool-call format; the {chat_format} "
                                     "chat format has none")
    variant = VARIANTS[chat_format]
    functions = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            functions[fn["name"]] = _parameters(fn.get("parameters"), f"tools[{i}].function.parameters")
    if not functions:
        raise Refused("tool_choice", "forcing a call needs tools")
    if choice != "required":
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in functions:
            raise Refused("tool_choice", f"expected \"none\", \"auto\", \"required\" or a function of tools, "
                                         f"found {choice!r}")
        functions = {name: functions[name]}
    rules, invokes = [], []
    for i, (name, params) in enumerate(functions.items()):
        props = params.get("properties") or {}
        need = set(params.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            rules.append(f"p{i}_{j}: {_parameter(variant, dsml, pname, pschema)}")
            parts.append(f"p{i}_{j}" + ("" if pname in need else "?"))
        invoke = f"\"<\" {dsml} \"{variant.invoke} name=\\\"{json.dumps(name)[1:-1]}\\\">\\n\" " + \
                 " ".join(parts) + f" \"</\" {dsml} \"{variant.invoke}>\\n\""
        rules.append(f"invoke{i}: {invoke}")
        invokes.append(f"invoke{i}")
    calls = "(" + " | ".join(invokes) + ")" + ("+" if choice == "required" else "")
    start = f"start: \"<\" {dsml} \"{variant.calls}>\\n\" {calls} \"</\" {dsml} \"{variant.calls}>\""
    return "tool_choice", "\n".join([start, *rules])
